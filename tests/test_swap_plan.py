"""The swap planner (tpassrun/plan/swap.py) as pure functions of (view, reports, now): no network, no processes."""

from __future__ import annotations

import pytest

from tpassrun.plan.swap import (
    ClusterView,
    Phase,
    Report,
    SlotView,
    SwapKind,
    SwapPlan,
    choose_donor,
    choose_spare,
    next_step,
    plan_for_failure,
    plan_for_taint,
)

NOW = 1000.0


def view(*slots: SlotView, members=("a", "b"), spare_nodes=()) -> ClusterView:
    return ClusterView(generation=3, members=members, spare_nodes=spare_nodes, slots=slots)


def run(node, slot, rank, managed=True, state="running"):
    return SlotView(node=node, slot=slot, rank=rank, state=state, managed=managed)


def spare(node, slot, managed=True):
    return SlotView(node=node, slot=slot, rank=None, state="spare", managed=managed)


TWO_NODES = view(run("a", 0, 0), run("a", 1, 1), run("b", 0, 2), run("b", 1, 3), spare("b", 2), spare("a", 2))


def test_taint_plans_a_migration_to_a_spare_on_the_same_node_first():
    d = plan_for_taint(TWO_NODES, node="a", rank=1, reason="ecc", taint_id="t1", now_wall=NOW)
    assert d.action == "plan" and d.plan is not None
    p = d.plan
    assert (p.kind, p.phase, p.leaver.slot, p.joiner.node, p.joiner.slot) == (SwapKind.PLANNED, Phase.PAUSE, 1, "a", 2)
    assert p.taint_id == "t1" and p.history == ((Phase.PAUSE.value, NOW),)


@pytest.mark.parametrize("v,rank,action,says", [
    (TWO_NODES, 9, "reject", "not running"),
    (view(run("a", 0, 0, managed=False), spare("a", 1)), 0, "fallback", "tpassrun.init"),
    (view(run("a", 0, 0), run("a", 1, 1)), 1, "wait", "no spare"),
    (view(run("a", 0, 0), run("a", 1, 1), spare("a", 2, managed=False)), 1, "wait", "still starting"),
])
def test_taint_without_a_live_swap(v, rank, action, says):
    d = plan_for_taint(v, node="a", rank=rank, reason="x", taint_id=None, now_wall=NOW)
    assert d.action == action and says in d.reason and d.plan is None


def test_spare_choice_prefers_same_node_then_members_then_spare_nodes_and_ready_spares():
    v = view(spare("c", 0), spare("b", 5, managed=False), spare("b", 4), members=("a", "b"), spare_nodes=("c",))
    assert (choose_spare(v, "a").node, choose_spare(v, "a").slot) == ("b", 4)
    assert choose_spare(v, "a", excluded=[("b", 4), ("b", 5)]).node == "c"
    # a spare still starting on the same node (back in the pool after a swap) loses to a ready one elsewhere
    cold = view(spare("a", 2, managed=False), spare("c", 0), spare("b", 4), members=("a", "b"), spare_nodes=("c",))
    assert (choose_spare(cold, "a").node, choose_spare(cold, "a").slot) == ("b", 4)
    assert choose_spare(cold, "a", excluded=[("b", 4), ("c", 0)]).node == "a"


def test_failure_plans_a_recovery_from_a_replica_near_the_spare():
    d = plan_for_failure(TWO_NODES, node="b", slot=1, rank=3, reason="exit -9", now_wall=NOW, light_available=True)
    assert d.action == "plan" and d.plan.kind == SwapKind.UNPLANNED
    assert (d.plan.joiner.node, d.plan.donor.node, d.plan.donor.rank) == ("b", "b", 2)
    assert choose_donor(TWO_NODES, 0, "a").rank == 1


@pytest.mark.parametrize("v,light,says", [
    (view(run("a", 0, 0), run("a", 1, 1)), True, "no spare"),
    (view(run("a", 0, 0, managed=False), run("a", 1, 1), spare("a", 2)), True, "no live replica"),
])
def test_failure_falls_back_to_a_group_restart(v, light, says):
    d = plan_for_failure(v, node="a", slot=1, rank=1, reason="x", now_wall=NOW, light_available=light)
    assert d.action == "fallback" and says in d.reason


