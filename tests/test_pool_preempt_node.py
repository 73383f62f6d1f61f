"""Issue 24, item 3, on a real etcd in one process: a pool node's real loop, a low-priority job's members
(``tpassrun.pool.members``) and a high-priority job's pool (``JobPool.need``, what its leader's coordinator does on
``ClaimFromPool``), each on its own etcd lease.

The low job claims the idle pool node as a member; the node starts its member node (a stand-in child that ignores
SIGTERM). A pre-emption request without the pool key's seal and one of an equal priority are refused; the high
job's request (its plan: ``Preempt``) is said by both jobs in one line each; the node SIGTERMs the member, SIGKILLs
it after the grace, notes ``preempted``, drops the victim's claim and the request and is idle; the high job's next
look claims it and the node starts its spare node. The real agents: tests/test_pool_preempt_e2e.py."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import time

import pytest

from tpassrun.pool import JobSpec, Pool, PoolKeys, PoolNode, pool_prefix
from tpassrun.pool.job import JobPool
from tpassrun.pool.members import PoolMembers
from tpassrun.pool.node import PoolNodeLoop
from tpassrun.records.pool import PreemptRequest, pool_seal
from tpassrun.records.provenance import RunKey
from tpassrun.rendezvous import EtcdConfig, EtcdStore
from tpassrun.settings import LaunchConfig

pytestmark = pytest.mark.timeout(120)
KEY = RunKey.from_text("pool-key-for-tests-0123456789")

# stands in for `python -m tpassrun ...`: says its workers started; a member node ignores SIGTERM (one that does
# not leave: the grace's SIGKILL ends it)
STUBBORN = """#!{python}
import json, signal, sys, time
argv = sys.argv[1:]
if "--spare-node" not in argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(argv[argv.index("--event-log") + 1], "a") as fh:
    fh.write(json.dumps({{"event": "workers_started", "node": "member-agent"}}) + "\\n")
with open({out!r}, "a") as fh:
    fh.write(" ".join(argv) + "\\n")
while True:
    time.sleep(0.1)
