"""Whole-node loss as pure decisions: the node planner (tpassrun/plan/swap.py), the triage's part (tpassrun/plan/triage.py)
and the generation a node plan commits (tpassrun/swapper/coordinator.py)."""

from __future__ import annotations

import dataclasses

import pytest

from tpassrun.plan.swap import (
    ClusterView,
    SlotView,
    lost_ranks,
    next_step,
    node_plan_id,
    plan_for_node_loss,
    resume_step_node,
    transfer_key,
)
from tpassrun.plan.triage import CasPlan, CreatePlan, PutFailure, PutTaint, RestartGroup, Say, Seen, triage
from tpassrun.records import Failure, Move, Phase, Report, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect
from tpassrun.rendezvous import Generation, GenState, Member, NodeInfo
from tpassrun.swapper.coordinator import committed_generation, homes_of

NOW = 1000.0
# a: ranks 0,1; b: ranks 2,3 (lost); c: a --spare-node with two warm spares
HOMES = ((0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1))
A = (SlotView("a", 0, 0, "running", True, 7), SlotView("a", 1, 1, "running", True, 7))
C = (SlotView("c", 0, None, "spare", True), SlotView("c", 1, None, "spare", True))


def view(*slots: SlotView, lost=("b",), members=("a", "b"), spare_nodes=("c",)) -> ClusterView:
    return ClusterView(generation=3, members=members, spare_nodes=spare_nodes, slots=slots, lost=lost, homes=HOMES)


def test_the_lost_nodes_ranks_go_to_one_spare_node_with_donors_spread_and_it_takes_the_nodes_place():
    d = plan_for_node_loss(view(*A, *C), node="b", now_wall=NOW)
    assert d.action == "plan" and d.plan is not None
    plan = d.plan
    assert plan.id == node_plan_id("b") and plan.kind == SwapKind.NODE and plan.lost_node == "b"
    assert [(m.rank, m.leaver, m.joiner) for m in plan.moves] == [
        (2, SlotRef("b", 0, 2), SlotRef("c", 0, 2)), (3, SlotRef("b", 1, 3), SlotRef("c", 1, 3))]
    assert [m.donor.rank for m in plan.moves] == [0, 1]          # two donors, in parallel
    assert plan.replaces == "c" and plan.nodes == ("a", "c") and plan.phase == Phase.PAUSE
    assert plan.ranks == (2, 3) and (plan.leaver, plan.joiner) == (plan.moves[0].leaver, plan.moves[0].joiner)
    assert SwapPlan.from_json(plan.to_json()) == plan


def test_without_a_spare_node_the_ranks_spread_over_spare_slots_of_other_nodes():
    spares = (SlotView("a", 2, None, "spare", True), SlotView("d", 1, None, "spare", True))
    d = plan_for_node_loss(view(*A, SlotView("d", 0, 4, "running", True, 7), *spares,
                                members=("a", "b", "d"), spare_nodes=()), node="b", now_wall=NOW)
    assert d.action == "plan" and d.plan is not None
    assert sorted((m.joiner.node, m.joiner.slot) for m in d.plan.moves) == [("a", 2), ("d", 1)]
    assert d.plan.replaces is None and set(d.plan.nodes) == {"a", "d"}
    assert len({m.donor.node for m in d.plan.moves}) == 2        # one donor on each surviving node


def test_when_no_live_recovery_is_possible_the_planner_says_why():
    assert plan_for_node_loss(view(*A, C[0]), node="b", now_wall=NOW).action == "fallback"     # one spare, two ranks
    no_donor = plan_for_node_loss(view(*C), node="b", now_wall=NOW)
    assert no_donor.action == "fallback" and "no rank survived" in no_donor.reason
    unmanaged = plan_for_node_loss(view(dataclasses.replace(A[0], managed=False), A[1], *C), node="b", now_wall=NOW)
    assert unmanaged.action == "fallback" and "tpassrun.init()" in unmanaged.reason
    assert plan_for_node_loss(view(*A, *C, lost=("c",)), node="c", now_wall=NOW).action == "none"   # idle spare node
    assert lost_ranks(view(*A, *C), "b") == [(2, 0), (3, 1)]


def test_spares_still_starting_make_up_what_the_ready_ones_lack_rather_than_a_restart():
    """A node holding two ranks lost while the only spare node's second slot is still starting (a spare node just
    started, a slot back in the pool): the ready slot and the starting one take them (the re-form waits for the
    latter); with a ready spare node elsewhere that has enough, that one is taken instead."""
    starting = (C[0], dataclasses.replace(C[1], managed=False))
    d = plan_for_node_loss(view(*A, *starting), node="b", now_wall=NOW)
    assert d.action == "plan" and d.plan is not None, d.reason
    assert [(m.rank, m.joiner) for m in d.plan.moves] == [(2, SlotRef("c", 0, 2)), (3, SlotRef("c", 1, 3))]
    ready_elsewhere = (SlotView("e", 0, None, "spare", True), SlotView("e", 1, None, "spare", True))
    d = plan_for_node_loss(view(*A, *starting, *ready_elsewhere, spare_nodes=("c", "e")), node="b", now_wall=NOW)
    assert d.plan is not None and {m.joiner.node for m in d.plan.moves} == {"e"}
    none_left = plan_for_node_loss(view(*A, starting[1]), node="b", now_wall=NOW)
    assert none_left.action == "fallback" and "only 1 spare slot(s)" in none_left.reason


