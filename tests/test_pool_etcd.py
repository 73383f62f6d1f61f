"""Spare pool on a real etcd, many agents in one process: a claim is one compare-and-set bound to the claimer's
lease, so two jobs claiming one pool node at the same instant never both win, a claimer that dies frees its claim,
a job cannot release another job's claim, and a pool or claim written without the pool key is not seen."""

from __future__ import annotations

import asyncio
import time

import pytest

from tpassrun.pool import Claim, JobSpec, Pool, PoolError, PoolKeys, PoolNode, pool_prefix
from tpassrun.records.provenance import RunKey
from tpassrun.rendezvous import EtcdConfig, EtcdStore

pytestmark = pytest.mark.timeout(120)
KEY = RunKey.from_text("pool-key-for-tests-0123456789")
OTHER = RunKey.from_text("another-pool-key-0123456789")
SPEC = JobSpec(run_id="j", endpoint="e", rdzv_conf="", nproc_per_node=1, entrypoint="t.py", args=())


def _cfg(endpoint: str) -> EtcdConfig:
    return EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})


def _pool(store: EtcdStore, name: str, key: RunKey = KEY) -> Pool:
    return Pool(store, PoolKeys(pool_prefix("/tpassrun/v1", name)), key, name)


def _claim(node_id: str, job: str) -> Claim:
    return Claim(node_id=node_id, job=job, claimer=f"{job}-leader", priority=1, since=time.time(),
                 reason="node lost", spec=SPEC)


def test_two_jobs_claim_one_pool_node_at_the_same_instant_exactly_one_wins(etcd_server, run_id):
    async def main() -> list[int]:
        cfg = _cfg(etcd_server.endpoint)
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as node_store:
            pool = _pool(admin, run_id)
            assert await pool.create()
            assert not await pool.create()                       # exists: never overwritten
            await _pool(node_store, run_id).register(PoolNode("p1", "h", 1, time.time()))
            winners = []
            try:
                for trial in range(20):
                    a, b = EtcdStore(cfg, lease_ttl=10), EtcdStore(cfg, lease_ttl=10)
                    await asyncio.gather(a.open(), b.open())
                    try:
                        view, revs, _ = await pool.read()
                        assert "p1" not in view.claims
                        won = await asyncio.gather(_pool(a, run_id).claim(_claim("p1", "jobA"), revs["p1"]),
                                                   _pool(b, run_id).claim(_claim("p1", "jobB"), revs["p1"]))
                        view, _, _ = await pool.read()
                        assert sum(won) == 1 and len(view.claims) == 1, (trial, won)
                        winners.append(0 if won[0] else 1)
                    finally:
                        await asyncio.gather(a.close(), b.close())   # revoking the lease frees the claim
                    view, _, _ = await pool.read()
                    assert not view.claims
                return winners
            finally:
                await pool.delete()

    winners = asyncio.run(main())
    print(f"\n20 trials, two jobs claiming one pool node at once: exactly one claim won in "
          f"{len(winners)}/20 (job A {winners.count(0)}, job B {winners.count(1)}); never two")
    assert len(winners) == 20


def test_a_claimer_that_dies_frees_the_claim_and_others_cannot_release_it(etcd_server, run_id):
    async def main() -> None:
        cfg = _cfg(etcd_server.endpoint)
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as node_store, \
                EtcdStore(cfg, lease_ttl=10) as other:
            pool = _pool(admin, run_id)
            await pool.create()
            try:
                await _pool(node_store, run_id).register(PoolNode("p1", "h", 1, time.time()))
                claimer = EtcdStore(cfg, lease_ttl=2)
                await claimer.open()
                _, revs, _ = await pool.read()
                assert await _pool(claimer, run_id).claim(_claim("p1", "jobA"), revs["p1"])
                assert not await _pool(other, run_id).release("p1", "jobB", "not mine")
                assert "p1" in (await pool.read())[0].claims
                claimer._keepalive.cancel()                        # the claimer dies: no revoke, no keepalive
                deadline = time.monotonic() + 30
                while "p1" in (await pool.read())[0].claims:
                    assert time.monotonic() < deadline, "the claim outlived its claimer's lease"
                    await asyncio.sleep(0.2)
                _, revs, _ = await pool.read()
                assert await _pool(other, run_id).claim(_claim("p1", "jobB"), revs["p1"])   # free again
                assert await _pool(other, run_id).release("p1", "jobB", "done")
                claimer._lease = None
                await claimer.close()
                history = [h.event for h in (await pool.read())[2]]
                assert history.count("claimed") == 2 and "released" in history
            finally:
                await pool.delete()

    asyncio.run(main())


