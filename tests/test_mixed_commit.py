"""A mixed commit in a single rank's recovery, decided purely (tpassrun/plan/catchup.py mixed_commit, tpassrun/plan/resume.py,
tpassrun/plan/swap.py): survivors that stopped one transaction apart are put at one step, those not there first taking
its replicated state from one that is; going back is preferred (nothing the script does is skipped), going forward
when the dead rank kept no state of the step's start; without word from every survivor, or a survivor standing at
the step by itself, the recovery aborts as before, saying why."""

from __future__ import annotations

import dataclasses

import pytest

from tpassrun.plan.catchup import mixed_commit
from tpassrun.plan.swap import ClusterView, Phase, Report, SlotView, next_step, plan_for_failure, resume_plan
from tpassrun.records import Move, SlotRef

NOW = 1000.0
# rank 1 (a/1) died; rank 0 on a, rank 2 on b survive; the spare is b/1
VIEW = ClusterView(generation=0, members=("a", "b"), spare_nodes=(),
                   slots=(SlotView("a", 0, 0, "running", True), SlotView("a", 1, 1, "dead", True),
                          SlotView("b", 0, 2, "running", True), SlotView("b", 1, None, "spare", True)))


def _plan(phase=Phase.PAUSE, **kw):
    plan = plan_for_failure(VIEW, node="a", slot=1, rank=1, reason="exit -9", now_wall=NOW,
                            light_available=True, swap_id="u-1").plan
    return dataclasses.replace(plan, phase=phase, secret="00" * 16, **kw)


def mixed(dead=(9, 8)):
    """Rank 0 committed step 8 and failed in step 9 (it kept step 8's start: back 8); rank 2 failed inside step 8's
    all-reduce before committing it (sealed: it can catch up to 9)."""
    return [Report("a", Phase.PAUSE, failed_steps=(9,), dead_steps=dead, stops={0: (0, 9, False)}, backs={0: 8}),
            Report("b", Phase.PAUSE, failed_steps=(8,), stops={2: (0, 8, True)}, backs={2: 7})]


def test_the_survivors_that_went_ahead_go_back_with_the_state_of_one_that_did_not():
    choice = resume_plan(mixed(), 1)
    assert choice.step == 8 and "mixed commit" in choice.why and "go back" in choice.why
    assert choice.catch_up == (Move(SlotRef("a", 0, 0), SlotRef("a", 0, 0), SlotRef("b", 0, 2)),)
    assert choice.donor == SlotRef("b", 0, 2)          # the joiner's state: from a rank standing at step 8


def test_the_plan_moves_them_and_the_joiner_takes_a_donor_standing_at_the_step():
    d = next_step(_plan(), mixed(), NOW)
    plan = d.plan
    assert plan.phase == Phase.TRANSFER and plan.boundary == 8, d.reason
    assert plan.donor == SlotRef("b", 0, 2) and [m.rank for m in plan.catch_up] == [0]
    assert type(plan).from_json(plan.to_json()) == plan
    # TRANSFER: the moved survivor's node reports too; its address goes into the plan
    assert next_step(plan, [Report("b", Phase.TRANSFER, joiner_addr=("hb", 5))], NOW).action == "wait"
    silent = [Report("a", Phase.TRANSFER, light_b64="AAAA"), Report("b", Phase.TRANSFER, joiner_addr=("hb", 5))]
    assert next_step(plan, silent, NOW).plan.phase == Phase.ABORTED
    reports = [Report("a", Phase.TRANSFER, light_b64="AAAA", joiner_addrs={0: ("ha", 7)}),
               Report("b", Phase.TRANSFER, joiner_addr=("hb", 5))]
    send = next_step(plan, reports, NOW).plan
    assert send.phase == Phase.SEND and send.catch_up[0].joiner_addr == ("ha", 7)
    # SEND: done once the joiner and every moved survivor confirmed
    assert next_step(send, [Report("b", Phase.SEND)], NOW).action == "wait"
    assert next_step(send, [Report("b", Phase.SEND), Report("a", Phase.SEND)], NOW).plan.phase == Phase.REFORM


def test_forward_when_the_dead_rank_kept_nothing_of_the_steps_start():
    choice = resume_plan(mixed(dead=(10, 9)), 1)
    assert choice.step == 9 and "catch up" in choice.why
    assert choice.catch_up == (Move(SlotRef("b", 0, 2), SlotRef("b", 0, 2), SlotRef("a", 0, 0)),)
    assert choice.donor == SlotRef("a", 0, 0)


def test_forward_when_a_leader_kept_no_snapshot_of_the_steps_start():
    reports = mixed()
    reports[0] = dataclasses.replace(reports[0], backs={})
    assert resume_plan(reports, 1).step == 9


def test_a_survivor_failed_after_its_commit_point_goes_back_with_one_that_had_not_committed():
    """A barrier between opt.step() and sched.step(): one survivor failed in it (nothing to offer: the step can be
    neither finished nor undone by itself), the other had not committed the step."""
    reports = [Report("a", Phase.PAUSE, post_commit=(8,), dead_steps=(9, 8), stops={0: (0, -1, False)}, backs={0: 8}),
               Report("b", Phase.PAUSE, failed_steps=(8,), stops={2: (0, 8, True)})]
    choice = resume_plan(reports, 1)
    assert choice.step == 8 and [m.rank for m in choice.catch_up] == [0]