def _plan() -> SwapPlan:
    d = plan_for_node_loss(view(*A, *C), node="b", now_wall=NOW)
    assert d.plan is not None
    return dataclasses.replace(d.plan, secret="ab" * 32)


def test_resume_step_needs_every_lost_ranks_copy_for_the_survivors_step():
    survivors = Report(node="a", phase=Phase.PAUSE, failed_steps=(12, 12), held={2: (11, 12), 3: (12, 13)})
    spare = Report(node="c", phase=Phase.PAUSE)
    assert resume_step_node([survivors, spare], (2, 3)) == (12, {2: "a", 3: "a"}, resume_step_node(
        [survivors, spare], (2, 3))[2])
    old = dataclasses.replace(survivors, held={2: (10, 11), 3: (12, 13)})
    step, _, why = resume_step_node([old, spare], (2, 3))
    assert step is None and "rank 2" in why and "[10, 11]" in why
    gone = dataclasses.replace(survivors, held={})
    step, _, why = resume_step_node([gone, spare], (2, 3))
    assert step is None and "buddy node is lost too" in why
    mixed = dataclasses.replace(survivors, failed_steps=(12,), steps=(13,))
    assert resume_step_node([mixed], (2, 3))[0] is None
    fresh = Report(node="a", phase=Phase.PAUSE, steps=(0, 0))    # lost before anyone took a snapshot
    assert resume_step_node([fresh], (2, 3)) == (0, {}, resume_step_node([fresh], (2, 3))[2])


def test_a_node_plan_runs_through_its_phases_and_never_retries():
    plan = _plan()
    pause = [Report(node="a", phase=Phase.PAUSE, failed_steps=(12, 12), held={2: (11, 12), 3: (11, 12)})]
    assert next_step(plan, pause, NOW).action == "wait"              # c has not reported yet
    pause.append(Report(node="c", phase=Phase.PAUSE))
    d = next_step(plan, pause, NOW)
    assert d.plan is not None and d.plan.phase == Phase.TRANSFER and d.plan.boundary == 12
    assert d.plan.light_from == {2: "a", 3: "a"}
    plan = d.plan
    addrs = Report(node="c", phase=Phase.TRANSFER, joiner_addrs={2: ("10.0.0.3", 4002), 3: ("10.0.0.3", 4003)})
    d = next_step(plan, [addrs], NOW)
    assert d.plan is not None and d.plan.phase == Phase.SEND
    assert [m.joiner_addr for m in d.plan.moves] == [("10.0.0.3", 4002), ("10.0.0.3", 4003)]
    send = d.plan
    failed = next_step(send, [Report(node="c", phase=Phase.SEND, ok=False, error="rank 3: checksum")], NOW)
    assert failed.plan is not None and failed.plan.phase == Phase.ABORTED and "checksum" in failed.plan.outcome
    dead_donor = next_step(send, [], NOW, sender_dead=True)      # its failure supersedes the plan (triage)
    assert dead_donor.action == "wait" and dead_donor.plan is None
    d = next_step(send, [Report(node="c", phase=Phase.SEND)], NOW)
    assert d.plan is not None and d.plan.phase == Phase.REFORM
    d = next_step(d.plan, [Report(node="a", phase=Phase.REFORM), Report(node="c", phase=Phase.REFORM)], NOW)
    assert d.plan is not None and d.plan.phase == Phase.DONE
    assert transfer_key(plan) == transfer_key(send) is not None


def test_a_mixed_commit_rolls_forward_the_survivors_that_failed_inside_the_step_the_others_completed():
    """Rank 0 completed step 12 (its optimizer stepped: it stopped at 13), rank 1 failed inside 12 with its seal
    of 13: rank 1 catches up from rank 0 and everyone, the lost ranks' joiners too, resumes at 13."""
    plan = _plan()
    a = Report(node="a", phase=Phase.PAUSE, failed_steps=(13, 12), held={2: (12, 13), 3: (12, 13)},
               stops={0: (0, 13, False), 1: (1, 12, True)})
    d = next_step(plan, [a, Report(node="c", phase=Phase.PAUSE)], NOW)
    assert d.plan is not None and d.plan.phase == Phase.TRANSFER and d.plan.boundary == 13, d.reason
    assert "mixed commit" in d.reason and d.plan.light_from == {2: "a", 3: "a"}
    assert d.plan.catch_up == (Move(SlotRef("a", 1, 1), SlotRef("a", 1, 1), SlotRef("a", 0, 0)),)
    assert [m.donor.rank for m in d.plan.moves] == [0, 0]      # the laggard (rank 1) donates to no joiner
    assert SwapPlan.from_json(d.plan.to_json()) == d.plan
    # TRANSFER waits for the laggard's address too, then SEND carries it
    joiners = Report(node="c", phase=Phase.TRANSFER, joiner_addrs={2: ("10.0.0.3", 1), 3: ("10.0.0.3", 2)})
    assert next_step(d.plan, [joiners], NOW).action == "wait"                     # a has not reported yet
    silent = Report(node="a", phase=Phase.TRANSFER)
    assert next_step(d.plan, [joiners, silent], NOW).plan.phase == Phase.ABORTED  # rank 1 never listened
    behind = Report(node="a", phase=Phase.TRANSFER, joiner_addrs={1: ("10.0.0.1", 3)})
    send = next_step(d.plan, [joiners, behind], NOW).plan
    assert send is not None and send.phase == Phase.SEND and send.catch_up[0].joiner_addr == ("10.0.0.1", 3)
    assert next_step(send, [Report(node="c", phase=Phase.SEND)], NOW).action == "wait"   # a has not said yet
    # the mirror must hold the lost ranks' seals of the step the survivors catch up to
    old = dataclasses.replace(a, held={2: (11, 12), 3: (12, 13)})
    d = next_step(plan, [old, Report(node="c", phase=Phase.PAUSE)], NOW)
    assert d.plan is not None and d.plan.phase == Phase.ABORTED and "rank 2" in d.plan.outcome


