"""A pool node's loop on a real etcd (``tpassctl pool join``'s body, in this process): idle in the pool; a sealed
claim starts the claiming job's spare node (a real child process, with the job's run key opened from the claim's
box and never the pool key); a release stops it and the node is idle again; a claimer that dies before the spare
node joined frees the node; a claim without the pool key's seal is refused.

The child here stands in for ``python -m tpassrun --spare-node``: it records its command line and environment,
says its workers started (in its event log, as the agent does) and waits for SIGTERM. The real spare node is run by
the e2e (tests/test_pool_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time

import pytest

from tpassrun.pool import Claim, JobSpec, Pool, PoolKeys, PoolNode, box, pool_prefix
from tpassrun.pool.node import PoolNodeLoop
from tpassrun.records.provenance import RunKey
from tpassrun.rendezvous import EtcdConfig, EtcdStore

pytestmark = pytest.mark.timeout(120)
KEY = RunKey.from_text("pool-key-for-tests-0123456789")

FAKE = """#!{python}
import json, os, signal, sys, time
argv = sys.argv[1:]
log = argv[argv.index("--event-log") + 1]
out = os.environ["POOL_TEST_OUT"]
with open(out, "a") as fh:
    fh.write(json.dumps({{"argv": argv, "run_key": os.environ.get("TPASSRUN_RUN_KEY"),
                          "pool_key": "TPASSRUN_POOL_KEY" in os.environ, "job_env": os.environ.get("JOB_VAR")}}) + "\\n")
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
hold = os.environ.get("POOL_TEST_HOLD")
while hold and not os.path.exists(hold):
    time.sleep(0.05)
with open(log, "a") as fh:
    fh.write(json.dumps({{"event": "workers_started", "node": "agent-" + str(os.getpid())}}) + "\\n")
while True:
    time.sleep(0.1)
