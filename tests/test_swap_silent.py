"""A swap participant that never reports a phase cannot stall the swap (issue 24: a claimed pool node that dies or
hangs mid-swap).

Two guards. A participant that dies or is stopped (SIGSTOP) loses its lease within the lease's TTL: the job sees
its node lost and the plan is superseded or restarted (the triage, unchanged). A participant that stays alive, its
lease kept, but never answers (a deaf or stuck swapper) meets the leader's report deadline
(:data:`tpassrun.plan.swap.REPORT_DEADLINE_S`, past every wait a live participant makes in a phase): the plan is
given up with one line naming who did not answer, a planned swap's taint waits again, a node plan is tried once
more or restarts the group. On the pool's side, a claimed pool node that left the pool (its lease expired) or whose
spare node the job lost is released and another pool node is asked for, instead of waiting out --pool-wait."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tpassrun.plan.actions import CasPlan, PutTaint, RestartGroup, Say, Seen
from tpassrun.plan.swap import REPORT_DEADLINE_S, SILENT, ClusterView, SlotView, next_step
from tpassrun.plan.triage import triage
from tpassrun.pool import Claim, JobSpec, NodeState, Pool, PoolKeys, PoolNode, plan_node, pool_prefix
from tpassrun.pool.job import JobPool, silent_pool_node
from tpassrun.pool.node import PoolNodeLoop
from tpassrun.pool.plan import ChildStarted, ClaimSeen, Keep, StartSpare
from tpassrun.records import Move, Phase, Report, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect
from tpassrun.records.pool import SERVING
from tpassrun.records.provenance import RunKey
from tpassrun.rendezvous import EtcdConfig, EtcdStore
from tpassrun.settings import LaunchConfig

T0 = 1000.0
VIEW = ClusterView(generation=2, members=("a", "b"), spare_nodes=("p",),
                   slots=(SlotView("a", 0, 0, "running", True, 5), SlotView("a", 1, 1, "running", True, 5),
                          SlotView("b", 0, 2, "running", True, 5), SlotView("b", 1, 3, "running", True, 5),
                          SlotView("p", 0, None, "spare", True), SlotView("p", 1, None, "spare", True)))


def planned(phase: Phase = Phase.PAUSE) -> SwapPlan:
    return SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef("b", 1, 3),
                    joiner=SlotRef("p", 0, 3), donor=None, phase=phase, reason="tainted", nodes=("a", "b", "p"),
                    taint_id="t1", history=((phase.value, T0),))


def node_plan(phase: Phase) -> SwapPlan:
    moves = (Move(SlotRef("b", 0, 2), SlotRef("p", 0, 2), SlotRef("a", 0, 0)),
             Move(SlotRef("b", 1, 3), SlotRef("p", 1, 3), SlotRef("a", 1, 1)))
    return SwapPlan(id="n-b", kind=SwapKind.NODE, generation=2, leaver=SlotRef("b", 0, 2),
                    joiner=SlotRef("p", 0, 2), donor=None, phase=phase, reason="node b lost", nodes=("a", "p"),
                    history=((phase.value, T0),), lost_node="b", moves=moves)


def seen(plan: SwapPlan, now: float, reports=(), taints=()) -> Seen:  # type: ignore[no-untyped-def]
    view = VIEW if plan.kind != SwapKind.NODE else ClusterView(
        generation=2, members=("a", "b"), spare_nodes=("p",), slots=VIEW.slots[:2] + VIEW.slots[4:], lost=("b",))
    return Seen(now=now, epoch=2, plans=((plan, 7),), reports=reports, failures=(), taints=taints, view=view)


def test_a_participant_that_never_reports_is_waited_for_until_the_deadline_then_named():
    plan = planned()
    ok = [Report(node="a", phase=Phase.PAUSE, candidate=5), Report(node="b", phase=Phase.PAUSE, candidate=5)]
    waiting = next_step(plan, ok, T0 + REPORT_DEADLINE_S - 1)
    assert waiting.action == "wait" and "['p']" in waiting.reason
    given_up = next_step(plan, ok, T0 + REPORT_DEADLINE_S)
    assert given_up.action == SILENT and given_up.plan is not None and given_up.plan.phase is Phase.ABORTED
    assert given_up.plan.outcome == f"p did not answer in pause within {REPORT_DEADLINE_S:.0f} s"
    # a node plan too (its own waiting rule)
    silent_node = next_step(node_plan(Phase.PAUSE), [Report(node="a", phase=Phase.PAUSE, candidate=5)],
                            T0 + REPORT_DEADLINE_S + 3)
    assert silent_node.action == SILENT and "p did not answer in pause" in silent_node.reason


def test_the_triage_gives_a_silent_swap_up_and_its_taint_waits_again_or_the_node_plan_is_tried_once_more():
    taint = Taint(id="t1", effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="b", slot=1, rank=3,
                  handled_by="s-1", state="migrating")
    acts = triage(seen(planned(), T0 + REPORT_DEADLINE_S, taints=(taint,))).actions
    cas = [a for a in acts if isinstance(a, CasPlan)]
    assert cas and cas[0].new.phase is Phase.ABORTED and "did not answer" in cas[0].decision.reason
    put = [a for a in acts if isinstance(a, PutTaint)]
    assert put and put[0].taint.handled_by is None and "did not answer" in put[0].taint.state
    early = triage(seen(planned(), T0 + 60, taints=(taint,))).actions            # before the deadline: waits
    assert not [a for a in early if not (isinstance(a, Say) and a.event == "taint_received")], early
    # a node plan in TRANSFER whose joiner never answers: superseded, planned again once (the next look)
    acts = triage(seen(node_plan(Phase.TRANSFER), T0 + REPORT_DEADLINE_S)).actions
    said = [a for a in acts if isinstance(a, Say) and a.event == "recovery_superseded"]
    assert said and "p did not answer in transfer" in said[0].fields["reason"]
    # in PAUSE: the group restarts, saying who did not answer
    acts = triage(seen(node_plan(Phase.PAUSE), T0 + REPORT_DEADLINE_S)).actions
    assert any(isinstance(a, RestartGroup) and "p did not answer in pause" in a.reason for a in acts), acts


def test_a_claimed_pool_node_that_left_the_pool_or_the_job_is_said_silent():
    """Its spare node's id in the job is in its record from its first event (before its workers start: a plan may
    take its spare slots the moment they appear, and the node may stop right then)."""
    serving, _ = plan_node(NodeState("p1", 2), ClaimSeen(Claim("p1", "jobA", "l", 0, 0.0, "b lost",
                                                               JobSpec("jobA", "e", "", 2, "t.py", ()))), 1.0)
    after, act = plan_node(serving, ChildStarted("h-12-ab"), 2.0)
    assert after == serving and isinstance(act, Keep) and "h-12-ab" in act.reason
    node = PoolNode("p1", "h", 2, 0.0, state=SERVING, job="jobA", agent="h-12-ab")
    assert silent_pool_node(node, ()) == ""
    assert "left the pool" in silent_pool_node(None, ())
    assert "spare node h-12-ab was lost" in silent_pool_node(node, ("b", "h-12-ab"))


POOL_KEY = RunKey.from_text("pool-key-for-the-silent-0123456789")


class _Hostless(PoolNodeLoop):
    async def _start(self, action: StartSpare) -> None:     # the spare node is noted, not started
        self.served.append(action.claim.job)
        await self._register(SERVING, action.claim.job)


@pytest.mark.timeout(120)
def test_a_job_asks_for_another_pool_node_when_the_claimed_one_stops_answering(etcd_server, run_id):
    """Real etcd, one process: two idle pool nodes; the job claims p1, whose lease then is no longer kept (SIGSTOP's
    effect on etcd; its loop does nothing meanwhile, as a stopped process); once etcd drops its record, the job's next look releases p1's claim, says
    why, and claims p2, well within --pool-wait."""

    async def main() -> list[tuple[str, dict]]:
        cfg = EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})
        keys = PoolKeys(pool_prefix("/tpassrun/v1", run_id))
        said: list[tuple[str, dict]] = []
        async with EtcdStore(cfg) as admin, EtcdStore(cfg, lease_ttl=10) as leader:
            pool = Pool(admin, keys, POOL_KEY, run_id)
            assert await pool.create()
            stores = [EtcdStore(cfg, lease_ttl=2), EtcdStore(cfg, lease_ttl=10)]
            await asyncio.gather(*(s.open() for s in stores))
            stop = asyncio.Event()
            nodes = [_Hostless(Pool(st, keys, POOL_KEY, run_id), PoolNode(n, "h", 2, time.time()),
                               say=lambda _s: None) for n, st in zip(("p1", "p2"), stores)]
            runners = []
            for n in nodes:         # one after the other: p1 is idle the longer, the one claimed first
                runners.append(asyncio.create_task(n.run(stop)))
                while n.record.node_id not in (await pool.read())[0].nodes:
                    await asyncio.sleep(0.02)
            job = JobPool(pool=Pool(leader, keys, POOL_KEY, run_id), node_id="leader",
                          spec=JobSpec(run_id="jobA", endpoint="e", rdzv_conf="", nproc_per_node=2,
                                       entrypoint="t.py", args=()),
                          cfg=LaunchConfig(rdzv_id="jobA", spare_pool=run_id, training_script="t.py",
                                           nproc_per_node=2, pool_wait=600.0))
            try:
                await job.need(("b",), 0, lambda ev, **f: said.append((ev, f)))
                assert job.held == {"b": "p1"} and nodes[0].served == ["jobA"]
                await job.need(("b",), 0, lambda ev, **f: said.append((ev, f)))      # p1 starting: wait for it
                assert len(said) == 1
                stores[0]._keepalive.cancel()              # p1 stops: nothing keeps its lease any more
                while "p1" in (await pool.read())[0].nodes:   # (its TTL: 2 s)
                    await asyncio.sleep(0.05)
                await job.need(("b",), 0, lambda ev, **f: said.append((ev, f)))
                assert job.held == {"b": "p2"} and nodes[1].served == ["jobA"]
                claims = (await pool.read())[0].claims
                assert set(claims) == {"p2"}
                return said
            finally:
                stop.set()
                for r in runners:
                    with contextlib.suppress(Exception):
                        await r
                stores[0]._lease = None
                await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)
                await pool.delete()

    said = asyncio.run(main())
    assert [e for e, _ in said] == ["pool_claimed", "pool_waiting", "pool_claimed"], said
    assert "pool node p1 left the pool" in said[1][1]["reason"] and said[2][1]["pool_node"] == "p2", said