def test_a_mixed_commit_is_not_rolled_forward_without_the_laggards_seal_or_more_than_a_step_apart():
    from tpassrun.plan.catchup import roll_forward

    no_seal = Report(node="a", phase=Phase.PAUSE, failed_steps=(13, 12), stops={0: (0, 13, False), 1: (1, 12, False)})
    r = roll_forward([no_seal])
    assert r.step is None and "rank" in r.why and "[1]" in r.why
    apart = Report(node="a", phase=Phase.PAUSE, stops={0: (0, 14, False), 1: (1, 12, True)})
    assert roll_forward([apart]).step is None
    same = Report(node="a", phase=Phase.PAUSE, stops={0: (0, 12, True), 1: (1, 12, True)})
    assert roll_forward([same]).step is None
    # laggards on two nodes catch up from a leader on their own node first
    a = Report(node="a", phase=Phase.PAUSE, stops={0: (0, 13, False), 1: (1, 12, True)})
    d_ = Report(node="d", phase=Phase.PAUSE, stops={4: (0, 12, True), 5: (1, 13, False)})
    r = roll_forward([a, d_])
    assert r.step == 13 and {(m.rank, m.donor.rank) for m in r.moves} == {(1, 0), (4, 5)}
    assert Report.from_json(a.to_json()) == a


def test_a_sharded_jobs_lost_ranks_take_their_shards_from_the_mirror_or_everyone_rolls_back():
    """ZeRO-style: no survivor holds a lost rank's shard; B's buddy (a) holds them (with their light state)."""
    plan = _plan()
    c = Report(node="c", phase=Phase.PAUSE)
    a = Report(node="a", phase=Phase.PAUSE, failed_steps=(12, 12), rings=(10, 11, 12), shard_held={2: (11, 12),
                                                                                                   3: (11, 12)})
    d = next_step(plan, [a, c], NOW)
    assert d.plan is not None and d.plan.phase == Phase.TRANSFER, d.reason
    assert (d.plan.boundary, d.plan.restore, d.plan.shards_from) == (12, False, {2: "a", 3: "a"})
    assert SwapPlan.from_json(d.plan.to_json()) == d.plan
    # rank 3's refresh of step 12 had not landed: everyone rolls back to step 11 (held by all) and recomputes
    late = dataclasses.replace(a, shard_held={2: (11, 12), 3: (10, 11)})
    d = next_step(plan, [late, c], NOW)
    assert d.plan is not None and (d.plan.boundary, d.plan.restore) == (11, True), d.reason
    # the restore needs every surviving node in TRANSFER, joiners or not
    assert next_step(d.plan, [Report(node="c", phase=Phase.TRANSFER, joiner_addrs={2: ("h", 1), 3: ("h", 2)})],
                     NOW).action == "wait"
    # a mixed commit of a sharded job rolls back too, when the copies allow it
    mixed = dataclasses.replace(a, failed_steps=(12, 13), rings=(11, 12))
    d = next_step(plan, [mixed, c], NOW)
    assert d.plan is not None and (d.plan.boundary, d.plan.restore) == (12, True), d.reason
    # nothing mirrored (lost before their first refresh, or the buddy is gone too): the group restarts, saying why
    bare = dataclasses.replace(a, shard_held={2: (11, 12)})
    d = next_step(plan, [bare, c], NOW)
    assert d.plan is not None and d.plan.phase == Phase.ABORTED and "[3]" in d.plan.outcome
    # plain data parallelism: no shards, no rings: the light-state path
    assert next_step(plan, [dataclasses.replace(a, rings=None, shard_held={}, held={2: (12,), 3: (12,)}), c],
                     NOW).plan.shards_from == {}


def test_sharded_survivors_alone_in_their_replica_group_donate_the_replicated_rest():
    zero = tuple(dataclasses.replace(s, replicas=(s.rank,), sharded=True) for s in A)
    d = plan_for_node_loss(view(*zero, *C), node="b", now_wall=NOW)
    assert d.action == "plan" and [m.donor.rank for m in d.plan.moves] == [0, 1], d.reason
    alone = tuple(dataclasses.replace(s, replicas=(s.rank,)) for s in A)       # alone, nothing mirrored
    assert plan_for_node_loss(view(*alone, *C), node="b", now_wall=NOW).action == "fallback"