def test_a_declared_replica_group_picks_the_donor():
    """HSDP 2 x 2 over ranks 0-3 (replicas 0/2 and 1/3): rank 3's state is on rank 1 only, wherever the spare is;
    a rank alone in its group (pure FSDP, ZeRO >= 1) or whose replicas are all gone falls back, saying why."""
    d = plan_for_failure(TWO_NODES, node="b", slot=1, rank=3, reason="x", now_wall=NOW, light_available=True,
                         replicas=(1, 3))
    assert d.action == "plan" and d.plan.donor.rank == 1 and d.plan.joiner.node == "b"
    assert choose_donor(TWO_NODES, 3, "b", replicas=(1, 3)).rank == 1
    alone = plan_for_failure(TWO_NODES, node="b", slot=1, rank=3, reason="x", now_wall=NOW, light_available=True,
                             replicas=(3,), alone="FSDP shards it over dp_shard without dp_replicate")
    assert alone.action == "fallback" and alone.plan is None
    assert alone.reason == ("rank 3 died and no other rank holds its state: FSDP shards it over dp_shard without "
                            "dp_replicate: whole-group restart")
    gone = view(run("a", 0, 0), run("a", 1, 1, state="dead"), run("b", 0, 2), spare("b", 2))
    d = plan_for_failure(gone, node="b", slot=1, rank=3, reason="x", now_wall=NOW, light_available=True,
                         replicas=(1, 3))
    assert d.action == "fallback" and "none of the ranks holding its state (1) is running" in d.reason


def _plan(kind=SwapKind.PLANNED, phase=Phase.PAUSE, **kw) -> SwapPlan:
    base = plan_for_taint(TWO_NODES, node="a", rank=1, reason="x", taint_id=None, now_wall=NOW).plan
    if kind == SwapKind.UNPLANNED:
        base = plan_for_failure(TWO_NODES, node="a", slot=1, rank=1, reason="x", now_wall=NOW,
                                light_available=True).plan
    import dataclasses
    return dataclasses.replace(base, phase=phase, **kw)


def test_pause_picks_the_latest_candidate_as_boundary_and_a_late_rank_moves_it():
    p = _plan()
    d = next_step(p, [Report("a", Phase.PAUSE, candidate=7), Report("b", Phase.PAUSE, candidate=8)], NOW)
    assert d.plan.phase == Phase.BOUNDARY and d.plan.boundary == 8
    d2 = next_step(d.plan, [Report("a", Phase.BOUNDARY, candidate=9), Report("b", Phase.BOUNDARY, candidate=8)], NOW)
    assert d2.plan.phase == Phase.BOUNDARY and d2.plan.boundary == 9
    d3 = next_step(d2.plan, [Report("a", Phase.BOUNDARY, candidate=9), Report("b", Phase.BOUNDARY, candidate=9)], NOW)
    assert d3.plan.phase == Phase.TRANSFER


def test_waits_for_every_node_of_the_phase():
    d = next_step(_plan(), [Report("a", Phase.PAUSE, candidate=7)], NOW)
    assert d.action == "wait" and "b" in d.reason


def test_unplanned_survivors_at_different_steps_abort_to_a_restart():
    p = _plan(SwapKind.UNPLANNED)
    d = next_step(p, [Report("a", Phase.PAUSE, steps=(5,)), Report("b", Phase.PAUSE, failed_steps=(6,))], NOW)
    assert d.plan.phase == Phase.ABORTED and "different steps" in d.reason
    same = next_step(p, [Report("a", Phase.PAUSE, steps=(5,)), Report("b", Phase.PAUSE, failed_steps=(5,))], NOW)
    assert same.plan.phase == Phase.TRANSFER and same.plan.boundary == 5


def test_a_failed_transfer_is_retried_then_given_up():
    p = _plan(phase=Phase.SEND, joiner_addr=("h", 1))
    bad = [Report("a", Phase.SEND, ok=False, error="checksum mismatch")]
    d = next_step(p, bad, NOW)
    assert d.plan.phase == Phase.TRANSFER and d.plan.attempt == 1 and d.plan.joiner == p.joiner
    other = next_step(p, bad, NOW, spare_after_failure=spare("b", 2))
    assert other.plan.joiner.node == "b" and ("a", 2) in other.plan.excluded_spares
    import dataclasses
    last = next_step(dataclasses.replace(p, attempt=3), bad, NOW)
    assert last.plan.phase == Phase.ABORTED and "giving up" in last.reason


def test_a_retry_onto_a_spare_node_re_forms_that_node_too():
    """A joiner died and the retry went to a spare on a spare node that ran no rank, so it was not among the
    plan's nodes: its spare never got its Reform, the world waited for it until the phase timeout, and the group
    restarted 120 s later (bench/chaos.py). The retry adds the new joiner's node to the plan's nodes."""
    p = _plan(phase=Phase.SEND, joiner_addr=("h", 1))
    assert "c" not in p.nodes
    bad = [Report("a", Phase.SEND, ok=False, error="the joiner died")]
    retry = next_step(p, bad, NOW, spare_after_failure=spare("c", 0))
    assert retry.plan.joiner.node == "c" and "c" in retry.plan.nodes