"""


async def _until(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := await pred()):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)
    return value


def test_a_high_priority_job_takes_a_pool_node_from_a_low_priority_member(etcd_server, run_id, tmp_path):
    fake, out = tmp_path / "python", tmp_path / "children.txt"
    fake.write_text(STUBBORN.format(python=sys.executable, out=str(out)))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    node_said: list[str] = []
    low_said: list[tuple[str, dict]] = []
    high_said: list[tuple[str, dict]] = []

    def spec(job: str) -> JobSpec:
        return JobSpec(run_id=job, endpoint=etcd_server.endpoint, rdzv_conf="", nproc_per_node=2,
                       entrypoint="/w/train.py", args=(), nnodes="1:2")

    async def main() -> None:
        cfg = EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})
        keys = PoolKeys(pool_prefix("/tpassrun/v1", run_id))
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as node_store, \
                EtcdStore(cfg, lease_ttl=10) as low_store, EtcdStore(cfg, lease_ttl=10) as high_store:
            pool = Pool(admin, keys, KEY, run_id)
            await pool.create()
            loop = PoolNodeLoop(Pool(node_store, keys, KEY, run_id), PoolNode("p1", "h", 2, time.time()),
                                say=node_said.append, base_env={"PATH": os.environ["PATH"]}, python=str(fake),
                                preempt_grace=1.0)
            stop = asyncio.Event()
            task = asyncio.create_task(loop.run(stop))
            watch: asyncio.Task[None] | None = None
            try:
                await _until(lambda: _state(pool, "idle"), "the pool node never registered idle")
                low = PoolMembers(JobPool(Pool(low_store, keys, KEY, run_id),
                                          LaunchConfig(rdzv_id="low", priority=1, nproc_per_node=2, min_nodes=1,
                                                       max_nodes=2), spec("low"), "lowleader"))
                assert await low.take(1, lambda ev, **kw: low_said.append((ev, kw))) == ["p1"]
                watch = asyncio.create_task(low.watch(lambda ev, **kw: low_said.append((ev, kw)), lambda: 2))
                await _until(lambda: _history(pool, "joined"), "the member node never joined")
                member = loop.child

                # refused: a request without the pool key's seal, and one of an equal priority
                bad = PreemptRequest("p1", "mallory", "m", 9, time.time(), "x")
                await admin.put_json(keys.preempt("p1"), bad.to_json())
                await _until(lambda: _said(node_said, "without the pool key's seal"), "an unsealed request acted on")
                equal = PreemptRequest("p1", "peer", "m", 1, time.time(), "x")
                await admin.put_json(keys.preempt("p1"), pool_seal(KEY, keys.preempt("p1"), equal.to_json()))
                await _until(lambda: _said(node_said, "peer (priority 1) is not above low"), "an equal one acted on")
                assert await _state(pool, "serving") and loop.child is not None and loop.child.returncode is None
                await admin.delete(keys.preempt("p1"))

                high = JobPool(Pool(high_store, keys, KEY, run_id),
                               LaunchConfig(rdzv_id="high", priority=5, nproc_per_node=2, pool_wait=60),
                               spec("high"), "highleader")
                say = lambda ev, **kw: high_said.append((ev, kw))      # noqa: E731
                await high.need(("b",), 0, say)
                assert high_said[0][0] == "pool_preempting" and high_said[0][1]["victim"] == "low"
                assert "(priority 1 < 5)" in high_said[0][1]["reason"]
                await high.need(("b",), 0, say)     # asked once: the request stands until the node acted on it
                assert [e for e, _ in high_said].count("pool_preempting") == 1
                await _until(lambda: _said([kw.get("reason", "") for _, kw in low_said], "taken back"),
                             "the low job did not say it")
                await _until(lambda: _history(pool, "idle"), "the pre-empted node did not return idle")
                assert member is not None and member.returncode == -9          # it ignored SIGTERM: SIGKILLed

                async def claimed() -> bool:
                    await high.need(("b",), 0, say)
                    return "pool_claimed" in [e for e, _ in high_said]
                await _until(claimed, "the high job did not claim the idle node")
                view, _, history = await pool.read()
                assert view.claims["p1"].job == "high" and "p1" not in view.preempts
                assert [h.event for h in history].count("preempted") == 1
                # (a look between the node's drop of the victim's claim and its idle record waits: "pool_waiting")
                assert [e for e, _ in high_said if e != "pool_waiting"] == ["pool_preempting", "pool_claimed"]
                await _until(lambda: _serving_high(pool), "the high job's claim was not served")

                async def two_children() -> bool:
                    return out.exists() and len(out.read_text().splitlines()) == 2
                await _until(two_children, "the high job's spare node did not start")
            finally:
                if watch is not None:
                    watch.cancel()
                stop.set()
                await asyncio.wait_for(task, 30)
                await pool.delete()

    asyncio.run(main())
    taken = [kw for ev, kw in low_said if ev == "pool_taken_back"]
    assert len(taken) == 1 and taken[0]["reason"] == ("pool node p1 taken back by job high (priority 5): shrinking "
                                                      "to 1 nodes")
    lines = out.read_text().splitlines()
    assert len(lines) == 2 and "--spare-node" not in lines[0] and "--spare-node" in lines[1]


async def _state(pool: Pool, state: str) -> bool:
    view, _, _ = await pool.read()
    n = view.nodes.get("p1")
    return n is not None and n.state == state and (state != "idle" or "p1" not in view.claims)


async def _serving_high(pool: Pool) -> bool:
    view, _, _ = await pool.read()
    return view.nodes.get("p1") is not None and view.nodes["p1"].job == "high"


async def _history(pool: Pool, event: str) -> bool:
    _, _, history = await pool.read()
    return any(h.event == event for h in history)


async def _said(said: list[str], text: str) -> bool:
    return any(text in s for s in said)