def test_two_nodes_lost_at_once_go_to_two_spare_nodes_in_one_plan():
    """a, b, d, e members (one rank each, ring a -> b -> d -> e -> a); b and e lost (not each other's buddy);
    spare nodes c and f take one lost node each, donors spread."""
    from tpassrun.plan.multiloss import plan_for_losses

    homes = ((0, "a", 0), (1, "b", 0), (2, "d", 0), (3, "e", 0))
    slots = (SlotView("a", 0, 0, "running", True, 7), SlotView("d", 0, 2, "running", True, 7),
             SlotView("c", 0, None, "spare", True), SlotView("f", 0, None, "spare", True))
    v = ClusterView(generation=3, members=("a", "b", "d", "e"), spare_nodes=("c", "f"), slots=slots,
                    lost=("b", "e"), homes=homes)
    d = plan_for_losses(v, ["b", "e"], [], now_wall=NOW, swap_id="n-b")
    assert d.action == "plan" and d.plan is not None, d.reason
    plan = d.plan
    assert [(m.rank, m.joiner.node) for m in plan.moves] == [(1, "c"), (3, "f")]
    assert sorted(m.donor.rank for m in plan.moves) == [0, 2]
    assert (plan.lost_node, plan.lost_also, dict(plan.replacing)) == ("b", ("e",), {"b": "c", "e": "f"})
    assert SwapPlan.from_json(plan.to_json()) == plan
    # the triage plans both at once, and marks both covered
    result = triage(Seen(now=NOW, epoch=3, plans=(), reports=(), failures=(), taints=(), view=v))
    assert [type(a) for a in result.actions] == [Say, CreatePlan]
    both = result.actions[1].plan
    assert sorted(m.rank for m in both.moves) == [1, 3]
    again = triage(Seen(now=NOW, epoch=3, plans=((dataclasses.replace(both, phase=Phase.DONE), 4),),
                        reports=(), failures=(), taints=(), view=v))
    assert not [a for a in again.actions if isinstance(a, CreatePlan)]
    # the generation it commits: c and f take b's and e's places
    gen = Generation(number=3, state=GenState.ACTIVE, world_size=4, members=tuple(
        Member(n, i, f"10.0.0.{i}", 1, i) for i, n in enumerate("abde")), spare_nodes=("c", "f"), lost=("b", "e"))
    new = committed_generation(gen, both, {"c": NodeInfo("c", "10.0.0.9", 1, 0), "f": NodeInfo("f", "10.0.0.8", 1, 0)})
    assert [m.node_id for m in new.members] == ["a", "c", "d", "f"] and new.lost == () and new.spare_nodes == ()
    assert [m.addr for m in new.members][1] == "10.0.0.9"
    # one spare for two lost nodes: the group restarts, saying why
    short = dataclasses.replace(v, slots=slots[:3])
    assert plan_for_losses(short, ["b", "e"], [], now_wall=NOW, swap_id="n-b").action == "fallback"


def test_a_lost_nodes_plan_whose_transfer_failed_is_tried_once_more_with_the_ranks_that_died_meanwhile():
    plan = dataclasses.replace(_plan(), phase=Phase.SEND)
    bad = Report(node="c", phase=Phase.SEND, ok=False, error="rank 2: the joiner died or timed out")
    result = triage(seen(plans=((plan, 9),), reports=(bad,)))
    assert [type(a) for a in result.actions] == [CasPlan, Say]
    first = result.actions[0].new
    assert first.superseded and "tried once more" in first.outcome
    # meanwhile donor rank 0 died: the next plan replaces it too, from rank 1
    dead0 = Failure(node="a", slot=0, rank=0, code=-9, step=12, light=True, generation=3)
    v = view(dataclasses.replace(A[0], state="dead"), A[1], *C, SlotView("a", 2, None, "spare", True))
    result = triage(seen(plans=((first, 10),), failures=(("a-0", dead0),), view=v))
    created = [a for a in result.actions if isinstance(a, CreatePlan)]
    assert created and sorted(m.rank for m in created[0].plan.moves) == [0, 2, 3], result.actions
    assert {m.donor.rank for m in created[0].plan.moves} == {1}
    assert [a.failure.handled for a in result.actions if isinstance(a, PutFailure)] == ["plan"]
    # a second failed transfer restarts the group
    second = dataclasses.replace(created[0].plan, phase=Phase.SEND, secret="ab" * 32)
    result = triage(seen(plans=((first, 10), (second, 11)), reports=(dataclasses.replace(bad, node="c"),), view=v))
    assert [type(a) for a in result.actions] == [CasPlan, RestartGroup]


# --------------------------------------------------------------------------------------------- triage
def seen(**kw) -> Seen:
    base = dict(now=NOW, epoch=3, plans=(), reports=(), failures=(), taints=(), view=view(*A, *C))
    return Seen(**{**base, **kw})


def test_triage_plans_a_lost_node_once_and_marks_its_late_failures():
    failure = Failure(node="b", slot=0, rank=2, code=-9, step=12, light=True, generation=3)
    result = triage(seen(failures=(("b-0", failure),)))
    assert [type(a).__name__ for a in result.actions] == ["Say", "CreatePlan"]
    plan = result.actions[1].plan
    assert plan.kind == SwapKind.NODE and plan.id == "n-b"
    # the plan exists: the failure reported by the lost node is its plan's business
    again = triage(seen(failures=(("b-0", failure),), plans=((dataclasses.replace(plan, phase=Phase.DONE), 5),)))
    assert [type(a) for a in again.actions] == [PutFailure] and again.actions[0].failure.handled == "node_lost"


def test_triage_restarts_the_group_once_when_the_lost_node_cannot_be_recovered_live():
    result = triage(seen(view=view(*A, C[0])))
    assert [type(a) for a in result.actions] == [Say, CreatePlan, RestartGroup]
    marker = result.actions[1].plan
    assert marker.phase == Phase.ABORTED and marker.id == "n-b" and "spare" in marker.outcome
    assert "only 1 spare slot(s)" in result.actions[2].reason
    assert triage(seen(view=view(*A, C[0]), plans=((marker, 4),))).actions == ()


