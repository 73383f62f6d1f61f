"""Where an unplanned recovery of a job with sharded state resumes, and where the dead rank's shard comes from
(pure: :func:`tpassrun.plan.swap.resume_plan` and the plan it leads to). The dead rank's buddy mirrors its shard at the
steps it refreshed; every rank keeps local copies of its whole state at the same steps."""

from __future__ import annotations

import dataclasses

import pytest

from tpassrun.plan.swap import ClusterView, Phase, Report, SlotView, next_step, plan_for_failure, resume_plan
from tpassrun.records import SwapPlan

NOW = 1000.0
VIEW = ClusterView(generation=0, members=("a", "b"), spare_nodes=(),
                   slots=(SlotView("a", 0, 0, "running", True), SlotView("a", 1, 1, "dead", True),
                          SlotView("b", 0, 2, "running", True), SlotView("b", 1, None, "spare", True)))
MIRROR = ("10.0.0.2", 4000)


def _unplanned(**kw) -> SwapPlan:
    plan = plan_for_failure(VIEW, node="a", slot=1, rank=1, reason="exit -9", now_wall=NOW, light_available=True).plan
    return dataclasses.replace(plan, **kw)


def _mirror(*steps: int) -> dict:
    return {"mirror_steps": steps, "mirror_addr": MIRROR}


def test_the_failed_steps_shard_in_the_mirror_resumes_there_with_no_rollback_of_the_model():
    reports = [Report("a", Phase.PAUSE, failed_steps=(7,), dead_steps=(7, 6), rings=(6, 7), dead_ring=(6, 7)),
               Report("b", Phase.PAUSE, steps=(7,), rings=(6, 7), **_mirror(6, 7))]
    choice = resume_plan(reports, 1)
    assert (choice.step, choice.restore, choice.shard_from, choice.shard_node) == (7, False, MIRROR, "b")
    plan = next_step(_unplanned(), reports, NOW).plan
    assert plan.phase == Phase.TRANSFER and plan.boundary == 7 and not plan.restore and plan.shard_from == MIRROR


@pytest.mark.parametrize("where,reports,step", [
    # died after its optimizer step: the survivors finished step 7, its own state of step 8 was never copied
    ("after commit", [Report("a", Phase.PAUSE, steps=(8,), dead_steps=(8, 7), rings=(6, 7), dead_ring=(6, 7)),
                      Report("b", Phase.PAUSE, failed_steps=(8,), rings=(7, 8), **_mirror(6, 7))], 7),
    # ZeRO: survivors failed in the all-gather after their optimizer step (post-commit): roll their shards back
    ("post commit", [Report("a", Phase.PAUSE, post_commit=(7,), dead_steps=(7, 6), rings=(6, 7), dead_ring=(6, 7)),
                     Report("b", Phase.PAUSE, post_commit=(7,), rings=(6, 7), **_mirror(6, 7))], 7),
    # a mixed commit: one survivor finished the step, the other failed in it
    ("mixed", [Report("a", Phase.PAUSE, steps=(8,), dead_steps=(7, 6), rings=(6, 7), dead_ring=(6, 7)),
               Report("b", Phase.PAUSE, failed_steps=(7,), rings=(6, 7), **_mirror(6, 7))], 7),
    # died before its refresh of step 7 had landed: the newest mirrored step is 6, everyone goes back there
    ("refresh in flight", [Report("a", Phase.PAUSE, failed_steps=(7,), dead_steps=(7, 6), rings=(6, 7),
                                  dead_ring=(6,)),
                           Report("b", Phase.PAUSE, failed_steps=(7,), rings=(6, 7), **_mirror(5, 6))], 6),
    # --shard-mirror-interval 4: the last refresh was step 4; steps 4..6 are recomputed
    ("interval 4", [Report("a", Phase.PAUSE, failed_steps=(6,), dead_steps=(6, 5), rings=(0, 4), dead_ring=(0, 4)),
                    Report("b", Phase.PAUSE, failed_steps=(6,), rings=(0, 4), **_mirror(0, 4))], 4),
])
def test_otherwise_every_rank_rolls_back_to_the_newest_step_all_copies_share(where, reports, step):
    choice = resume_plan(reports, 1)
    assert (choice.step, choice.restore, choice.shard_from) == (step, True, MIRROR), (where, choice.why)
    plan = next_step(_unplanned(), reports, NOW).plan
    assert plan.phase == Phase.TRANSFER and plan.boundary == step and plan.restore, where
    assert "rolls back to its copy of step" in choice.why


@pytest.mark.parametrize("reports,says", [
    ([Report("a", Phase.PAUSE, failed_steps=(7,), dead_steps=(7, 6), rings=(6, 7), dead_ring=(6, 7)),
      Report("b", Phase.PAUSE, steps=(7,), rings=(6, 7))], "no mirror holds a copy"),
    ([Report("a", Phase.PAUSE, steps=(9,), dead_steps=(9, 8), rings=(8, 9), dead_ring=(8, 9)),
      Report("b", Phase.PAUSE, steps=(9,), rings=(8, 9), **_mirror(5, 6))], "no step is held both"),
])
def test_without_a_shared_copy_the_recovery_aborts_and_says_which_copy_is_missing(reports, says):
    choice = resume_plan(reports, 1)
    assert choice.step is None and says in choice.why, choice.why
    plan = next_step(_unplanned(), reports, NOW).plan
    assert plan.phase == Phase.ABORTED and says in plan.outcome


