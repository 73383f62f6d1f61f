"""A claimed pool node given back on --migrate-back (issue 24, item 4).

Pure: :func:`tpassrun.plan.giveback.plan_give_back` moves a pool node's ranks home one at a time once the job's own
spares are ready for all of them (a re-admitted slot, a lost node back as a spare node), then gives the node back;
never while anything else is under way. The pool node stops the job's spare node on a claim marked released and is
idle again. On a real etcd, one process: the leader's coordinator step (``Coordinator._give_back``) writes the
migrate-back taint, then marks the claim released; the pool node's real loop stops its (stand-in) spare node, a
real child process, and registers idle; the history says claimed, joined, released, idle; the job's console line
says which node went back to which pool and why."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import time
import types

import pytest
from test_pool_node import FAKE, _until

from tpassrun.plan.giveback import GiveBack, MoveHome, plan_give_back, seen_ranks
from tpassrun.plan.swap import ClusterView, SlotView
from tpassrun.pool import Claim, JobSpec, NodeState, Phase, Pool, PoolKeys, PoolNode, plan_node, pool_prefix
from tpassrun.pool import plan as P
from tpassrun.pool.job import JobPool
from tpassrun.pool.node import PoolNodeLoop
from tpassrun.records import Keys, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect, TaintSource
from tpassrun.records import Phase as SwapPhase
from tpassrun.records.pool import load_sealed, pool_seal
from tpassrun.records.provenance import RunKey
from tpassrun.rendezvous import EtcdConfig, EtcdStore
from tpassrun.settings import LaunchConfig

KEY = RunKey.from_text("pool-key-for-tests-0123456789")
SPEC = JobSpec(run_id="jobA", endpoint="127.0.0.1:2379", rdzv_conf="", nproc_per_node=2, entrypoint="train.py",
               args=())


def view(*slots: SlotView, lost: tuple[str, ...] = ()) -> ClusterView:
    return ClusterView(generation=2, members=("a", "b"), spare_nodes=("p",), slots=slots, lost=lost)


def run(node: str, slot: int, rank: int) -> SlotView:
    return SlotView(node, slot, rank, "running", True, 9)


def spare(node: str, slot: int, ready: bool = True) -> SlotView:
    return SlotView(node, slot, None, "spare", ready)


MEMBERS = (run("a", 0, 0), run("b", 0, 2), run("b", 1, 3))


def test_a_dead_ranks_pool_node_is_given_back_once_its_home_slot_is_a_ready_spare_again():
    """Rank 1 died on a/1 and runs on pool node p; a/1 is re-admitted (starting, then ready): rank 1 goes home, then p,
    holding no rank, goes back. One step at a time, nothing while anything else is under way."""
    on_p = view(*MEMBERS, run("p", 0, 1), spare("p", 1), spare("a", 1, ready=False))
    used = seen_ranks(on_p, {"p": "pool-p"}, {})
    assert used == {"p": (1,)}
    assert plan_give_back(on_p, {"p": "pool-p"}, used, (), migrate_back=True, busy=False) is None       # a/1 still starting
    ready = view(*MEMBERS, run("p", 0, 1), spare("p", 1), spare("a", 1))
    act = plan_give_back(ready, {"p": "pool-p"}, used, (), migrate_back=True, busy=False)
    assert act == MoveHome(1, "p", ("a", 1), act.reason) and "pool node pool-p" in act.reason
    for quiet in (dict(migrate_back=False, busy=False), dict(migrate_back=True, busy=True)):
        assert plan_give_back(ready, {"p": "pool-p"}, used, (), **quiet) is None
    moving = Taint(id="pool-home-1", effect=TaintEffect.MIGRATE, reason="home", source=TaintSource.MIGRATE_BACK.value,
                   rank=1, home_node="a", home_slot=1, handled_by="s-1", state="migrating")
    assert plan_give_back(ready, {"p": "pool-p"}, used, (moving,), migrate_back=True, busy=False) is None
    leaving = view(*MEMBERS, run("a", 1, 1), SlotView("p", 0, None, "leaving", True), spare("p", 1))
    assert plan_give_back(leaving, {"p": "pool-p"}, seen_ranks(leaving, {"p": "pool-p"}, used), (), migrate_back=True, busy=False) is None
    home = view(*MEMBERS, run("a", 1, 1), spare("p", 0, ready=False), spare("p", 1))
    act = plan_give_back(home, {"p": "pool-p"}, seen_ranks(home, {"p": "pool-p"}, used), (), migrate_back=True, busy=False)
    assert isinstance(act, GiveBack) and act.node == "p" and act.ranks == (1,) and "moved home" in act.reason


def test_a_lost_nodes_pool_node_goes_back_only_when_own_spares_hold_all_its_ranks():
    """Node b was lost, its ranks 2 and 3 run on pool node p; b comes back as a spare node. Half a move frees
    nothing: one own spare ready is not enough, two are; a pool node that never ran a rank (starting) stays."""
    ranks_on_p = (SlotView("a", 0, 0, "running", True), SlotView("a", 1, 1, "running", True), run("p", 0, 2),
                  run("p", 1, 3))
    one = view(*ranks_on_p, spare("b2", 0), spare("b2", 1, ready=False), lost=("b",))
    used = seen_ranks(one, {"p": "pool-p"}, {})
    assert plan_give_back(one, {"p": "pool-p"}, used, (), migrate_back=True, busy=False) is None
    two = view(*ranks_on_p, spare("b2", 0), spare("b2", 1), lost=("b",))
    act = plan_give_back(two, {"p": "pool-p"}, used, (), migrate_back=True, busy=False)
    assert isinstance(act, MoveHome) and act.rank == 2 and act.home == ("b2", 0)
    # another pool node of the job's is not "own": p2's spares never take p's ranks
    other_pool = view(*ranks_on_p, spare("p2", 0), spare("p2", 1), lost=("b",))
    assert plan_give_back(other_pool, {"p": "pool-p", "p2": "pool-p2"}, used, (), migrate_back=True, busy=False) is None
    starting = view(MEMBERS[0], spare("p", 0, ready=False), spare("p", 1, ready=False), spare("a", 1))
    assert plan_give_back(starting, {"p": "pool-p"}, seen_ranks(starting, {"p": "pool-p"}, {}), (), migrate_back=True, busy=False) is None


def test_the_pool_node_stops_the_jobs_spare_node_on_a_claim_given_back_and_is_idle_again():
    claim = Claim(node_id="p1", job="jobA", claimer="l", priority=0, since=0.0, reason="rank 1", spec=SPEC)
    released = Claim(**{**claim.__dict__, "released": "its ranks [1] moved home"})
    s, _ = plan_node(NodeState("p1", 2), P.ClaimSeen(claim), 1.0)
    s, _ = plan_node(s, P.ChildJoined(), 2.0)
    other = Claim(**{**released.__dict__, "job": "jobB"})
    assert plan_node(s, P.ClaimSeen(other), 2.5) == (s, P.Keep("jobB's claim is given back"))
    s, act = plan_node(s, P.ClaimSeen(released), 3.0)
    assert s.phase is Phase.STOPPING and isinstance(act, P.StopSpare) and "gave it back" in act.reason
    s, act = plan_node(s, P.ChildExited(0), 4.0)
    assert s.phase is Phase.IDLE and isinstance(act, P.BecomeIdle)
    # a node (re)started idle that finds a claim given back drops it
    _, act = plan_node(NodeState("p1", 2), P.ClaimSeen(released), 5.0)
    assert isinstance(act, P.BecomeIdle)
    keys = PoolKeys(pool_prefix("/tpassrun/v1", "p"))
    assert Claim.from_json(load_sealed(KEY, keys.claim("p1"), pool_seal(KEY, keys.claim("p1"), released.to_json()))) \
        == released
    old = {k: v for k, v in claim.to_json().items() if k != "released"}     # written before the field existed
    assert Claim.from_json(old).released == ""


def test_the_console_says_which_pool_node_went_back_and_why():
    from tpassrun.ops.console import Describer

    line = Describer().describe({"event": "pool_released", "time": 1.0, "mono": 1.0, "node": "host1-1-ab",
                                 "pool": "gpu", "pool_node": "host9-3-ef",
                                 "reason": "its ranks [1] moved home to the job's own spares"})
    assert line is not None and "given back to pool gpu" in line and "moved home" in line, line


@pytest.mark.timeout(120)
def test_the_leader_moves_the_rank_home_then_gives_the_pool_node_back_which_is_idle_again(etcd_server, run_id,
                                                                                          tmp_path):
    from tpassrun.plan.actions import Seen
    from tpassrun.swapper.agentport import SwapSettings
    from tpassrun.swapper.coordinator import Coordinator

    fake = tmp_path / "python"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    events: list[tuple[str, dict]] = []

    async def main() -> list[str]:
        cfg = EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})
        keys = PoolKeys(pool_prefix("/tpassrun/v1", run_id))
        prefix = f"/tpassrun/v1/{run_id}/"
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as node_store, \
                EtcdStore(cfg, lease_ttl=10) as leader:
            pool = Pool(admin, keys, KEY, run_id)
            assert await pool.create()
            env = {"PATH": os.environ["PATH"], "POOL_TEST_OUT": str(tmp_path / "children.jsonl")}
            node = PoolNodeLoop(Pool(node_store, keys, KEY, run_id), PoolNode("p1", "h", 2, time.time()),
                                say=lambda _s: None, base_env=env, python=str(fake))
            stop = asyncio.Event()
            runner = asyncio.create_task(node.run(stop))
            job = JobPool(pool=Pool(leader, keys, KEY, run_id), spec=SPEC, node_id="leader",
                          cfg=LaunchConfig(rdzv_id="jobA", spare_pool=run_id, training_script="t.py",
                                           nproc_per_node=2, pool_wait=60.0))
            port = types.SimpleNamespace(settings=SwapSettings(2, 0, migrate_back=True),
                                         events=types.SimpleNamespace(write=lambda ev, **f: events.append((ev, f))),
                                         rdzv=types.SimpleNamespace(key=lambda *p: prefix + "/".join(p), store=leader))
            coordinator = Coordinator(port)  # type: ignore[arg-type]
            coordinator.pool = job

            def tick(*slots: SlotView, plans=()):   # type: ignore[no-untyped-def]
                seen = Seen(now=time.time(), epoch=2, plans=plans, reports=(), failures=(), taints=(),
                            view=view(*MEMBERS, *slots))
                return coordinator._give_back(seen, busy=False)
            try:
                await _until(lambda: _node_is(pool, "idle"), "the pool node never registered")
                need = "rank 1 (died at step 4, generation 1)"
                await job.need((need,), 0, lambda ev, **f: events.append((ev, f)))
                assert job.pool_nodes == ("p1",)
                await _until(lambda: _history_has(pool, "joined"), "the spare node never joined")
                assert node.child is not None
                agent = f"agent-{node.child.pid}"       # the node id its spare node has in the job
                assert await job.agents() == {agent: "p1"}
                await tick(run(agent, 0, 1), spare(agent, 1), spare("a", 1))    # the home slot is ready again
                taints = await admin.get_prefix_json(Keys(prefix).family("taints"))
                assert len(taints) == 1
                moved = Taint.from_json(taints[0][1])
                assert (moved.rank, moved.home, moved.source) == (1, ("a", 1), "migrate-back")
                # the planned swap ran (the coordinator deletes a migrate-back's taint when it is done): rank 1 home
                done = SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef(agent, 0, 1),
                                joiner=SlotRef("a", 1, 1), donor=None, phase=SwapPhase.DONE, reason="home",
                                nodes=("a", "b", agent), history=(("done", 1.0),), release=True)
                await admin.delete_prefix(Keys(prefix).family("taints"))
                await tick(run("a", 1, 1), spare(agent, 0), spare(agent, 1), plans=((done, 1),))
                assert job.pool_nodes == () and events[-1][0] == "pool_released"
                await _until(lambda: _node_is(pool, "idle"), "the pool node given back never became idle")
                assert node.child is not None and node.child.returncode is not None   # its spare node stopped
                _, _, history = await pool.read()
                return [h.event for h in sorted(history, key=lambda h: h.time)]
            finally:
                stop.set()
                await asyncio.wait_for(runner, 30)
                await pool.delete()
                await admin.delete_prefix(prefix)

    history = asyncio.run(main())
    assert history == ["claimed", "joined", "released", "idle"], history
    released = dict(events)["pool_released"]
    assert released["pool_node"] == "p1" and "[1] moved home" in released["reason"], events


async def _node_is(pool: Pool, state: str) -> bool:
    view_, _, _ = await pool.read()
    n = view_.nodes.get("p1")
    return n is not None and n.state == state and "p1" not in view_.claims


async def _history_has(pool: Pool, event: str) -> bool:
    _, _, history = await pool.read()
    return any(h.event == event for h in history)