@pytest.mark.parametrize("reports,says", [
    # nobody completed the step's changes, nobody stands before them: neither finished nor undone
    ([Report("a", Phase.PAUSE, post_commit=(8,), dead_steps=(9, 8), stops={0: (0, -1, False)}, backs={0: 8}),
      Report("b", Phase.PAUSE, post_commit=(8,), stops={2: (0, -1, False)}, backs={2: 8})], "after their optimizer"),
    # a survivor said nothing more (its adapter declared its replica group): no catch-up
    ([Report("a", Phase.PAUSE, failed_steps=(9,), dead_steps=(9, 8), stops={0: (0, 9, False)}, backs={0: 8}),
      Report("b", Phase.PAUSE, failed_steps=(8,))], "mixed commit"),
    # the dead rank kept neither step
    (mixed(dead=(7, 6)), "mixed commit"),
])
def test_no_exact_step_still_aborts_and_says_why(reports, says):
    choice = resume_plan(reports, 1)
    assert choice.step is None and says in choice.why and not choice.catch_up
    d = next_step(_plan(), reports, NOW)
    assert d.plan.phase == Phase.ABORTED and says in d.plan.outcome


def test_mixed_commit_takes_any_rule_for_the_dead_ranks_state():
    """A node plan asks its own question about the dead ranks' copies (the buddy's mirror)."""
    assert mixed_commit(mixed(), lambda v: v == 9).step == 9
    assert mixed_commit(mixed(), lambda v: False).step is None
    assert Report.from_json(mixed()[0].to_json()) == mixed()[0]


# TP=2 x DP=2 (megatron-core's order): ranks 0, 1 are the tensor-parallel pair of replica 0, ranks 2, 3 of replica 1;
# each rank's replicas are the ranks with its TP coordinate in the other replica: {0, 2} and {1, 3}
TP_DP = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}


def tp_dp(stops_a, stops_b, dead=(9, 8), backs_a=None, backs_b=None):
    """Node a runs ranks 0 and 1 (rank 1 died), node b ranks 2 and 3."""
    def report(node, stops, backs, **kw):
        failed = tuple(offer for _slot, offer, _can in stops.values())
        return Report(node, Phase.PAUSE, failed_steps=failed, stops=stops, backs=backs or {},
                      replicas={r: TP_DP[r] for r in stops}, **kw)
    return [report("a", stops_a, backs_a, dead_steps=dead), report("b", stops_b, backs_b)]


def test_tp_dp_the_replica_of_a_dead_tensor_parallel_rank_cannot_go_back_so_everyone_goes_forward():
    """Rank 1 died after its part of the data-parallel all-reduce (its seal of step 9 written in the backward pass):
    rank 3 completed that all-reduce and, with rank 2, step 8; rank 0 failed in the grad-norm all-reduce with rank
    1, before its commit point ("survivors stopped at different steps [8, 9]": a restart until now). Rank 3's only
    replica is rank 1: it cannot go back to step 8. Forward: rank 0 catches up from rank 2 (its replica), the
    joiner takes rank 1's state from rank 3 (its replica) and its seal of step 9."""
    reports = tp_dp({0: (0, 8, True)}, {2: (0, 9, False), 3: (1, 9, False)}, backs_b={2: 8, 3: 8})
    choice = resume_plan(reports, 1)
    assert choice.step == 9 and "catch up" in choice.why, choice.why
    assert choice.catch_up == (Move(SlotRef("a", 0, 0), SlotRef("a", 0, 0), SlotRef("b", 0, 2)),)
    assert choice.donor == SlotRef("b", 1, 3)
    assert Report.from_json(reports[0].to_json()) == reports[0]


def test_tp_dp_going_back_takes_each_survivors_state_from_its_own_replica():
    """Rank 0 committed step 8 (its peers did not); the others stand at 8: it goes back with rank 2's state (its
    replica, not rank 3's: another tensor-parallel shard), and the joiner for rank 1 takes rank 3's."""
    reports = tp_dp({0: (0, 9, False)}, {2: (0, 8, True), 3: (1, 8, True)}, backs_a={0: 8})
    choice = resume_plan(reports, 1)
    assert choice.step == 8 and "go back" in choice.why, choice.why
    assert choice.catch_up == (Move(SlotRef("a", 0, 0), SlotRef("a", 0, 0), SlotRef("b", 0, 2)),)
    assert choice.donor == SlotRef("b", 1, 3)


def test_tp_dp_no_step_where_every_survivor_and_the_dead_rank_have_a_replica_still_aborts():
    """Rank 0 failed inside step 8 without a seal of 9 (it cannot catch up) and rank 3's only replica is dead (it
    cannot go back): nowhere exact, the recovery aborts saying so."""
    reports = tp_dp({0: (0, 8, False)}, {2: (0, 9, False), 3: (1, 9, False)}, backs_b={2: 8, 3: 8})
    choice = resume_plan(reports, 1)
    assert choice.step is None and "mixed commit" in choice.why