def test_a_stale_read_or_a_departed_node_cannot_be_claimed(etcd_server, run_id):
    async def main() -> None:
        cfg = _cfg(etcd_server.endpoint)
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as job:
            pool = _pool(admin, run_id)
            await pool.create()
            try:
                node_store = EtcdStore(cfg, lease_ttl=10)
                await node_store.open()
                await _pool(node_store, run_id).register(PoolNode("p1", "h", 1, time.time()))
                _, revs, _ = await pool.read()
                await _pool(node_store, run_id).register(PoolNode("p1", "h", 1, time.time(), "serving", "x"))
                assert not await _pool(job, run_id).claim(_claim("p1", "jobA"), revs["p1"])   # changed since read
                _, revs, _ = await pool.read()
                await node_store.close()                          # the node leaves (its lease revoked)
                assert not await _pool(job, run_id).claim(_claim("p1", "jobA"), revs["p1"])
            finally:
                await pool.delete()

    asyncio.run(main())


def test_records_without_the_pool_key_are_not_seen_and_bad_pools_say_why_in_one_line(etcd_server, run_id):
    async def main() -> None:
        cfg = _cfg(etcd_server.endpoint)
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as stranger:
            with pytest.raises(PoolError, match="does not exist"):
                await _pool(admin, run_id).check()
            pool = _pool(admin, run_id)
            await pool.create()
            try:
                assert (await pool.check()).name == run_id
                with pytest.raises(PoolError, match="another pool key") as err:
                    await _pool(admin, run_id, OTHER).check()
                assert "\n" not in str(err.value)
                await _pool(stranger, run_id, OTHER).register(PoolNode("evil", "h", 8, time.time()))
                await stranger.put_json(pool.keys.claim("p9"), _claim("p9", "evil").to_json())
                view, _, _ = await pool.read()
                assert not view.nodes and not view.claims
            finally:
                await pool.delete()

    asyncio.run(main())


def test_a_jobs_leader_waits_claims_asks_again_when_dropped_and_gives_up_after_pool_wait(etcd_server, run_id):
    from tpassrun.pool.job import JobPool, job_spec, shipped_env
    from tpassrun.settings import LaunchConfig

    cfg = LaunchConfig(rdzv_id="jobA", spare_pool=run_id, training_script="train.py", nproc_per_node=1,
                       pool_wait=30.0, min_nodes=2, max_nodes=2)
    env = {"TPASSRUN_RUN_KEY": "k" * 20, "TPASSRUN_POOL_KEY": "p" * 20, "CUDA_VISIBLE_DEVICES": "0", "MY_VAR": "1",
           "SSH_AUTH_SOCK": "/x"}
    assert shipped_env(env) == {"MY_VAR": "1"}
    spec = job_spec(cfg, "e:2379", env, "k" * 20, KEY, "/work")
    assert spec.entrypoint == "/work/train.py" and spec.nnodes == "2" and spec.env == {"MY_VAR": "1"}
    now = [1000.0]
    said: list[tuple[str, dict]] = []

    async def main() -> None:
        c = _cfg(etcd_server.endpoint)
        async with EtcdStore(c) as admin, EtcdStore(c, lease_ttl=10) as leader, EtcdStore(c, lease_ttl=10) as ns:
            pool = _pool(admin, run_id)
            await pool.create()
            try:
                jp = JobPool(pool=_pool(leader, run_id), cfg=cfg, spec=spec, node_id="a", clock=lambda: now[0])
                say = lambda event, **f: said.append((event, f))      # noqa: E731
                await jp.need(("b",), 0, say)
                assert said[-1][0] == "pool_waiting" and "the pool has no node" in said[-1][1]["reason"]
                n = len(said)
                now[0] += 2
                await jp.need(("b",), 0, say)                                  # not again within a few seconds
                assert len(said) == n
                now[0] += 3                                                    # then how long, and why, again
                await jp.need(("b",), 0, say)
                assert said[-1][0] == "pool_waiting" and said[-1][1]["waited"] == 5.0 \
                    and said[-1][1]["wait_limit"] == 30.0 and "the pool has no node" in said[-1][1]["reason"]
                await _pool(ns, run_id).register(PoolNode("p1", "h", 1, time.time()))
                now[0] += 5
                await jp.need(("b",), 0, say)
                assert said[-1][0] == "pool_claimed" and said[-1][1]["waited"] == 10.0 and jp.held == {"b": "p1"}
                now[0] += 6                                                    # its spares start from cold
                await jp.need(("b",), 0, say)
                assert said[-1][0] == "pool_waiting" and said[-1][1]["waited"] == 16.0 \
                    and "pool node p1 claimed 6 s ago; its spares are starting" in said[-1][1]["reason"]
                await _pool(ns, run_id).drop_claim("p1")                      # the pool node dropped it
                await jp.need(("b",), 0, say)
                assert [e for e, _ in said[-2:]] == ["pool_waiting", "pool_claimed"]
                now[0] += 34                                                   # its spares never came up
                await jp.need(("b",), 0, say)
                assert said[-1][0] == "pool_gave_up" and jp.gave_up == {"b"} and not jp.held
                assert not (await pool.read())[0].claims
            finally:
                await pool.delete()

    asyncio.run(main())