@pytest.mark.parametrize("phase", [Phase.TRANSFER, Phase.SEND])
def test_a_leaver_that_died_aborts_at_once_whatever_was_reported(phase):
    p = _plan(SwapKind.PLANNED, phase=phase)
    d = next_step(p, [], NOW, sender_dead=True)
    assert d.plan.phase == Phase.ABORTED and "died while handing over" in d.reason


@pytest.mark.parametrize("phase", [Phase.TRANSFER, Phase.SEND])
def test_a_donor_that_died_waits_for_its_failure_to_supersede_the_recovery(phase):
    p = _plan(SwapKind.UNPLANNED, phase=phase)
    bad = [Report("a", phase, ok=False, error="the stream broke")]
    d = next_step(p, bad, NOW, sender_dead=True)
    assert d.plan is None and "planned again" in d.reason    # neither aborted into a restart nor retried with it


def test_a_joiner_that_died_with_no_spare_left_is_given_up_not_retried():
    p = _plan(phase=Phase.SEND)
    bad = [Report("a", Phase.SEND, ok=False, error="the joiner died or timed out during the transfer")]
    d = next_step(p, bad, NOW, joiner_gone=True)
    assert d.plan.phase == Phase.ABORTED and "no other spare" in d.reason


def test_the_happy_path_ends_done():
    p = _plan(phase=Phase.TRANSFER)
    d = next_step(p, [Report("a", Phase.TRANSFER, joiner_addr=("h", 5))], NOW)
    assert d.plan.phase == Phase.SEND and d.plan.joiner_addr == ("h", 5)
    d = next_step(d.plan, [Report("a", Phase.SEND)], NOW)
    assert d.plan.phase == Phase.REFORM
    d = next_step(d.plan, [Report("a", Phase.REFORM), Report("b", Phase.REFORM)], NOW)
    assert d.plan.phase == Phase.DONE
    assert next_step(d.plan, [], NOW).action == "wait"


def test_plans_round_trip_through_json_and_refuse_bad_transitions():
    p = _plan(SwapKind.UNPLANNED, phase=Phase.SEND, joiner_addr=("h", 5), boundary=4)
    assert SwapPlan.from_json(p.to_json()) == p
    with pytest.raises(ValueError):
        p.advance(Phase.PAUSE, NOW)


def test_a_spare_node_that_runs_a_rank_is_paused_and_re_formed_by_every_later_plan():
    """A taint storm moved rank 3 to the spare node c; the next swap (rank 1, to a spare on a) named only the
    members and the joiner's node, so rank 3 kept stepping into a collective nobody else joined and the world
    never re-formed (bench/chaos.py taint_storm: stuck in REFORM). Every plan kind now names c."""
    from tpassrun.plan.multiloss import plan_for_losses
    from tpassrun.plan.swap import plan_for_dead_ranks, plan_for_node_loss

    v = ClusterView(generation=3, members=("a", "b"), spare_nodes=("c",), lost=(),
                    slots=(run("a", 0, 0), run("a", 1, 1), spare("a", 2), run("b", 0, 2), spare("b", 1),
                           spare("b", 2), run("c", 0, 3), spare("c", 1)))
    taint = plan_for_taint(v, node="a", rank=1, reason="x", taint_id="t", now_wall=NOW).plan
    assert taint.joiner.node == "a" and set(taint.nodes) == {"a", "b", "c"}
    dead = plan_for_failure(v, node="a", slot=1, rank=1, reason="x", now_wall=NOW, light_available=True).plan
    assert set(dead.nodes) == {"a", "b", "c"}
    many = plan_for_dead_ranks(v, [("a", 1, 1), ("b", 0, 2)], reason="x", now_wall=NOW, swap_id="m").plan
    assert set(many.nodes) == {"a", "b", "c"}
    gone = ClusterView(generation=3, members=("a", "b"), spare_nodes=("c",), lost=("b",),
                       slots=(run("a", 0, 0), run("a", 1, 1), spare("a", 2), run("c", 0, 3), spare("c", 1),
                              spare("c", 2)), homes=((0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1)))
    node = plan_for_node_loss(gone, node="b", now_wall=NOW).plan
    assert set(node.nodes) == {"a", "c"}
    losses = plan_for_losses(gone, ["b"], [("a", 1, 1)], now_wall=NOW, swap_id="l").plan
    assert losses is not None and set(losses.nodes) == {"a", "c"}
