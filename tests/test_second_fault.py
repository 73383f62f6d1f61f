"""A second fault during a recovery, decided purely (tpassrun/plan/triage.py, tpassrun/plan/swap.py): another rank dying
while a plan runs supersedes it (no fallback), and the dead ranks are replaced together by one plan when spares
and replicas remain, else the group restarts saying why; a death while the world re-forms is recovered by the next
plan (the others wait where they stopped, the joiners keep what they received), or restarts the group naming it.
A recovery that was resuming a mixed commit (survivors one transaction apart) is planned again from scratch: the
new plan asks where everyone stands, and the dead ranks' kept snapshots put them at one step again."""

from __future__ import annotations

import dataclasses

import pytest

from tpassrun.plan.swap import ClusterView, SlotView, next_step, plan_for_dead_ranks, plan_for_failure
from tpassrun.plan.triage import CasPlan, CreatePlan, PutFailure, PutFallback, PutTaint, RestartGroup, Say, Seen, triage
from tpassrun.records import Failure, Phase, Report, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect

pytestmark = pytest.mark.timeout(60)

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
    return Seen(now=NOW, epoch=2, plans=plans, reports=(), failures=tuple(failures), taints=taints,
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


def _reforming_view(*dead: tuple[str, int], spares: int = 2) -> ClusterView:
    """As :func:`view` while ``unplanned`` re-forms the world: its joiner b/0 runs rank 1 already."""
    v = view(*dead, spares=spares)
    return dataclasses.replace(v, slots=tuple(dataclasses.replace(s, rank=1, state="running", step=9)
                                              if (s.node, s.slot) == ("b", 0) else s for s in v.slots))


def _in_reform() -> SwapPlan:
    plan = unplanned(Phase.REFORM)
    return dataclasses.replace(plan, history=plan.history + ((Phase.REFORM.value, NOW),))


def test_a_death_while_the_world_re_forms_is_recovered_live_by_the_next_plan():
    """Rank 2 is killed while the world re-forms for rank 1's recovery: the recovery is given up without a restart
    (every rank waits where it stopped, the joiner keeps rank 1's state), and the next tick replaces rank 2 from a
    replica that is not the joiner (its state is not loaded yet)."""
    plan = _in_reform()
    v = _reforming_view(("a", 1), ("a", 2))
    result = triage(seen(v, [failure(1, "plan"), failure(2)], ((plan, 5),)))
    aborted = _superseded(result, [2])
    assert "rank 2 died while the world re-formed for the recovery of rank(s) [1]" in aborted.outcome
    assert not any(isinstance(a, PutFailure) for a in result.actions)      # rank 1 stays the joiner's
    result = triage(seen(v, [failure(1, "plan"), failure(2)], ((aborted, 6),)))
    create = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
    assert len(create) == 1 and create[0].kind == SwapKind.UNPLANNED and create[0].leaver == SlotRef("a", 2, 2)
    assert create[0].donor == SlotRef("a", 0, 0) and create[0].joiner == SlotRef("b", 1, 2)
    assert "b" in create[0].nodes                                        # the joiner's node re-forms with them
    # once a later plan is done, the former joiner donates like any rank
    done = dataclasses.replace(create[0], phase=Phase.DONE, history=((Phase.DONE.value, NOW + 5),))
    v2 = _reforming_view(("a", 0), ("a", 1))
    result = triage(seen(v2, [failure(0)], ((aborted, 6), (done, 9))))
    plan3 = next(a.plan for a in result.actions if isinstance(a, CreatePlan))
    assert plan3.donor.node == "b" and plan3.donor.rank == 1


def test_a_recoverys_joiner_dying_while_the_world_re_forms_is_recovered_again_from_the_first_death():
    """Rank 1's joiner b/0 dies on its way into the re-formed world, before it loaded rank 1's state: the recovery
    is superseded, the joiner's death is moot, and the next tick plans rank 1 again from its first death (a/1,
    whose node holds its snapshots) to the other spare, even while b/0's status still says it runs rank 1."""
    plan = _in_reform()
    v = _reforming_view(("a", 1))
    joiner = ("b-0", Failure(node="b", slot=0, rank=1, code=-9, step=9, light=False, generation=2))
    result = triage(seen(v, [failure(1, "plan"), joiner], ((plan, 5),)))
    aborted = _superseded(result, [1])
    assert ("b", 0) in aborted.excluded_spares
    marked = {a.failure_id: a.failure for a in result.actions if isinstance(a, PutFailure)}
    assert marked["b-0"].handled == "stale" and "joiner of rank 1 died" in marked["b-0"].reason
    assert marked["a-1"].handled is None                                  # rank 1's first death, handed back
    result = triage(seen(v, [("a-1", marked["a-1"]), ("b-0", marked["b-0"])], ((aborted, 6),)))
    create = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
    assert len(create) == 1 and create[0].kind == SwapKind.UNPLANNED, result.actions
    assert create[0].leaver == SlotRef("a", 1, 1) and create[0].joiner == SlotRef("b", 1, 1)
    assert create[0].donor.node == "a" and create[0].donor.rank in (0, 2)


def test_a_planned_swaps_joiner_dying_while_the_world_re_forms_restarts_the_group_naming_it():
    """Its leaver has left: nothing holds the rank's per-rank state to send again."""
    plan = SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef("a", 1, 1),
                    joiner=SlotRef("b", 0, 1), donor=None, phase=Phase.REFORM, reason="ecc", nodes=("a", "b"),
                    secret="00", history=((Phase.PAUSE.value, NOW), (Phase.REFORM.value, NOW)))
    v = _reforming_view()
    v = dataclasses.replace(v, slots=tuple(dataclasses.replace(s, state="idle", rank=None) if (s.node, s.slot) == ("a", 1)
                                           else s for s in v.slots))
    joiner = ("b-0", Failure(node="b", slot=0, rank=1, code=-9, step=9, light=False, generation=2))
    result = triage(seen(v, [joiner], ((plan, 5),)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert cas[0].new.phase == Phase.ABORTED and cas[0].new.superseded and cas[0].new.outcome is None
    fallback = [a for a in result.actions if isinstance(a, PutFallback)]
    assert len(fallback) == 1 and fallback[0].node == "b"
    why = fallback[0].fallback.reason
    assert "rank 1 died while the world re-formed" in why and "joiner died" in why and "\n" not in why
    assert [(a.failure.rank, a.failure.handled) for a in result.actions if isinstance(a, PutFailure)] == [(1, "fallback")]


def test_a_death_while_the_world_re_forms_with_no_spare_left_restarts_the_group_naming_it():
    plan = _in_reform()
    v = _reforming_view(("a", 1), ("a", 2), spares=1)
    result = triage(seen(v, [failure(1, "plan"), failure(2)], ((plan, 5),)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert cas[0].new.phase == Phase.ABORTED and cas[0].new.outcome is None      # a second fault: spends a restart
    fallback = [a.fallback for a in result.actions if isinstance(a, PutFallback)]
    assert len(fallback) == 1 and "rank 2 died while the world re-formed" in fallback[0].reason
    assert "no spare" in fallback[0].reason and fallback[0].slot == 2
    marked = [a.failure for a in result.actions if isinstance(a, PutFailure)]
    assert [(f.rank, f.handled) for f in marked] == [(2, "fallback")]


def test_a_death_while_a_planned_swap_re_forms_is_recovered_live_and_the_taint_stays_served():
    taint = Taint(id="t1", effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="a", slot=1, rank=1,
                  handled_by="s-1", state="migrating")
    plan = SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef("a", 1, 1),
                    joiner=SlotRef("b", 0, 1), donor=None, phase=Phase.REFORM, reason="ecc", nodes=("a", "b"),
                    taint_id="t1", secret="00", history=((Phase.PAUSE.value, NOW), (Phase.REFORM.value, NOW)))
    v = _reforming_view(("a", 2))
    v = dataclasses.replace(v, slots=tuple(dataclasses.replace(s, state="idle", rank=None) if (s.node, s.slot) == ("a", 1)
                                           else s for s in v.slots))
    result = triage(seen(v, [failure(2)], ((plan, 3),), (taint,)))
    aborted = _superseded(result, [2])
    assert "the swap of rank 1" in aborted.outcome
    assert not any(isinstance(a, PutTaint) for a in result.actions)        # rank 1 moved: not asked for again


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


def _superseded(result, dead: list[int]) -> SwapPlan:
    """The one plan a triage aborted as superseded, after checking that nobody restarts and the event says who."""
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert len(cas) == 1 and cas[0].new.phase == Phase.ABORTED and cas[0].new.superseded, result.actions
    said = [a for a in result.actions if isinstance(a, Say) and a.event == "recovery_superseded"]
    assert len(said) == 1 and said[0].fields["dead"] == dead
    assert not any(isinstance(a, (PutFallback, RestartGroup)) for a in result.actions)
    return cas[0].new


@pytest.mark.parametrize("phase", [Phase.PAUSE, Phase.TRANSFER, Phase.SEND])
def test_a_survivor_dying_before_the_world_re_forms_supersedes_the_recovery_in_any_phase(phase):
    plan = unplanned(phase)
    other = next(r for r in (0, 2) if r != plan.donor.rank)         # not the donor: a plain survivor
    result = triage(seen(view(("a", 1), ("a", other)), [failure(1, "plan"), failure(other)], ((plan, 5),)))
    aborted = _superseded(result, [other])
    assert f"rank {other} died during the recovery of rank(s) [1]" in aborted.outcome
    assert "handing over" not in aborted.outcome
    marked = [(a.failure_id, a.failure.handled) for a in result.actions if isinstance(a, PutFailure)]
    assert marked == [("a-1", None)]            # rank 1's failure handed back; the new death left for the next tick
    # the next tick replaces both at once, from the one live replica
    result = triage(seen(view(("a", 1), ("a", other)), [failure(1), failure(other)], ((aborted, 6),)))
    plan2 = next(a.plan for a in result.actions if isinstance(a, CreatePlan))
    assert plan2.ranks == tuple(sorted((1, other))) and {m.donor.rank for m in plan2.moves} == {plan.donor.rank}


def test_a_failure_from_before_the_last_restart_is_no_second_fault():
    plan = unplanned(Phase.TRANSFER)
    old = ("a-2", dataclasses.replace(failure(2)[1], generation=1))
    result = triage(seen(view(("a", 1)), [failure(1, "plan"), old], ((plan, 5),)))
    assert not any(isinstance(a, CasPlan) and a.new.superseded for a in result.actions)
    assert not any(isinstance(a, Say) and a.event == "recovery_superseded" for a in result.actions)


def _mixed_commit_plan() -> SwapPlan:
    """Rank 1 died; rank 0 committed step 8 and failed in step 9 (it kept step 8's start), rank 2 failed inside
    step 8's all-reduce (sealed): rank 0 goes back to step 8 with rank 2's model, the joiner's donor is rank 2."""
    pause = [Report("a", Phase.PAUSE, failed_steps=(9, 8), dead_steps=(9, 8), stops={0: (0, 9, False),
                                                                                     2: (2, 8, True)},
                    backs={0: 8, 2: 7}),
             Report("b", Phase.PAUSE)]
    d = next_step(unplanned(Phase.PAUSE), pause, NOW)
    assert d.plan is not None and d.plan.phase == Phase.TRANSFER and d.plan.boundary == 8, d.reason
    assert [m.rank for m in d.plan.catch_up] == [0] and d.plan.donor == SlotRef("a", 2, 2)
    return d.plan


def test_a_survivor_going_back_in_a_mixed_commit_dying_is_planned_again_from_where_everyone_stands():
    plan = _mixed_commit_plan()
    result = triage(seen(view(("a", 1), ("a", 0)), [failure(1, "plan"), failure(0)], ((plan, 5),)))
    aborted = _superseded(result, [0])
    # the next plan replaces ranks 0 and 1 from rank 2; it carries nothing of the mixed commit's resolution
    result = triage(seen(view(("a", 1), ("a", 0)), [failure(1), failure(0)], ((aborted, 6),)))
    plan2 = next(a.plan for a in result.actions if isinstance(a, CreatePlan))
    assert plan2.kind == SwapKind.NODE and plan2.lost_node is None and plan2.ranks == (0, 1)
    assert plan2.phase == Phase.PAUSE and plan2.boundary is None and plan2.catch_up == ()
    assert {m.donor for m in plan2.moves} == {SlotRef("a", 2, 2)} and plan2.id != plan.id
    # its pause: rank 2 stands at step 8; node a's mirror keeps both dead ranks' two newest snapshots (rank 0's
    # step 8 start among them): everyone resumes at 8, rank 0's joiner with rank 2's model, nobody catches up
    pause = [Report("a", Phase.PAUSE, failed_steps=(8,), stops={2: (2, 8, True)}, held={0: (8, 9), 1: (8, 9)}),
             Report("b", Phase.PAUSE)]
    d = next_step(plan2, pause, NOW)
    assert d.plan is not None and d.plan.phase == Phase.TRANSFER and d.plan.boundary == 8, d.reason
    assert d.plan.light_from == {0: "a", 1: "a"} and d.plan.catch_up == ()


def test_the_donor_of_a_mixed_commit_dying_while_it_hands_over_supersedes_the_recovery():
    plan = dataclasses.replace(_mixed_commit_plan(), phase=Phase.SEND)
    result = triage(seen(view(("a", 1), ("a", 2)), [failure(1, "plan"), failure(2)], ((plan, 5),)))
    aborted = _superseded(result, [2])
    assert "rank 2 (the donor) died while handing over" in aborted.outcome
    result = triage(seen(view(("a", 1), ("a", 2)), [failure(1), failure(2)], ((aborted, 6),)))
    plan2 = next(a.plan for a in result.actions if isinstance(a, CreatePlan))
    assert plan2.ranks == (1, 2) and {m.donor for m in plan2.moves} == {SlotRef("a", 0, 0)}
    # rank 0 stands at step 9 (it had not gone back yet); the dead ranks' kept snapshots hold step 9: resume there
    pause = [Report("a", Phase.PAUSE, failed_steps=(9,), stops={0: (0, 9, False)}, backs={0: 8},
                    held={1: (8, 9), 2: (8, 9)}),
             Report("b", Phase.PAUSE)]
    d = next_step(plan2, pause, NOW)
    assert d.plan is not None and d.plan.boundary == 9 and d.plan.catch_up == (), d.reason


def test_a_death_during_the_plan_for_two_dead_ranks_supersedes_it_too():
    first = dataclasses.replace(unplanned(Phase.ABORTED), superseded=True)
    result = triage(seen(view(("a", 1), ("a", 0)), [failure(0), failure(1)], ((first, 6),)))
    plan2 = dataclasses.replace(next(a.plan for a in result.actions if isinstance(a, CreatePlan)),
                                phase=Phase.TRANSFER, secret="00")
    v = view(("a", 0), ("a", 1), ("a", 2), spares=3)
    result = triage(seen(v, [failure(0, "plan"), failure(1, "plan"), failure(2)], ((first, 6), (plan2, 7))))
    aborted = _superseded(result, [2])
    assert sorted(a.failure.rank for a in result.actions if isinstance(a, PutFailure)) == [0, 1]
    # no live replica of the replicated state is left: the group restarts, saying so, once
    result = triage(seen(v, [failure(0), failure(1), failure(2)], ((first, 6), (aborted, 8))))
    fallback = [a for a in result.actions if isinstance(a, PutFallback)]
    assert len(fallback) == 1 and "no live replica" in fallback[0].fallback.reason
    assert not any(isinstance(a, CreatePlan) for a in result.actions)


# --------------------------------------------------------------------------- a fault inside the transfer itself
def _joiner_dead(v: ClusterView, node: str = "b", slot: int = 0) -> ClusterView:
    return dataclasses.replace(v, slots=tuple(dataclasses.replace(s, state="dead") if (s.node, s.slot) == (node, slot)
                                              else s for s in v.slots))


def _planned(phase: Phase) -> SwapPlan:
    return SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef("a", 1, 1),
                    joiner=SlotRef("b", 0, 1), donor=None, phase=phase, reason="ecc", nodes=("a", "b"),
                    taint_id="t1", secret="00", history=((Phase.PAUSE.value, NOW),))


def test_a_donor_seen_dead_before_its_failure_is_read_waits_for_it_then_is_replaced_from_another_replica():
    """The status saying the donor is dead can be read before its failure record: the recovery is neither aborted
    into a group restart nor retried with the dead donor; once the failure is read, every dead rank is planned
    again at once, the state from the replica left."""
    plan = unplanned(Phase.SEND)
    v = view(("a", 1), ("a", plan.donor.slot))
    bad = Report("b", Phase.SEND, ok=False, error="the stream broke")
    early = triage(dataclasses.replace(seen(v, [failure(1, "plan")], ((plan, 5),)), reports=(bad,)))
    assert early.actions == (), early.actions
    result = triage(dataclasses.replace(seen(v, [failure(1, "plan"), failure(plan.donor.slot)], ((plan, 5),)),
                                        reports=(bad,)))
    aborted = _superseded(result, [plan.donor.rank])
    assert "(the donor) died while handing over" in aborted.outcome
    result = triage(seen(v, [failure(1), failure(plan.donor.slot)], ((aborted, 6),)))
    plan2 = next(a.plan for a in result.actions if isinstance(a, CreatePlan))
    assert {m.donor.rank for m in plan2.moves} == {2} and plan2.ranks == tuple(sorted((1, plan.donor.rank)))


@pytest.mark.parametrize("phase", [Phase.TRANSFER, Phase.SEND])
def test_a_planned_swaps_leaver_dying_as_it_sends_becomes_a_recovery_from_a_replica(phase):
    """Its failure record can come before the status: either way the swap is given up at once (not retried with
    a dead sender), and the next tick recovers the rank from a replica (an unplanned swap)."""
    plan = _planned(phase)
    for v, failures in ((view(), [failure(1)]), (view(("a", 1)), [])):
        result = triage(seen(v, failures, ((plan, 3),)))
        cas = [a for a in result.actions if isinstance(a, CasPlan)]
        assert len(cas) == 1 and cas[0].new.phase == Phase.ABORTED and not cas[0].new.superseded, result.actions
        assert "died while handing over" in cas[0].decision.reason
        assert not any(isinstance(a, (PutFallback, RestartGroup)) for a in result.actions)
    aborted = plan.advance(Phase.ABORTED, NOW)
    result = triage(seen(view(("a", 1)), [failure(1)], ((aborted, 4),)))
    create = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
    assert len(create) == 1 and create[0].kind == SwapKind.UNPLANNED and create[0].leaver == SlotRef("a", 1, 1)
    assert create[0].donor is not None and create[0].donor.rank != 1


@pytest.mark.parametrize("kind", [SwapKind.PLANNED, SwapKind.UNPLANNED])
def test_a_joiner_dying_as_it_receives_is_replaced_by_the_next_spare(kind):
    plan = _planned(Phase.SEND) if kind == SwapKind.PLANNED else unplanned(Phase.SEND)
    v = _joiner_dead(view(("a", 1)) if kind == SwapKind.UNPLANNED else view())
    bad = Report("b", Phase.SEND, ok=False, error="the joiner died or timed out during the transfer")
    failures = [failure(1, "plan")] if kind == SwapKind.UNPLANNED else []
    result = triage(dataclasses.replace(seen(v, failures, ((plan, 5),)), reports=(bad,)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert len(cas) == 1 and cas[0].new.phase == Phase.TRANSFER and cas[0].new.attempt == 1
    assert cas[0].new.joiner == SlotRef("b", 1, 1) and ("b", 0) in cas[0].new.excluded_spares
    assert not any(isinstance(a, PutFallback) for a in result.actions)


@pytest.mark.parametrize("kind", [SwapKind.PLANNED, SwapKind.UNPLANNED])
def test_the_next_spare_on_a_node_outside_the_plan_brings_its_node_into_the_re_form(kind):
    """The only spare left is on a spare node that runs no rank (not among the plan's nodes): the retried plan
    names that node too, so it takes part in REFORM and its spare is told to join (it never was: the world waited
    for it until the 120 s phase timeout, twice in chaos runs)."""
    plan = _planned(Phase.SEND) if kind == SwapKind.PLANNED else unplanned(Phase.SEND)
    assert plan.nodes == ("a", "b")
    v = _joiner_dead(view(("a", 1)) if kind == SwapKind.UNPLANNED else view())
    v = dataclasses.replace(v, spare_nodes=("c",), slots=tuple(s for s in v.slots if s.node != "b" or s.slot == 0)
                            + (SlotView("c", 0, None, "spare", True),))
    bad = Report("b", Phase.SEND, ok=False, error="the joiner died or timed out during the transfer")
    failures = [failure(1, "plan")] if kind == SwapKind.UNPLANNED else []
    result = triage(dataclasses.replace(seen(v, failures, ((plan, 5),)), reports=(bad,)))
    retried = [a.new for a in result.actions if isinstance(a, CasPlan)]
    assert len(retried) == 1 and retried[0].joiner == SlotRef("c", 0, 1) and retried[0].nodes == ("a", "b", "c")
    reform = dataclasses.replace(retried[0], phase=Phase.REFORM)
    waiting = next_step(reform, [Report("a", Phase.REFORM), Report("b", Phase.REFORM)], NOW)
    assert waiting.action == "wait" and "'c'" in waiting.reason        # c's report is needed too


def test_a_joiner_dying_with_no_spare_left_restarts_the_group_saying_why_in_one_line():
    plan = unplanned(Phase.SEND)
    v = _joiner_dead(view(("a", 1), spares=1))
    bad = Report("b", Phase.SEND, ok=False, error="the joiner died or timed out during the transfer")
    result = triage(dataclasses.replace(seen(v, [failure(1, "plan")], ((plan, 5),)), reports=(bad,)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    # not "its recovery was aborted" from the aborted plan: the fallback record says why (it spends a restart)
    assert len(cas) == 1 and cas[0].new.phase == Phase.ABORTED and cas[0].new.superseded and not cas[0].new.outcome
    fallback = [a for a in result.actions if isinstance(a, PutFallback)]
    assert len(fallback) == 1 and (fallback[0].node, fallback[0].fallback.slot) == ("a", 1)
    why = fallback[0].fallback.reason
    assert "rank 1" in why and "joiner b/0 died" in why and "no other spare" in why and "\n" not in why


def test_a_planned_swaps_joiner_dying_with_no_spare_left_waits_for_a_spare_again():
    plan = _planned(Phase.TRANSFER)
    taint = Taint(id="t1", effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="a", slot=1, rank=1,
                  handled_by="s-1", state="migrating")
    v = _joiner_dead(view(spares=1))
    bad = Report("b", Phase.TRANSFER, ok=False, error="spare b/0 is gone")
    result = triage(dataclasses.replace(seen(v, [], ((plan, 5),), (taint,)), reports=(bad,)))
    cas = [a for a in result.actions if isinstance(a, CasPlan)]
    assert len(cas) == 1 and cas[0].new.phase == Phase.ABORTED
    reopened = [a.taint for a in result.actions if isinstance(a, PutTaint)]
    assert reopened and reopened[0].handled_by is None and "no other spare" in reopened[0].state
    assert not any(isinstance(a, (PutFallback, RestartGroup)) for a in result.actions)


def test_a_rank_that_did_not_join_waits_for_its_failure_before_the_re_form_is_given_up():
    """Its node may report it before its failure record is read: no group restart for that; the failure then folds
    the death into the recovery. With nobody dead after the grace, the re-form is given up."""
    plan = _in_reform()
    bad = Report("a", Phase.REFORM, ok=False, error="rank 2 did not join the new world: None")
    early = triage(dataclasses.replace(seen(_reforming_view(("a", 1)), [failure(1, "plan")], ((plan, 5),)),
                                       reports=(bad,)))
    assert early.actions == ()
    late = triage(dataclasses.replace(seen(_reforming_view(("a", 1)), [failure(1, "plan")], ((plan, 5),)),
                                      reports=(bad,), now=NOW + 60))
    cas = [a for a in late.actions if isinstance(a, CasPlan)]
    assert len(cas) == 1 and cas[0].new.phase == Phase.ABORTED and not cas[0].new.superseded