"""


async def _until(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = await pred()
        if value:
            return value
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_pool_node_idle_claimed_released_idle_and_a_dead_claimer_frees_it(etcd_server, run_id, tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out, hold = tmp_path / "children.jsonl", tmp_path / "hold"
    said: list[str] = []
    spec = JobSpec(run_id="jobA", endpoint=etcd_server.endpoint, rdzv_conf="lease_ttl=3", nproc_per_node=2,
                   entrypoint="train.py", args=("--steps", "3"), env={"JOB_VAR": "x"}, nnodes="2",
                   run_key_box=box(KEY, "the-job-run-key-0123456789"))

    async def main() -> None:
        cfg = EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})
        keys = PoolKeys(pool_prefix("/tpassrun/v1", run_id))
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as node_store:
            pool = Pool(admin, keys, KEY, run_id)
            await pool.create()
            env = {"PATH": os.environ["PATH"], "POOL_TEST_OUT": str(out), "TPASSRUN_POOL_KEY": "secret-pool-key-123",
                   "POOL_TEST_HOLD": str(hold)}
            loop = PoolNodeLoop(Pool(node_store, keys, KEY, run_id), PoolNode("p1", "h", 2, time.time()),
                                say=said.append, base_env=env, python=str(fake))
            stop = asyncio.Event()
            task = asyncio.create_task(loop.run(stop))
            try:
                async def node_state():
                    view, revs, _ = await pool.read()
                    n = view.nodes.get("p1")
                    return (n.state, n.job, revs["p1"]) if n else None
                state, _, rev = await _until(node_state, "the pool node never registered")
                assert state == "idle"

                # a claimer that dies before the spare node joined: the claim expires, the node stops it
                claimer = EtcdStore(cfg, lease_ttl=2)
                await claimer.open()
                claim = Claim("p1", "jobA", "leaderA", 1, time.time(), "node lost", spec)
                assert await Pool(claimer, keys, KEY, run_id).claim(claim, rev)
                await _until(lambda: _serving(pool, "jobA"), "the claim did not start the spare node")

                async def child_up():
                    return out.exists() and out.read_text().count("\n") >= 1
                await _until(child_up, "the spare node did not start")
                claimer._keepalive.cancel()
                await _until(lambda: _idle(pool), "a dead claimer's node did not return idle")
                claimer._lease = None
                await claimer.close()

                # claimed, joined, released: idle again
                hold.touch()
                async with EtcdStore(cfg, lease_ttl=10) as job_b:
                    _, revs, _ = await pool.read()
                    claim_b = Claim("p1", "jobB", "leaderB", 1, time.time(), "node lost",
                                    JobSpec(**{**spec.__dict__, "run_id": "jobB"}))
                    assert await Pool(job_b, keys, KEY, run_id).claim(claim_b, revs["p1"])
                    await _until(lambda: _history_has(pool, "joined"), "the spare node never joined")
                    view, _, _ = await pool.read()
                    assert view.nodes["p1"].state == "serving" and view.nodes["p1"].job == "jobB"
                    assert await Pool(job_b, keys, KEY, run_id).release("p1", "jobB", "the claimer left")
                    await asyncio.sleep(0.5)
                    assert await _serving(pool, "jobB")          # joined: the job holds it until it exits
                    os.killpg(loop.child.pid, 15)                 # the job ended: its spare node exits
                    await _until(lambda: _idle(pool), "a node whose spare node exited did not return idle")

                # a claim without the pool key's seal: refused
                await admin.put_json(keys.claim("p1"), claim.to_json())
                await _until(lambda: _said(said, "without the pool key"), "a foreign claim was not refused")
                assert await _idle(pool)
                assert loop.served == ["jobA", "jobB"]
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)
                await pool.delete()

    asyncio.run(main())
    children = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(children) == 2
    for c, job in zip(children, ("jobA", "jobB")):
        assert c["run_key"] == "the-job-run-key-0123456789" and not c["pool_key"] and c["job_env"] == "x"
        argv = c["argv"]
        argv = argv[argv.index("-m"):]                       # after the die-with-parent wrapper
        assert argv[:3] == ["-m", "tpassrun", "--spare-node"] and argv[argv.index("--rdzv-id") + 1] == job
        assert argv[-3:] == ["train.py", "--steps", "3"]
    assert any("refusing a claim without the pool key" in s for s in said), said


async def _serving(pool: Pool, job: str) -> bool:
    view, _, _ = await pool.read()
    return view.nodes.get("p1") is not None and view.nodes["p1"].state == "serving" and view.nodes["p1"].job == job


async def _idle(pool: Pool) -> bool:
    view, _, _ = await pool.read()
    return view.nodes.get("p1") is not None and view.nodes["p1"].state == "idle" and "p1" not in view.claims


async def _history_has(pool: Pool, event: str) -> bool:
    _, _, history = await pool.read()
    return any(h.event == event for h in history)


async def _said(said: list[str], text: str) -> bool:
    return any(text in s for s in said)


def test_tpassctl_pool_create_status_and_bad_input(etcd_server, run_id, capsys, monkeypatch):
    from tpassrun.ops.ctl import main

    ep = ["--rdzv-endpoint", etcd_server.endpoint]
    monkeypatch.delenv("TPASSRUN_POOL_KEY", raising=False)
    assert main(["pool", "status", run_id, *ep]) == 1
    assert "no pool key" in capsys.readouterr().err
    monkeypatch.setenv("TPASSRUN_POOL_KEY", "pool-key-for-tests-0123456789")
    assert main(["pool", "status", run_id, *ep]) == 1
    err = capsys.readouterr().err
    assert "does not exist" in err and err.count("\n") == 1
    try:
        assert main(["pool", "create", run_id, *ep]) == 0
        assert main(["pool", "status", run_id, *ep, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out.split("\n", 1)[1])
        assert doc["exists"] and doc["nodes"] == [] and doc["gauges"]["tpassrun_pool_idle_nodes"] == 0
        assert main(["pool", "status", run_id, *ep, "--prometheus"]) == 0
        assert f'tpassrun_pool_idle_nodes{{pool="{run_id}"}} 0' in capsys.readouterr().out
        monkeypatch.setenv("TPASSRUN_POOL_KEY", "another-pool-key-0123456789")
        assert main(["pool", "status", run_id, *ep]) == 1
        assert "another pool key" in capsys.readouterr().err
    finally:
        monkeypatch.setenv("TPASSRUN_POOL_KEY", "pool-key-for-tests-0123456789")
        assert main(["pool", "delete", run_id, *ep]) == 0
