"""torchtitan 0.3.0 for real (CPU, gloo, 4 ranks + 1 spare = 5 worker processes): examples/torchtitan/train.py
(torchtitan's ParallelDims mesh, FSDP2 fully_shard per block, OptimizersContainer, LRSchedulersContainer) under
tpassrun, against the same script under plain torchrun (one reference run per mesh shape for the module):

* a planned swap under pure FSDP2 (dp_shard=4);
* an unplanned SIGKILL under HSDP (dp_replicate=2 x dp_shard=2) inside the forward, mid-backward (the last
  block's gradients already reduce-scattered) and inside the optimizer step, each of another rank: recovered live
  from the dead rank's replica in the other replica group (the donor its adapter declared). The survivors reset
  FSDP2's per-iteration state (tpassrun.adapters._common.reset_failed_step) before re-executing a step that failed
  half-way;
* an unplanned SIGKILL under pure FSDP2, where no live rank holds the dead rank's shards: recovered from the
  in-memory mirror of them (sess.track_sharded, tpassrun/worker/shards.py), mid-backward and after the optimizer step
  (the survivors finish that step without it: every rank rolls back to its own copy of the step's start)."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("torchtitan", reason="torchtitan not installed (scripts/bootstrap.sh installs torchtitan==0.3.0)")

from faults import faults_env, hold_at, kill_at, pids_by_rank, slow_from, taint
from realjobs import assert_same_run, example, swap_pause_s, torchrun_job, tpassrun_job

SCRIPT = example("torchtitan", "train.py")
STEPS = 12
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _args(replicate: int, sleep: float = 0.05) -> list[str]:
    return ["--dp-replicate", str(replicate), "--steps", str(STEPS), "--step-sleep", str(sleep)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    done: dict[int, object] = {}

    def get(replicate: int):
        if replicate not in done:
            job = torchrun_job(str(tmp_path_factory.mktemp(f"ref{replicate}")), SCRIPT, 4, _args(replicate, 0.0)).start()
            assert job.wait(300) == 0, job.log()[-3000:]
            done[replicate] = job
        return done[replicate]
    return get


def _survived(job, rank: int) -> None:
    pids = pids_by_rank(job, 4)
    assert all(len(pids[r]) == 1 for r in range(4) if r != rank) and len(pids[rank]) == 2, pids


def test_fsdp2_planned_swap_is_bit_exact(tmp_path, etcd_server, run_id, reference):
    ref = reference(1)
    at = random.Random().randint(1, 8)
    hold = hold_at(tmp_path, at)     # the swap is set while the job stands at step `at`, however slow the machine
    job = tpassrun_job(str(tmp_path / "job"), SCRIPT, 4, _args(1), endpoint=etcd_server.endpoint, run_id=run_id,
                       env=faults_env(hold.fault)).start()
    try:
        hold.wait_reached(job)
        assert taint(etcd_server.endpoint, run_id, rank=1, reason=f"test at step {at}") == 0
        hold.release_after(job, "swap_boundary")
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        hold.release()
        job.kill()
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    assert_same_run(job, ref, 4)
    _survived(job, 1)
    print(f"torchtitan FSDP2 planned swap pause: {swap_pause_s(job):.2f} s")


def _kill(tmp_path, etcd_server, run_id, replicate: int, rank: int, where: str, *also: dict):
    marker = str(tmp_path / "fault")
    job = tpassrun_job(str(tmp_path / "job"), SCRIPT, 4, _args(replicate), endpoint=etcd_server.endpoint,
                       run_id=run_id, env=faults_env(*also, kill_at(rank, 4, marker, where=where))).start()
    try:
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert os.path.exists(marker), "the fault never fired"
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    return job


# CI's budget: the kill inside the optimizer step in CI (half of it applied: the hardest instant); the other instants
# with TPASSRUN_ACCEPTANCE=1 (test_anyinstant kills DDP at every phase in CI)
@pytest.mark.parametrize("rank,where", [pytest.param(3, "forward", marks=pytest.mark.acceptance),
                                        pytest.param(1, "backward", marks=pytest.mark.acceptance), (0, "opt_step")])
def test_hsdp_unplanned_kill_is_recovered_from_the_replica_group(tmp_path, etcd_server, run_id, reference, rank,
                                                                 where):
    # opt_step: rank 0 dies 0.5 s into its optimizer step of step 4 and rank 1 lags 1.5 s behind after it, so
    # ranks 2 and 3 are well into step 5, rank 3 blocked in the replicate all-reduce with rank 1, when rank 1 stops
    # at step 5's start: the paused rank must tear its collectives down for rank 3 to fail (else the pause waits
    # for its timeout)
    lag = [slow_from(0, 4, 0.5) | {"where": "opt_step", "until": 5},
           slow_from(1, 4, 1.5) | {"where": "after_opt", "until": 5}] if where == "opt_step" else []
    job = _kill(tmp_path, etcd_server, run_id, 2, rank, where, *lag)
    assert_same_run(job, reference(2), 4)
    _survived(job, rank)
    donor = (rank + 2) % 4      # the same dp_shard coordinate in the other replica group
    assert f"state from rank {donor} " in job.log(), job.log()[-3000:]
    print(f"torchtitan HSDP unplanned recovery ({where}) pause: {swap_pause_s(job):.2f} s")


@pytest.mark.parametrize("rank,where", [(1, "backward"), pytest.param(2, "after_opt", marks=pytest.mark.acceptance)])
def test_pure_fsdp_unplanned_kill_is_recovered_from_the_mirror(tmp_path, etcd_server, run_id, reference, rank,
                                                               where):
    job = _kill(tmp_path, etcd_server, run_id, 1, rank, where)
    assert_same_run(job, reference(1), 4, redone=True)
    _survived(job, rank)
    print(f"torchtitan FSDP2 unplanned recovery from the mirror ({where}) pause: {swap_pause_s(job):.2f} s")
