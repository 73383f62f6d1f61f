"""torchtitan 0.3.0 for real (CPU, gloo, 4 ranks + 1 spare = 5 worker processes): examples/torchtitan/train.py
(torchtitan's ParallelDims mesh, FSDP2 fully_shard per block, OptimizersContainer, LRSchedulersContainer) under
tpassrun, against the same script under plain torchrun (one reference run per mesh shape for the module):

* a planned swap under pure FSDP2 (dp_shard=4) and under HSDP (dp_replicate=2 x dp_shard=2);
* an unplanned SIGKILL under HSDP at several instants of a step (inside the forward, mid-backward with the last
  block's gradients already reduce-scattered, inside the optimizer step, in user code after it): recovered live
  from the dead rank's replica in the other replica group. The survivors reset FSDP2's per-iteration state
  (tpassrun.adapters._common.reset_failed_step) before re-executing a step that failed half-way."""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("torchtitan", reason="torchtitan not installed (scripts/bootstrap.sh installs torchtitan==0.3.0)")

from faults import faults_env, kill_at, pids_by_rank, taint  # noqa: E402
from realjobs import assert_same_run, example, swap_pause_s, torchrun_job, tpassrun_job  # noqa: E402

SCRIPT = example("torchtitan", "train.py")
STEPS = 40          # planned swaps (a taint at a random early step)
KILL_STEPS = 12     # unplanned kills (at step 4)
pytestmark = pytest.mark.timeout(420)


def _args(replicate: int, sleep: float = 0.1, steps: int = STEPS) -> list[str]:
    return ["--dp-replicate", str(replicate), "--steps", str(steps), "--step-sleep", str(sleep)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    done: dict[tuple[int, int], object] = {}

    def get(replicate: int, steps: int = STEPS):
        if (replicate, steps) not in done:
            job = torchrun_job(str(tmp_path_factory.mktemp(f"ref{replicate}")), SCRIPT, 4,
                               _args(replicate, 0.0, steps)).start()
            assert job.wait(300) == 0, job.log()[-3000:]
            done[replicate, steps] = job
        return done[replicate, steps]
    return get


def test_fsdp2_planned_swap_is_bit_exact(tmp_path, etcd_server, run_id, reference):
    ref = reference(1)
    at = random.Random().randint(1, 5)
    job = tpassrun_job(str(tmp_path), SCRIPT, 4, _args(1), endpoint=etcd_server.endpoint, run_id=run_id).start()
    try:
        job.wait_step(at, 240)
        assert taint(etcd_server.endpoint, run_id, rank=1, reason=f"test at step {at}") == 0
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    assert_same_run(job, ref, 4)
    pids = pids_by_rank(job, 4)
    assert all(len(pids[r]) == 1 for r in (0, 2, 3)) and len(pids[1]) == 2, pids
    print(f"torchtitan FSDP2 planned swap pause: {swap_pause_s(job):.2f} s")


@pytest.mark.parametrize("rank,where", [(3, "forward"), (1, "backward"), (2, "opt_step"), (0, "after_opt")])
def test_hsdp_unplanned_kill_is_recovered_from_the_replica_group(tmp_path, etcd_server, run_id, reference, rank,
                                                                 where):
    ref = reference(2, KILL_STEPS)
    marker = str(tmp_path / "fault")
    job = tpassrun_job(str(tmp_path / "job"), SCRIPT, 4, _args(2, 0.05, KILL_STEPS), endpoint=etcd_server.endpoint,
                       run_id=run_id, env=faults_env(kill_at(rank, 4, marker, where=where))).start()
    try:
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert os.path.exists(marker), "the fault never fired"
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    assert_same_run(job, ref, 4)
    pids = pids_by_rank(job, 4)
    assert all(len(pids[r]) == 1 for r in range(4) if r != rank) and len(pids[rank]) == 2, pids
    print(f"torchtitan HSDP unplanned recovery ({where}) pause: {swap_pause_s(job):.2f} s")


def test_pure_fsdp_unplanned_kill_falls_back_and_says_why(tmp_path, etcd_server, run_id):
    """dp_shard=4, no replica: nobody holds the dead rank's shards. The recovery is not attempted: one console
    line names the rank and the reason, and the job takes torchrun's path (a whole-group restart that, without a
    checkpoint, runs the script again)."""
    marker = str(tmp_path / "fault")
    job = tpassrun_job(str(tmp_path / "job"), SCRIPT, 4, ["--dp-replicate", "1", "--steps", "8"],
                       endpoint=etcd_server.endpoint, run_id=run_id, env=faults_env(kill_at(1, 3, marker)),
                       extra=["--max-restarts", "1"]).start()
    try:
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    lines = [line for line in job.log().splitlines() if "recovery decided (fallback)" in line]
    assert len(lines) == 1, job.log()[-4000:]
    assert ("rank 1 died and no other rank holds its state: FSDP shards its model and optimizer state over "
            "dp_shard and the mesh has no dp_replicate dimension: whole-group restart") in lines[0], lines
    names = [e["event"] for e in job.events()]
    assert "swap_resumed" not in names and "restart" in names, names
    assert job.losses(1)[-1]["step"] == 7
