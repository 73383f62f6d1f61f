"""The unplanned recovery's resume step (pure): a step is a transaction that commits at the tracked optimizers'
step; survivors and the dead rank's saved snapshots must agree on one step, or the plan aborts and says why."""

from __future__ import annotations

import dataclasses

import pytest

from tpassrun.plan.swap import ClusterView, Phase, Report, SlotView, next_step, plan_for_failure, resume_step

NOW = 1000.0
VIEW = ClusterView(generation=0, members=("a", "b"), spare_nodes=(),
                   slots=(SlotView("a", 0, 0, "running", True), SlotView("a", 1, 1, "dead", True),
                          SlotView("b", 0, 2, "running", True), SlotView("b", 1, None, "spare", True)))


def _unplanned(phase=Phase.PAUSE, **kw):
    plan = plan_for_failure(VIEW, node="a", slot=1, rank=1, reason="exit -9", now_wall=NOW,
                            light_available=True).plan
    return dataclasses.replace(plan, phase=phase, **kw)


@pytest.mark.parametrize("where,reports,step", [
    # died in forward/backward of step 7: survivors fail in step 7's all-reduce (or pause before it)
    ("in backward", [Report("a", Phase.PAUSE, failed_steps=(7,), dead_steps=(7, 6)),
                     Report("b", Phase.PAUSE, steps=(7,))], 7),
    # died inside or right after the optimizer step, in user code after it, or loading the next batch:
    # the survivors finished step 7; the dead rank's commit-point snapshot is labelled 8
    ("after commit", [Report("a", Phase.PAUSE, steps=(8,), dead_steps=(8, 7)),
                      Report("b", Phase.PAUSE, failed_steps=(8,))], 8),
    # died between steps / at the next step's start: both of its buffers say 8 (commit point and step start)
    ("between steps", [Report("a", Phase.PAUSE, failed_steps=(8,), dead_steps=(8, 7)),
                       Report("b", Phase.PAUSE, failed_steps=(8,))], 8),
    # a collective that only the dead rank completed: it committed, the survivors did not -> its older buffer
    ("only the dead one committed", [Report("a", Phase.PAUSE, failed_steps=(7,), dead_steps=(8, 7)),
                                     Report("b", Phase.PAUSE, failed_steps=(7,))], 7),
    # died before its first snapshot: the joiner's own script builds the per-rank state of step 0
    ("before the first step", [Report("a", Phase.PAUSE, failed_steps=(0,), dead_steps=()),
                               Report("b", Phase.PAUSE, failed_steps=(0,))], 0),
    # a gradient-accumulation window 6..8 open: every survivor offers its start, the dead rank kept it
    ("inside a window", [Report("a", Phase.PAUSE, steps=(6,), dead_steps=(9, 6)),
                         Report("b", Phase.PAUSE, failed_steps=(6,))], 6),
    # survivors failed in a logging all-reduce after a complete step 7: they offer 8, like one paused at 8
    ("after a complete commit", [Report("a", Phase.PAUSE, failed_steps=(8,), dead_steps=(8, 7)),
                                 Report("b", Phase.PAUSE, steps=(8,), failed_steps=(8,))], 8),
])
def test_survivors_and_the_dead_ranks_snapshot_agree_on_the_resume_step(where, reports, step):
    assert resume_step(reports, 1)[0] == step, where
    d = next_step(_unplanned(), reports, NOW)
    assert d.plan.phase == Phase.TRANSFER and d.plan.boundary == step, (where, d.reason)


@pytest.mark.parametrize("reports,says", [
    ([Report("a", Phase.PAUSE, steps=(8,), dead_steps=(8, 7)), Report("b", Phase.PAUSE, failed_steps=(7,))],
     "mixed commit"),
    ([Report("a", Phase.PAUSE, steps=(8,), dead_steps=(7, 6)), Report("b", Phase.PAUSE, steps=(8,))],
     "after the survivors had completed it"),
    ([Report("a", Phase.PAUSE, post_commit=(7,), dead_steps=(8, 7)), Report("b", Phase.PAUSE, post_commit=(7,))],
     "after their optimizer step"),
    ([Report("a", Phase.PAUSE, steps=(8,), dead_steps=()), Report("b", Phase.PAUSE, steps=(8,))],
     "saved state for steps []"),
])
def test_no_exact_resume_step_aborts_at_once_and_says_why(reports, says):
    step, why = resume_step(reports, 1)
    assert step is None and says in why
    d = next_step(_unplanned(), reports, NOW)
    assert d.plan.phase == Phase.ABORTED and says in d.plan.outcome
    assert Report.from_json(reports[0].to_json()) == reports[0]
    assert type(d.plan).from_json(d.plan.to_json()).outcome == d.plan.outcome


def test_a_deterministic_rejection_is_not_retried():
    plan = _unplanned(Phase.SEND, boundary=8, joiner_addr=("h", 1))
    retry = next_step(plan, [Report("b", Phase.SEND, ok=False, error="crc mismatch")], NOW)
    assert retry.plan.phase == Phase.TRANSFER and retry.plan.attempt == 1
    final = next_step(plan, [Report("b", Phase.SEND, ok=False, final=True, error="rejected the snapshot")], NOW)
    assert final.plan.phase == Phase.ABORTED and final.plan.outcome == "rejected the snapshot"


def test_a_dead_rank_without_a_snapshot_is_planned_and_step_zero_needs_none():
    d = plan_for_failure(VIEW, node="a", slot=1, rank=1, reason="x", now_wall=NOW, light_available=False)
    assert d.action == "plan"
    transfer = _unplanned(Phase.TRANSFER, boundary=0)
    go = next_step(transfer, [Report("a", Phase.TRANSFER), Report("b", Phase.TRANSFER, joiner_addr=("h", 1))], NOW)
    assert go.plan.phase == Phase.SEND
    later = dataclasses.replace(transfer, boundary=5)
    stop = next_step(later, [Report("a", Phase.TRANSFER), Report("b", Phase.TRANSFER, joiner_addr=("h", 1))], NOW)
    assert stop.plan.phase == Phase.ABORTED and "step 5" in stop.plan.outcome
