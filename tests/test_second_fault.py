"""A second fault during a recovery, decided purely (tpassrun/triage.py, tpassrun/swap.py): another rank dying
while a plan runs supersedes it (no fallback), and the dead ranks are replaced together by one plan when spares
and replicas remain, else the group restarts saying why; a death while the world re-forms restarts the group."""

from __future__ import annotations

import dataclasses

from tpassrun.records import Failure, Phase, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect
from tpassrun.swap import ClusterView, SlotView, plan_for_dead_ranks, plan_for_failure
from tpassrun.triage import CasPlan, CreatePlan, PutFailure, PutFallback, PutTaint, Seen, triage

NOW = 1000.0


def view(*dead: tuple[str, int], spares: int = 2) -> ClusterView:
    """3 ranks on node a (slots 0-2), spares on node b; ``dead`` slots died."""
    slots = [SlotView("a", i, i, "dead" if ("a", i) in dead else "running", True, 9) for i in range(3)]
    slots += [SlotView("b", i, None, "spare", True) for i in range(spares)]
    return ClusterView(generation=2, members=("a", "b"), spare_nodes=(), slots=tuple(slots))


def failure(slot: int, handled: str | None = None) -> tuple[str, Failure]:
    return (f"a-{slot}", Failure(node="a", slot=slot, rank=slot, code=-9, step=7, light=True, generation=2,
                                 handled=handled))


def seen(v: ClusterView, failures, plans=(), taints=()) -> Seen:
    return Seen(now=NOW, spawned_generation=2, plans=plans, reports=(), failures=tuple(failures), taints=taints,
                view=v)


def unplanned(phase: Phase) -> SwapPlan:
    plan = plan_for_failure(view(("a", 1)), node="a", slot=1, rank=1, reason="exit -9", now_wall=NOW,
                            light_available=True, swap_id="u-a-1-2").plan
    assert plan is not None and plan.donor is not None
    return dataclasses.replace(plan, phase=phase, secret="00")


def test_another_death_during_a_recovery_supersedes_it_and_hands_its_failure_back():
    plan = unplanned(Phase.SEND)
    donor = plan.donor.slot                      # the donor dies while it streams
    result = triage(seen(view(("a", 1), ("a", donor)), [failure(1, "plan"), failure(donor)], ((plan, 5),)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert len(cas) == 1 and cas[0].new.phase == Phase.ABORTED and cas[0].new.superseded
    assert "died while handing over" in cas[0].decision.reason
    handed_back = [a.failure for a in result.actions if isinstance(a, PutFailure)]
    assert [(f.rank, f.handled) for f in handed_back] == [(1, None)]
    assert not any(isinstance(a, PutFallback) for a in result.actions)      # nobody restarts


def test_several_dead_ranks_are_replaced_by_one_plan_from_the_live_replicas():
    aborted = dataclasses.replace(unplanned(Phase.ABORTED), superseded=True)
    result = triage(seen(view(("a", 1), ("a", 0)), [failure(0), failure(1)], ((aborted, 6),)))
    create = [a for a in result.actions if isinstance(a, CreatePlan)]
    assert len(create) == 1
    plan = create[0].plan
    assert plan.kind == SwapKind.NODE and plan.lost_node is None and plan.ranks == (0, 1)
    assert {(m.joiner.node, m.joiner.slot) for m in plan.moves} == {("b", 0), ("b", 1)}
    assert all(m.donor == SlotRef("a", 2, 2) for m in plan.moves)          # the one live replica
    assert plan.nodes == ("a", "b")
    assert {a.failure.handled for a in result.actions if isinstance(a, PutFailure)} == {"plan"}


def test_without_a_spare_for_each_dead_rank_the_group_restarts_and_says_why():
    result = triage(seen(view(("a", 1), ("a", 0), spares=1), [failure(0), failure(1)]))
    fallback = [a for a in result.actions if isinstance(a, PutFallback)]
    assert len(fallback) == 1 and "spare" in fallback[0].fallback.reason and "[0, 1]" in fallback[0].fallback.reason
    assert not any(isinstance(a, CreatePlan) for a in result.actions)


def test_no_live_replica_left_restarts_the_group():
    decision = plan_for_dead_ranks(view(("a", 0), ("a", 1), ("a", 2), spares=3), [("a", i, i) for i in range(3)],
                                   reason="x", now_wall=NOW, swap_id="m")
    assert decision.action == "fallback" and "no live replica" in decision.reason


def test_a_death_while_the_world_re_forms_restarts_the_group_at_once():
    plan = unplanned(Phase.REFORM)
    result = triage(seen(view(("a", 1), ("a", 2)), [failure(1, "plan"), failure(2)], ((plan, 5),)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert cas[0].new.phase == Phase.ABORTED and not cas[0].new.superseded and cas[0].new.outcome is None
    assert "re-formed" in cas[0].decision.reason
    marked = [a.failure for a in result.actions if isinstance(a, PutFailure)]
    assert [(f.rank, f.handled) for f in marked] == [(2, "fallback")]   # not planned: the group restarts


def test_a_planned_swap_during_which_another_rank_dies_is_asked_for_again():
    taint = Taint(id="t1", effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="a", slot=1, rank=1,
                  handled_by="s-1", state="migrating")
    plan = SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef("a", 1, 1),
                    joiner=SlotRef("b", 0, 1), donor=None, phase=Phase.TRANSFER, reason="ecc", nodes=("a", "b"),
                    taint_id="t1", history=((Phase.PAUSE.value, NOW),))
    result = triage(seen(view(("a", 2)), [failure(2)], ((plan, 3),), (taint,)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert cas[0].new.phase == Phase.ABORTED and cas[0].new.superseded
    reopened = [a.taint for a in result.actions if isinstance(a, PutTaint)]
    assert reopened and reopened[0].handled_by is None


def test_a_plan_superseded_and_planned_again_gets_a_new_id():
    old = dataclasses.replace(unplanned(Phase.ABORTED), superseded=True)
    result = triage(seen(view(("a", 1)), [failure(1)], ((old, 6),)))
    create = [a for a in result.actions if isinstance(a, CreatePlan)]
    assert create and create[0].plan.id == "u-a-1-2-1"


def test_the_superseded_flag_survives_the_record():
    plan = dataclasses.replace(unplanned(Phase.ABORTED), superseded=True)
    assert SwapPlan.from_json(plan.to_json()).superseded