def test_a_job_without_sharded_state_plans_as_before():
    reports = [Report("a", Phase.PAUSE, failed_steps=(7,), dead_steps=(7, 6)), Report("b", Phase.PAUSE, steps=(7,))]
    choice = resume_plan(reports, 1)
    assert (choice.step, choice.restore, choice.shard_from) == (7, False, None)


def test_a_rollback_waits_for_every_node_to_roll_back_before_the_donor_sends():
    plan = _unplanned(phase=Phase.TRANSFER, boundary=6, restore=True, shard_from=MIRROR, shard_node="b")
    joiner = Report("b", Phase.TRANSFER, joiner_addr=("10.0.0.2", 5000))
    assert next_step(plan, [joiner], NOW).action == "wait"
    # the mirror carries the dead rank's light snapshot: none from its node is fine
    d = next_step(plan, [joiner, Report("a", Phase.TRANSFER)], NOW)
    assert d.plan.phase == Phase.SEND, d.reason


def test_the_plan_round_trips_through_etcd_json():
    plan = _unplanned(boundary=6, restore=True, shard_from=MIRROR, shard_node="b")
    assert SwapPlan.from_json(plan.to_json()) == plan
    r = Report("b", Phase.PAUSE, steps=(7,), rings=(6, 7), dead_ring=(5,), **_mirror(6, 7))
    assert Report.from_json(r.to_json()) == r


# --- HSDP: a live declared replica holds the dead rank's shards (tracked as sharded: local copies, no mirror) ---
# ranks 0, 1 are one replica group's shards 0, 1 and ranks 2, 3 the other's: rank 1's replica is rank 3
HSDP = ClusterView(generation=0, members=("a",), spare_nodes=(),
                   slots=(SlotView("a", 0, 0, "running", True, replicas=(0, 2), sharded=True),
                          SlotView("a", 1, 1, "dead", True, replicas=(1, 3), sharded=True),
                          SlotView("a", 2, 2, "running", True, replicas=(0, 2), sharded=True),
                          SlotView("a", 3, 3, "running", True, replicas=(1, 3), sharded=True),
                          SlotView("a", 4, None, "spare", True)))


def _hsdp(**kw) -> SwapPlan:
    d = plan_for_failure(HSDP, node="a", slot=1, rank=1, reason="exit -9", now_wall=NOW, light_available=True,
                         replicas=(1, 3), sharded=True)
    assert d.plan is not None and d.plan.donor.rank == 3 and d.plan.replica_held == (1,), d.reason
    return dataclasses.replace(d.plan, **kw)


def test_hsdp_shards_come_from_the_replica_and_the_local_copies_are_not_used_when_the_survivors_agree():
    reports = [Report("a", Phase.PAUSE, steps=(7, 7), failed_steps=(7,), dead_steps=(7, 6), rings=(6, 7),
                      dead_ring=(6, 7))]
    plan = next_step(_hsdp(), reports, NOW).plan
    assert plan.phase == Phase.TRANSFER and plan.boundary == 7 and not plan.restore and plan.shard_from is None
    # the same reports without replica_held: a sharded rank with no mirror of it cannot be recovered
    assert resume_plan(reports, 1).step is None


def test_hsdp_mixed_commit_rolls_every_rank_back_to_the_step_start_and_the_replica_donates():
    # rank 1 died in the replicate all-reduce of step 7 after its shard group's last reduce-scatter: rank 0 (its
    # shard peer) and rank 2 completed step 7, rank 3 (its replica) failed in it
    reports = [Report("a", Phase.PAUSE, steps=(8, 8), failed_steps=(7,), dead_steps=(7, 6), rings=(7,),
                      dead_ring=(6, 7))]
    choice = resume_plan(reports, 1, replica_held=True)
    assert (choice.step, choice.restore, choice.shard_from) == (7, True, None), choice.why
    assert "mixed commit" in choice.why and "from its replica" in choice.why
    plan = next_step(_hsdp(), reports, NOW).plan
    assert plan.phase == Phase.TRANSFER and plan.boundary == 7 and plan.restore and plan.shard_from is None
    # no copy every survivor shares with the dead rank's light snapshots: abort, saying so
    bare = [dataclasses.replace(reports[0], rings=(8,))]
    choice = resume_plan(bare, 1, replica_held=True)
    assert choice.step is None and "no step is held by every survivor's local copy" in choice.why


def test_replica_held_names_the_ranks_a_live_sharded_replica_holds():
    from tpassrun.plan.node_shards import replica_held

    assert replica_held(HSDP.slots, (), [1, 0]) == (0, 1)
    # pure FSDP (each rank alone in its group), or the replica gone too: none
    alone = tuple(dataclasses.replace(s, replicas=(s.rank,)) if s.rank is not None else s for s in HSDP.slots)
    assert replica_held(alone, (), [1]) == ()
    gone = tuple(dataclasses.replace(s, state="dead") if s.rank == 3 else s for s in HSDP.slots)
    assert replica_held(gone, (), [1]) == ()
    plan = _hsdp()
    assert SwapPlan.from_json(plan.to_json()) == plan
