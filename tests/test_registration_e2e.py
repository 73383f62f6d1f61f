"""An agent whose own registration vanishes from etcd while its lease lives (``etcdctl del``, a mistaken cleanup)
registers again instead of waiting for itself (issue 27): real etcd, real agents and workers."""

from __future__ import annotations

import asyncio
import time

import pytest
from faults import Job, faults_env, hold_at
from test_rdzv_etcd import agents, settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = 20


async def _delete(endpoint: str, key: str) -> None:
    from tpassrun.rendezvous import EtcdConfig, EtcdStore

    async with EtcdStore(EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})) as store:
        await store.delete(key)


def test_a_deleted_registration_is_written_again(etcd_server, run_id):
    """The handle notices its ``nodes/<id>`` gone (a delete, not its lease's expiry) and puts it back, sealed and
    under its lease, while it runs and before any join waits on it."""
    async def main() -> None:
        async with agents(etcd_server.endpoint, settings(run_id, 1, 1), ["a"]) as (a,):
            await a.join()
            key = a.key("nodes", "a")
            before, _ = await a.store.get_json(key)
            await _delete(etcd_server.endpoint, key)   # by someone else: the handle did not ask for it
            deadline = time.monotonic() + 20
            while (await a.store.get_json(key))[0] != before:
                assert time.monotonic() < deadline, "the registration was not written again"
                await asyncio.sleep(0.05)
            res = await a.store.connection.acquire()
            (kv,) = list(await res[0].get_prefix(key.encode()))
            assert kv.lease == a.store.lease_id

    asyncio.run(main())


def test_an_agent_whose_registration_is_deleted_mid_run_finishes_the_job(tmp_path, etcd_server, run_id):
    """Before: the agent killed its workers (its node had left the generation) and then waited for a generation
    that includes it, forever: nobody registers it again. Now it registers again at once, the group re-forms
    with it (a membership change, not a restart that counts) and the job finishes."""
    train = str(tmp_path / "train")
    hold = hold_at(tmp_path, 5)
    job = Job.agent(str(tmp_path / "a"), train, endpoint=etcd_server.endpoint, run_id=run_id, nnodes="1",
                    steps=STEPS, env=faults_env(hold.fault)).start()
    try:
        hold.wait_reached(job)
        node = job.node_id()
        asyncio.run(_delete(etcd_server.endpoint, f"/tpassrun/v1/{run_id}/nodes/{node}"))
        hold.release()
        code = job.wait(200)
    finally:
        hold.release()
        job.kill()
    assert code == 0, job.log()[-3000:]
    rows = Job(argv=[], out=train).losses(0)
    assert rows and rows[-1]["step"] == STEPS - 1, job.log()[-3000:]
    assert "registration" in job.log() and "again" in job.log(), job.log()[-3000:]