def test_a_plan_that_needs_a_node_lost_meanwhile_is_superseded_at_once_and_its_taint_waits_again():
    taint = Taint(id="t-1", effect=TaintEffect.MIGRATE, node_id="a", slot=0, rank=0, reason="ecc", source="tpassctl", time=NOW - 5,
                  handled_by="s-1", state="migrating")
    taint_plan = SwapPlan(id="s-1", kind=SwapKind.PLANNED, generation=3, leaver=SlotRef("a", 0, 0),
                          joiner=SlotRef("b", 2, 0), donor=None, phase=Phase.BOUNDARY, reason="ecc",
                          nodes=("a", "b"), history=(("pause", NOW),), taint_id="t-1")
    result = triage(seen(plans=((taint_plan, 9),), taints=(taint,)))
    assert [type(a) for a in result.actions] == [Say, CasPlan, Say, PutTaint]     # (the first Say: taint received)
    aborted = result.actions[1].new
    assert aborted.phase == Phase.ABORTED and aborted.superseded and "node b was lost" in aborted.outcome
    assert result.actions[3].taint.handled_by is None and "waiting" in result.actions[3].taint.state
    # the next look plans the lost node's ranks (the taint's own turn comes after)
    result = triage(seen(plans=((aborted, 10),), taints=(result.actions[3].taint,), received_said=frozenset({"t-1"})))
    assert [type(a) for a in result.actions] == [Say, CreatePlan] and result.actions[1].plan.id == "n-b"
    # a node plan that loses another node (here its joiners') before its world re-forms is superseded: the next
    # look plans everything gone at once (here: nothing can take b's ranks any more, so the group restarts)
    node_plan = dataclasses.replace(_plan(), phase=Phase.SEND)
    lost_both = view(*A, lost=("b", "c"))
    result = triage(seen(plans=((node_plan, 9),), view=lost_both))
    assert [type(a) for a in result.actions] == [CasPlan, Say]
    superseded = result.actions[0].new
    assert superseded.phase == Phase.ABORTED and superseded.superseded and "node c was lost" in superseded.outcome
    result = triage(seen(plans=((superseded, 10),), view=lost_both))
    assert [type(a) for a in result.actions] == [Say, CreatePlan, RestartGroup]
    assert result.actions[1].plan.id == "n-b-1" and "spare" in result.actions[2].reason
    # in REFORM everyone is inside the new world's rendezvous: the group restarts
    reforming = dataclasses.replace(_plan(), phase=Phase.REFORM)
    result = triage(seen(plans=((reforming, 9),), view=lost_both))
    assert [type(a) for a in result.actions] == [CasPlan, RestartGroup]


def test_a_recovery_that_loses_a_node_before_its_world_re_forms_is_folded_into_that_nodes_plan():
    """A partition longer than the lease: rank 1 on a (blocked in a collective with the cut-off node b) was killed
    by the hang watchdog, and its recovery waits in PAUSE for b's report until b's lease ends. The recovery is
    superseded, rank 1 handed back, and one plan takes b's ranks and rank 1 at once: nobody restarts."""
    spare_a = SlotView("a", 2, None, "spare", True)
    v = view(A[0], dataclasses.replace(A[1], state="dead"), spare_a, *C, SlotView("c", 2, None, "spare", True))
    dead1 = Failure(node="a", slot=1, rank=1, code=-9, step=12, light=True, generation=3, handled="plan")
    for phase in (Phase.PAUSE, Phase.TRANSFER, Phase.SEND):
        recovery = SwapPlan(id="u-a-1-3", kind=SwapKind.UNPLANNED, generation=3, leaver=SlotRef("a", 1, 1),
                            joiner=SlotRef("a", 2, 1), donor=SlotRef("b", 0, 2), phase=phase, reason="exit code -9",
                            nodes=("a", "b"), history=(("pause", NOW - 3),))
        result = triage(seen(plans=((recovery, 9),), failures=(("a-1", dead1),), view=v))
        assert [type(a) for a in result.actions] == [CasPlan, Say, PutFailure], phase
        aborted = result.actions[0].new
        assert aborted.superseded and "node b was lost during the recovery of rank(s) [1]" in aborted.outcome
        handed_back = result.actions[2].failure
        assert handed_back.handled is None and not any(isinstance(a, RestartGroup) for a in result.actions)
        result = triage(seen(plans=((aborted, 10),), failures=(("a-1", handed_back),), view=v))
        created = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
        assert len(created) == 1 and created[0].kind == SwapKind.NODE and created[0].lost_node == "b"
        assert sorted(m.rank for m in created[0].moves) == [1, 2, 3]
        assert {m.donor.rank for m in created[0].moves} == {0}                  # the one live replica
        assert [a.failure.handled for a in result.actions if isinstance(a, PutFailure)] == ["plan"]
        assert not any(isinstance(a, RestartGroup) for a in result.actions)


