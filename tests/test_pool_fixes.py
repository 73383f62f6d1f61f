"""Issue 24's four findings of the two-jobs acceptance on separate hosts: each a pure or one-process test."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import types
from dataclasses import replace
from typing import Awaitable, Callable

import pytest
from test_pool_races import POOL_KEY, _HostlessPoolNode, _port
from test_pool_races import SPEC as RACE_SPEC

from tpassrun.agent import given_back_reason
from tpassrun.launch.config import parse_args
from tpassrun.ops.console import Describer, summary_lines
from tpassrun.pool import Pool, PoolKeys, PoolNode, PoolView, pool_prefix
from tpassrun.pool.ctl import check_local_addr
from tpassrun.pool.job import JobPool
from tpassrun.pool.node import host_local, spare_node_argv, spare_node_env
from tpassrun.pool.plan import (
    BecomeIdle,
    ChildExited,
    ChildJoined,
    ChildStarted,
    ClaimGone,
    ClaimSeen,
    JobNeed,
    NodeState,
    Phase,
    StopSpare,
    plan_job,
    plan_node,
)
from tpassrun.records.pool import IDLE, SERVING, Claim, JobSpec
from tpassrun.rendezvous import EtcdConfig, EtcdStore
from tpassrun.settings import LaunchConfig
from tpassrun.swapper import Swapper

SPEC = JobSpec(run_id="job", endpoint="127.0.0.1:2379", rdzv_conf="", nproc_per_node=2, entrypoint="/w/train.py",
               args=(), env={"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0",
                             "UCX_NET_DEVICES": "mlx5_0:1", "OMP_NUM_THREADS": "4", "LR": "0.1"})


def test_host_local_variables_set_on_the_pool_node_win_over_the_shipped_ones():
    """The acceptance on separate hosts had to give every namespace the same NIC name: the job's shipped
    GLOO_SOCKET_IFNAME replaced the pool node's own, so a pool node with another NIC name bound a link it lacks."""
    base = {"GLOO_SOCKET_IFNAME": "ib0", "CUDA_VISIBLE_DEVICES": "4,5", "NCCL_IB_HCA": "mlx5_2",
            "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    env = spare_node_env(SPEC, base, "runkey")
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_IB_HCA"] == "mlx5_2" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    # the node sets none: the job's value is the best guess there is
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["UCX_NET_DEVICES"] == "mlx5_0:1"
    # the job's worker environment still wins for everything else
    assert env["OMP_NUM_THREADS"] == "4" and env["LR"] == "0.1" and env["PATH"] == "/bin"
    assert all(host_local(k) for k in ("TP_SOCKET_IFNAME", "HIP_VISIBLE_DEVICES", "NCCL_TOPO_FILE"))
    assert not any(host_local(k) for k in ("NCCL_DEBUG", "MASTER_PORT", "IFNAME", "OMP_NUM_THREADS"))


def test_pool_join_local_addr_reaches_the_nodes_it_starts_and_bad_input_is_one_line(capsys, monkeypatch):
    """The acceptance on separate hosts had to give the pool node its address through PET_LOCAL_ADDR: `tpassctl
    pool join` had no --local-addr, and the spare node it starts advertised getfqdn()."""
    from tpassrun.ops.ctl import main

    for member in (False, True):
        argv = spare_node_argv(SPEC, "/tmp/ev.jsonl", "python", member=member, local_addr="10.0.0.7")
        cfg = parse_args(argv[argv.index("tpassrun") + 1:], {}, accelerator_count=lambda _: 0)
        assert cfg.local_addr == "10.0.0.7" and cfg.training_script == "/w/train.py"
    assert "--local-addr" not in spare_node_argv(SPEC, "/tmp/ev.jsonl", "python")
    assert [check_local_addr(a) for a in ("10.0.0.7", "::1", "node7.cluster", "node7.cluster.", "n_1")] == \
        ["10.0.0.7", "::1", "node7.cluster", "node7.cluster.", "n_1"]
    monkeypatch.setenv("TPASSRUN_POOL_KEY", "pool-key-for-tests-0123456789")
    for bad in ("", "a b", "-x", "a..b", "host:29500", "x" * 64):
        with pytest.raises(ValueError):
            check_local_addr(bad)
        # no etcd is reached: the address is refused before anything runs
        assert main(["pool", "join", "p", "--rdzv-endpoint", "127.0.0.1:1", f"--local-addr={bad}"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("tpassctl pool: error: --local-addr") and err.count("\n") == 1, err


class _Node(_HostlessPoolNode):
    """The race tests' pool node (the spare node's start recorded, not run) whose recorded spare node exits when
    it is stopped, as a real one does."""

    async def _stop_child(self, why: str, grace: float = 0.0) -> None:
        if self.phase is Phase.STOPPING:
            self.events.put_nowait(ChildExited(0))


async def _until(cond, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(1000):
        if await cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"never: {what}")


@contextlib.asynccontextmanager
async def _pool_and_leader(endpoint: str, name: str):  # type: ignore[no-untyped-def]
    """A pool ``name`` and job jobA's leader on its own lease; yields (pool, the leader's JobPool, start a pool node
    p1 -> (its loop, stop it as a death does: its loop and its lease gone))."""
    cfg = EtcdConfig.from_endpoint(endpoint, {"read_timeout": "10"})
    keys = PoolKeys(pool_prefix("/tpassrun/v1", name))
    started: list[tuple[asyncio.Task[None], EtcdStore]] = []

    async def start() -> tuple[_Node, Callable[[], Awaitable[None]]]:
        store = EtcdStore(cfg, lease_ttl=10)
        await store.open()
        loop = _Node(Pool(store, keys, POOL_KEY, name), PoolNode("p1", "h", 2, time.time()), say=lambda _s: None)
        task = asyncio.create_task(loop.run(asyncio.Event()))
        started.append((task, store))

        async def die() -> None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            await store.close()
        await _until(lambda: _registered(pool, ""), "p1 in the pool")
        return loop, die

    async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as leader:
        pool = Pool(admin, keys, POOL_KEY, name)
        assert await pool.create()
        job = JobPool(pool=Pool(leader, keys, POOL_KEY, name), spec=RACE_SPEC, node_id="leader-a",
                      cfg=LaunchConfig(rdzv_id="jobA", spare_pool=name, training_script="t.py", nproc_per_node=2,
                                       pool_wait=60.0))
        try:
            yield pool, job, start
        finally:
            for task, store in started:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                await store.close()
            await pool.delete()


async def _registered(pool: Pool, state: str, agent: str | None = None) -> bool:
    rec = (await pool.read())[0].nodes.get("p1")
    return rec is not None and state in ("", rec.state) and (agent is None or rec.agent == agent)


async def _joined(pool: Pool, node: _Node, agent: str) -> None:
    """p1's spare node (recorded) starts and joins jobA as ``agent``, as its event log would say."""
    await _until(lambda: _registered(pool, SERVING), "p1 serving")
    node.events.put_nowait(ChildStarted(agent))
    node.events.put_nowait(ChildJoined(agent))
    await _until(lambda: _registered(pool, SERVING, agent), f"p1's record naming {agent}")

    async def noted() -> bool:
        return any(h.event == "joined" for h in (await pool.read())[2])
    await _until(noted, "p1's joined in the history")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("back", ["after the leader looked", "before the leader looked"])
def test_a_claimed_pool_node_that_died_is_claimed_afresh_not_served_from_the_dead_claim(etcd_server, run_id, back):
    """The acceptance on separate hosts (heal): p, claimed by job D, SIGKILLed while it ran D's ranks. D's claim is
    bound to D's leader's lease, so it stayed: D was told `all 1 pool node(s) are claimed` (its own claim, on a dead
    node), and p, started again, served D from that old claim (history: joined twice, no second claimed). Now the
    leader drops its claim on a pool node that left the pool, or whose spare node the job lost (p back already,
    serving the old claim: its spare node is stopped), and claims it afresh once it is idle."""
    async def main() -> tuple[list[str], list[str], list[str]]:
        async with _pool_and_leader(etcd_server.endpoint, run_id) as (pool, job, start):
            said: list[str] = []
            say = lambda ev, **f: said.append(f"{ev}: {f.get('reason')}")  # noqa: E731
            node, die = await start()
            await job.need(("node-b",), 0, say)
            assert said[-1].startswith("pool_claimed"), said
            await _joined(pool, node, "pa-1")
            await job.need(("node-b",), 0, say, job_lost=("node-b",))      # a tick of the recovery onto p1
            await die()                                                     # p1 dies holding jobA's ranks
            lost = ("node-b", "pa-1")
            if back == "before the leader looked":
                node, die = await start()                                   # back, and it sees jobA's old claim
                await _until(lambda: _registered(pool, SERVING), "p1 serving the old claim")
            await job.need(("pa-1",), 0, say, job_lost=lost)
            if back == "after the leader looked":
                assert not (await pool.read())[0].claims
                node, die = await start()
            await _until(lambda: _registered(pool, IDLE), "p1 idle with no claim")
            await job.need(("pa-1",), 0, say, job_lost=lost)
            await _until(lambda: _registered(pool, SERVING), "p1 serving the new claim")
            view, _, history = await pool.read()
            assert [c.job for c in view.claims.values()] == ["jobA"] and job.held == {"pa-1": "p1"}
            return said, [h.event for h in sorted(history, key=lambda h: h.time)], node.served

    said, history, served = asyncio.run(main())
    assert not [s for s in said if "are claimed" in s], said
    assert any("pool node p1 left the pool" in s or "its spare node pa-1 was lost" in s for s in said), said
    assert said[-1].startswith("pool_claimed"), said
    assert history[:3] == ["claimed", "joined", "released"] and history[-1] == "claimed", history
    # back before the leader looked, it started a spare node for the old claim, stopped when the claim was dropped
    assert served == (["jobA"] if back == "after the leader looked" else ["jobA", "jobA"])


def test_the_job_is_never_told_its_own_claim_is_someone_elses():
    mine = Claim(node_id="p1", job="jobA", claimer="l", priority=0, since=1.0, reason="node b lost")
    theirs = replace(mine, node_id="p2", job="jobB")
    need = JobNeed(job="jobA", priority=0, nproc=2, since=0.0, wait_limit=60.0)
    nodes = {n: PoolNode(n, "h", 2, 0.0, state=SERVING) for n in ("p1", "p2", "p3")}
    why = plan_job(need, PoolView(nodes=nodes, claims={"p1": mine, "p2": theirs}), 1.0).reason
    assert why.startswith("no pool node is free (1 claimed by other jobs, 1 already this job's, 1 not idle yet") and \
        "are claimed" not in why, why
    assert "all 1 pool node(s) are claimed" in plan_job(need, PoolView(nodes={"p2": nodes["p2"]},
                                                                        claims={"p2": theirs}), 1.0).reason


# ---------------------------------------------------------------------------------------------- the give-back
def test_a_give_back_stops_the_spare_node_as_given_back_and_the_node_says_so():
    claim = Claim(node_id="p1", job="jobA", claimer="l", priority=0, since=1.0, reason="node b lost", spec=RACE_SPEC)
    state, act = plan_node(NodeState("p1", 2), ClaimSeen(claim), 2.0)
    state, act = plan_node(state, ChildJoined("pa-1"), 3.0)
    why = "its ranks [2, 3] moved home to the job's own spares"
    state, act = plan_node(state, ClaimSeen(replace(claim, released=why)), 4.0)
    assert isinstance(act, StopSpare) and act.given_back == why
    state, act = plan_node(state, ChildExited(0), 5.0)
    assert isinstance(act, BecomeIdle) and "left, given back" in act.reason and "exited" not in act.reason, act
    # a claim gone before the node joined is no give-back: torchrun's SIGTERM, as before
    state, _ = plan_node(NodeState("p1", 2), ClaimSeen(claim), 2.0)
    state, act = plan_node(state, ClaimGone("its claimer's lease expired"), 3.0)
    assert isinstance(act, StopSpare) and not act.given_back


def test_only_a_marked_sigterm_to_a_node_holding_no_rank_is_a_give_back(tmp_path):
    marker = tmp_path / "p.given-back"
    # the pool node names the file in its spare node's environment; a job cannot ship its own
    shipped = dataclasses.replace(SPEC, env={**SPEC.env, "TPASSRUN_POOL_GIVEN_BACK": "/job/file"})
    assert spare_node_env(shipped, {}, None, str(marker))["TPASSRUN_POOL_GIVEN_BACK"] == str(marker)
    assert "TPASSRUN_POOL_GIVEN_BACK" not in spare_node_env(shipped, {}, None)
    assert given_back_reason(str(marker), holds_rank=False) == ""          # not written: torchrun's SIGTERM
    assert given_back_reason("", holds_rank=False) == ""                   # not a pool node's spare node
    marker.write_text("its ranks [2, 3] moved home")
    assert given_back_reason(str(marker), holds_rank=True) == ""           # a rank runs here: never
    assert given_back_reason(str(marker), holds_rank=False) == "its ranks [2, 3] moved home"


def test_the_consoles_say_given_back_not_failed_nor_lost():
    """The acceptance on separate hosts: after a give-back the spare node's summary said `goodput not counted: the
    run failed (its progress ... is lost)`, the pool node `exited (1)` and the job's console `node p lost`."""
    spare = Describer()
    line = spare.describe({"event": "pool_given_back", "reason": "its ranks [2, 3] moved home", "time": 1.0,
                           "mono": 1.0, "node": "pa-1"})
    assert line is not None and "given back to the spare pool (its ranks [2, 3] moved home)" in line
    summary = " ".join(summary_lines(spare.tally, 0))
    assert "given back to the spare pool" in summary and "failed" not in summary, summary
    assert "the run failed" in " ".join(summary_lines(Describer().tally, 1))     # torchrun's exit: as before
    job = Describer()
    left = job.describe({"event": "pool_node_left", "lost_node": "pa-1", "pool": "P", "pool_node": "p1",
                         "time": 2.0, "mono": 2.0, "node": "a1"})
    assert left is not None and "pool node p1 left the job as given back to pool P" in left and "lost" not in left


@pytest.mark.timeout(120)
def test_the_leader_expects_its_given_back_pool_node_to_leave_and_the_pool_node_marks_the_sigterm(
        etcd_server, run_id, tmp_path):
    async def main() -> tuple[list[tuple[str, dict]], str, list[str]]:
        async with _pool_and_leader(etcd_server.endpoint, run_id) as (pool, job, start):
            node, _die = await start()
            node._given_back_file = str(tmp_path / "p1.given-back")     # what _start sets for a real child
            said: list[tuple[str, dict]] = []
            say = lambda ev, **f: said.append((ev, f))  # noqa: E731
            await job.need(("node-b",), 0, say)
            await _joined(pool, node, "pa-1")
            assert await job.agents() == {"pa-1": "p1"}
            assert await job.give_back("p1", "its ranks [2, 3] moved home", say)
            await _until(lambda: _registered(pool, IDLE), "p1 idle again")
            swapper = Swapper(dataclasses.replace(_port(job.pool.store, f"/tpassrun/v1/{run_id}/"),
                                                  events=types.SimpleNamespace(write=say)))
            swapper.coordinator.pool = job
            assert await swapper.on_node_lost("pa-1")                   # its lease goes as it leaves
            history = [h.detail for h in sorted((await pool.read())[2], key=lambda h: h.time) if h.event == "idle"]
            return said, (tmp_path / "p1.given-back").read_text(), history

    said, marker, idle = asyncio.run(main())
    assert ("pool_node_left", {"lost_node": "pa-1", "pool": run_id, "pool_node": "p1"}) in said, said
    assert not [ev for ev, _f in said if ev == "node_lost"], said
    assert marker == "its ranks [2, 3] moved home"
    assert idle and "left, given back (its ranks [2, 3] moved home" in idle[-1], idle