def test_a_node_lost_while_a_recovery_re_forms_the_world_is_recovered_live_by_the_next_plan():
    """As a rank dying there: the recovery is superseded (every rank stops joining and waits, its joiner a/2 keeps
    rank 1's state and is no donor), and the next look plans b's ranks alone, the joiner re-forming with them."""
    spare_a = SlotView("a", 2, None, "spare", True)
    v = view(A[0], dataclasses.replace(A[1], state="dead"), spare_a, *C, SlotView("c", 2, None, "spare", True))
    dead1 = Failure(node="a", slot=1, rank=1, code=-9, step=12, light=True, generation=3, handled="plan")
    reforming = SwapPlan(id="u-a-1-3", kind=SwapKind.UNPLANNED, generation=3, leaver=SlotRef("a", 1, 1),
                         joiner=SlotRef("a", 2, 1), donor=SlotRef("b", 0, 2), phase=Phase.REFORM,
                         reason="exit code -9", nodes=("a", "b"),
                         history=(("pause", NOW - 3), ("reform", NOW - 1)))
    result = triage(seen(plans=((reforming, 9),), failures=(("a-1", dead1),), view=v))
    assert [type(a) for a in result.actions] == [CasPlan, Say], result.actions
    aborted = result.actions[0].new
    assert aborted.superseded and aborted.phase == Phase.ABORTED
    assert "node b was lost while the world re-formed for the recovery of rank(s) [1]" in aborted.outcome
    assert result.actions[1].fields["lost_node"] == "b" and result.actions[1].fields["phase"] == "reform"
    # the status still shows a/2 as the spare it was: the next plan must neither move rank 1 again nor use a/2
    result = triage(seen(plans=((aborted, 10),), failures=(("a-1", dead1),), view=v))
    created = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
    assert len(created) == 1 and created[0].kind == SwapKind.NODE and created[0].lost_node == "b", result.actions
    assert sorted(m.rank for m in created[0].moves) == [2, 3]
    assert {m.donor.rank for m in created[0].moves} == {0}
    assert all(m.joiner.node == "c" for m in created[0].moves) and "a" in created[0].nodes
    assert not any(isinstance(a, (RestartGroup, PutFailure)) for a in result.actions)


def test_a_node_lost_while_a_planned_swap_re_forms_is_recovered_live_even_when_it_held_the_leaver():
    """b/0 (rank 2) migrated to a's spare; b is lost while the world re-forms: nobody was left to ask for the
    restart before (the leaver's agent did). Now b's other rank is planned and rank 2 stays with its joiner."""
    taint = Taint(id="t-2", effect=TaintEffect.MIGRATE, node_id="b", slot=0, rank=2, reason="ecc", source="tpassctl",
                  time=NOW - 5, handled_by="s-2", state="migrating")
    spare_a = SlotView("a", 2, None, "spare", True)
    v = view(*A, spare_a, *C)
    plan = SwapPlan(id="s-2", kind=SwapKind.PLANNED, generation=3, leaver=SlotRef("b", 0, 2),
                    joiner=SlotRef("a", 2, 2), donor=None, phase=Phase.REFORM, reason="ecc", nodes=("a", "b"),
                    taint_id="t-2", history=(("pause", NOW - 3), ("reform", NOW - 1)))
    result = triage(seen(plans=((plan, 9),), taints=(taint,), view=v, received_said=frozenset({"t-2"})))
    assert [type(a) for a in result.actions] == [CasPlan, Say], result.actions
    aborted = result.actions[0].new
    assert aborted.superseded and "the swap of rank 2" in aborted.outcome
    result = triage(seen(plans=((aborted, 10),), taints=(taint,), view=v, received_said=frozenset({"t-2"})))
    created = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
    assert len(created) == 1 and [m.rank for m in created[0].moves] == [3], result.actions
    assert created[0].moves[0].donor.node == "a" and created[0].moves[0].donor.slot in (0, 1)


def test_a_node_lost_with_the_joiner_while_the_world_re_forms_restarts_the_group_saying_why():
    """The joiner had not loaded what it received: rank 1's state is gone with its node. The same when nothing can
    take the lost node's ranks (no spare left)."""
    v = view(A[0], dataclasses.replace(A[1], state="dead"), SlotView("b", 2, None, "spare", True), *C)
    dead1 = Failure(node="a", slot=1, rank=1, code=-9, step=12, light=True, generation=3, handled="plan")
    plan = SwapPlan(id="u-a-1-3", kind=SwapKind.UNPLANNED, generation=3, leaver=SlotRef("a", 1, 1),
                    joiner=SlotRef("b", 2, 1), donor=SlotRef("a", 0, 0), phase=Phase.REFORM, reason="exit code -9",
                    nodes=("a", "b"), history=(("pause", NOW - 3), ("reform", NOW - 1)))
    result = triage(seen(plans=((plan, 9),), failures=(("a-1", dead1),), view=v))
    assert [type(a) for a in result.actions] == [CasPlan, RestartGroup], result.actions
    assert result.actions[0].new.superseded and result.actions[0].new.outcome is None   # a second fault: a restart
    why = result.actions[1].reason
    assert "node b was lost while the world re-formed" in why and "the joiner was lost with it" in why
    assert "\n" not in why
    no_spare = view(*A, SlotView("a", 2, None, "spare", True))
    planned = SwapPlan(id="s-0", kind=SwapKind.PLANNED, generation=3, leaver=SlotRef("a", 0, 0),
                       joiner=SlotRef("a", 2, 0), donor=None, phase=Phase.REFORM, reason="ecc", nodes=("a", "b"),
                       history=(("pause", NOW - 3), ("reform", NOW - 1)))
    result = triage(seen(plans=((planned, 9),), view=no_spare))
    assert [type(a) for a in result.actions] == [CasPlan, RestartGroup], result.actions
    assert "cannot be recovered live" in result.actions[1].reason and "spare" in result.actions[1].reason


def test_a_superseded_recovery_hands_back_only_its_own_death_not_an_earlier_one_of_the_same_rank():
    """Rank 1 died in a/1 earlier and was recovered into a/2 (that failure stays handled); it dies again in a/2 and
    that recovery is superseded by b's loss: only the a/2 death goes back, and the next plan moves rank 1 once."""
    v = view(A[0], dataclasses.replace(A[1], rank=None, state="spare"), SlotView("a", 2, 1, "dead", True, 12),
             *C, SlotView("c", 2, None, "spare", True))
    earlier = Failure(node="a", slot=1, rank=1, code=-9, step=4, light=True, generation=3, handled="plan")
    again = Failure(node="a", slot=2, rank=1, code=-9, step=12, light=True, generation=3, handled="plan")
    recovery = SwapPlan(id="u-a-2-3", kind=SwapKind.UNPLANNED, generation=3, leaver=SlotRef("a", 2, 1),
                        joiner=SlotRef("a", 1, 1), donor=SlotRef("a", 0, 0), phase=Phase.PAUSE,
                        reason="exit code -9", nodes=("a", "b"), history=(("pause", NOW - 3),))
    failures = (("a-1", earlier), ("a-2", again))
    result = triage(seen(plans=((recovery, 9),), failures=failures, view=v))
    handed = [a for a in result.actions if isinstance(a, PutFailure)]
    assert [(a.failure_id, a.failure.handled) for a in handed] == [("a-2", None)]
    aborted = result.actions[0].new
    result = triage(seen(plans=((aborted, 10),), failures=(("a-1", earlier), ("a-2", handed[0].failure)), view=v))
    created = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
    assert len(created) == 1 and sorted(m.rank for m in created[0].moves) == [1, 2, 3]


def test_a_death_reported_late_by_a_node_whose_ranks_moved_is_stale_not_recovered():
    """A node cut off from etcd killed a rank blocked on the partition and wrote its failure record when the link
    came back, after its ranks had been moved live to the spare node (c): nothing to recover, nobody paused."""
    moved = (SlotView("c", 0, 2, "running", True, 9), SlotView("c", 1, 3, "running", True, 9))
    v = view(*A, *moved, SlotView("b", 0, None, "spare", True), lost=(), members=("a", "c"), spare_nodes=("b",))
    late = Failure(node="b", slot=1, rank=3, code=-9, step=7, light=True, generation=3)
    result = triage(seen(failures=(("b-1", late),), view=v))
    assert [type(a) for a in result.actions] == [PutFailure]
    assert result.actions[0].failure.handled == "stale" and "runs on c/1" in result.actions[0].failure.reason
    # nor is it a second fault of a plan in flight
    plan = dataclasses.replace(_plan(), phase=Phase.TRANSFER, secret="ab" * 32)
    result = triage(seen(plans=((plan, 9),), failures=(("b-1", late),), view=v))
    assert not any(isinstance(a, CasPlan) and a.new.superseded for a in result.actions)


def test_a_node_lost_again_is_planned_again_whatever_plans_its_earlier_losses_left():
    """b was lost once and nothing could take its ranks (a marker plan, born aborted, and the group restarted); later,
    back as a spare node, it took ranks and was lost again; or its earlier loss was recovered live (a DONE plan).
    Neither plan holds the new loss: it gets its own plan. (bench/chaos.py once showed the old marker keeping b
    "held": nothing was planned until the survivors gave up waiting 30 s later.)"""
    marker = SwapPlan(id="n-b", kind=SwapKind.NODE, generation=1, leaver=SlotRef("b", 0), joiner=SlotRef("b", 0),
                      donor=None, phase=Phase.ABORTED, reason="node b lost", nodes=(),
                      history=((Phase.ABORTED.value, NOW - 100),), lost_node="b", outcome="no spare")
    done = dataclasses.replace(_plan(), id="n-b-1", phase=Phase.DONE, generation=2)
    for old in (marker, done):
        result = triage(seen(plans=((old, 4),)))
        created = [a.plan for a in result.actions if isinstance(a, CreatePlan)]
        assert len(created) == 1 and created[0].lost_node == "b" and created[0].id != old.id, old.id
    # while the group restart a marker of this era asked for is pending, nothing else is planned for b
    assert triage(seen(plans=((dataclasses.replace(marker, generation=3), 4),))).actions == ()


def test_an_aborted_node_plan_restarts_the_group():
    plan = _plan()
    bad = Report(node="c", phase=Phase.PAUSE, ok=False, error="workers did not stop")
    result = triage(seen(plans=((plan, 9),), reports=(Report(node="a", phase=Phase.PAUSE), bad)))
    assert [type(a) for a in result.actions] == [CasPlan, RestartGroup]


# --------------------------------------------------------------------------------------------- generation
def _gen() -> Generation:
    return Generation(number=3, state=GenState.ACTIVE, world_size=4, spare_nodes=("c",), lost=("b",),
                      members=(Member("a", 0, "10.0.0.1", 2, 0), Member("b", 1, "10.0.0.2", 2, 2, role="r")))


def test_the_committed_generation_puts_the_spare_node_in_the_lost_members_place():
    plan = dataclasses.replace(_plan(), store=("10.0.0.1", 29500))
    info = NodeInfo(node_id="c", addr="10.0.0.3", nproc=2, spares=1, spare_node=True)
    new = committed_generation(_gen(), plan, info)
    assert new.number == 4 and new.swap_id == plan.id and new.bootstrap == ("10.0.0.1", 29500)
    assert new.members[1] == Member("c", 1, "10.0.0.3", 2, 2, spares=1, role="r")
    assert new.spare_nodes == () and new.lost == () and new.world_size == 4
    assert new.assignments == {"2": {"node": "c", "slot": 0}, "3": {"node": "c", "slot": 1}}
    assert homes_of(new) == ((0, "a", 0), (1, "a", 1), (2, "c", 0), (3, "c", 1))
    assert committed_generation(dataclasses.replace(_gen(), formed=2), plan, info).formed == 2   # a swap is no restart


def test_spread_ranks_leave_the_lost_member_in_place_and_marked_lost():
    plan = dataclasses.replace(_plan(), replaces=None, moves=(
        Move(SlotRef("b", 0, 2), SlotRef("a", 2, 2)), Move(SlotRef("b", 1, 3), SlotRef("c", 0, 3))))
    new = committed_generation(_gen(), plan, None)
    assert [m.node_id for m in new.members] == ["a", "b"] and new.lost == ("b",) and new.spare_nodes == ("c",)
    assert homes_of(new)[2:] == ((2, "a", 2), (3, "c", 0))


def test_donors_come_from_each_lost_ranks_declared_replica_group():
    """HSDP-like: ranks {0, 2} and {1, 3} hold the same shards; b (ranks 2, 3) is lost: rank 2's state comes from
    rank 0 only, rank 3's from rank 1 only; a rank whose whole replica group was on b cannot be recovered live."""
    hsdp = (dataclasses.replace(A[0], replicas=(0, 2)), dataclasses.replace(A[1], replicas=(1, 3)))
    d = plan_for_node_loss(view(*hsdp, *C), node="b", now_wall=NOW)
    assert d.plan is not None and [(m.rank, m.donor.rank) for m in d.plan.moves] == [(2, 0), (3, 1)]
    zero = (dataclasses.replace(A[0], replicas=(0,)), dataclasses.replace(A[1], replicas=(1,)))
    d = plan_for_node_loss(view(*zero, *C), node="b", now_wall=NOW)
    assert d.action == "fallback" and "no surviving rank holds rank 2's state" in d.reason


def test_a_spare_nodes_slots_also_serve_a_single_rank_from_any_node():
    from tpassrun.plan.swap import plan_for_failure, plan_for_taint

    live = view(*A, SlotView("b", 0, 2, "running", True, 7), SlotView("b", 1, 3, "running", True, 7), *C, lost=())
    died = plan_for_failure(live, node="a", slot=1, rank=1, reason="exit -9", now_wall=NOW, light_available=True)
    assert died.plan is not None and died.plan.joiner.node == "c" and died.plan.donor.node in ("a", "b")
    assert "c" in died.plan.nodes
    moved = plan_for_taint(live, node="b", rank=3, reason="ecc", taint_id="t1", now_wall=NOW)
    assert moved.plan is not None and moved.plan.joiner.node == "c"


def test_a_node_holding_only_the_leaver_lost_while_the_world_re_forms_is_left_out_of_it():
    """b ran one rank, tainted and migrated to c: b is lost once its leaver left, while the world re-forms. It holds
    no rank of the new world: the plan goes on without it (before, nobody was left to ask for the restart)."""
    homes = ((0, "a", 0), (1, "a", 1), (2, "b", 0))
    v = ClusterView(generation=3, members=("a", "b"), spare_nodes=("c",), slots=(*A, C[0], C[1]), lost=("b",),
                    homes=homes)
    plan = SwapPlan(id="s-2", kind=SwapKind.PLANNED, generation=3, leaver=SlotRef("b", 0, 2),
                    joiner=SlotRef("c", 0, 2), donor=None, phase=Phase.REFORM, reason="ecc", nodes=("a", "b", "c"),
                    history=(("pause", NOW - 3), ("reform", NOW - 1)))
    result = triage(seen(plans=((plan, 9),), view=v))
    assert [type(a) for a in result.actions] == [CasPlan, Say], result.actions
    new = result.actions[0].new
    assert new.phase == Phase.REFORM and new.nodes == ("a", "c") and not new.superseded
    assert result.actions[1].event == "swap_node_dropped" and "re-forms without it" in result.actions[1].fields["reason"]
    # then the re-form completes with a's and c's reports alone
    reports = tuple(Report(node=n, phase=Phase.REFORM) for n in ("a", "c"))
    result = triage(seen(plans=((new, 10),), view=v, reports=reports))
    assert [type(a) for a in result.actions] == [CasPlan] and result.actions[0].new.phase == Phase.DONE


@pytest.mark.timeout(60)
def test_a_node_loss_in_a_2048_node_job_is_planned_in_linear_time():
    """Issue 43's simulated cluster: the donor choice was ``min(holders, key=... holders.index(s))``, a scan of every
    holder per holder (16,384 ranks: 268 million slot comparisons per lost rank; 64 nodes took 2.5 s of the leader's
    CPU, 1,024 nodes 5 minutes). The same rule (least used holder first, then the interleaved order) by position."""
    n = 2048
    slots = [SlotView(f"n{i:04d}", s, i * 8 + s, "running", True, 7) for i in range(n) for s in range(8)]
    spare = tuple(SlotView("spare", s, None, "spare", True) for s in range(8))
    homes = tuple((i * 8 + s, f"n{i:04d}", s) for i in range(n) for s in range(8))
    members = tuple(f"n{i:04d}" for i in range(n))
    lost = "n1000"
    v = ClusterView(generation=3, members=members, spare_nodes=("spare",), lost=(lost,), homes=homes,
                    slots=tuple(s for s in slots if s.node != lost) + spare)
    d = plan_for_node_loss(v, node=lost, now_wall=NOW)
    assert d.action == "plan" and d.plan is not None
    assert [m.rank for m in d.plan.moves] == list(range(8000, 8008))
    assert [m.donor.node for m in d.plan.moves] == ["n0000", "n0001", "n0002", "n0003", "n0004", "n0005", "n0006",
                                                    "n0007"]     # one per node in turn, the least used first
