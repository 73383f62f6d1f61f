"""megatron-core 0.16.1 for real (CPU, gloo, TP=2 x DP=2 = 4 ranks + 1 spare = 5 worker processes):
examples/megatron/train_gpt.py (parallel_state, GPTModel with the local layer spec, Megatron's DDP,
get_megatron_optimizer's Adam without DistributedOptimizer, OptimizerParamScheduler, the RNG tracker with dropout
in tensor-parallel regions, the pipeline schedule, the data iterator rebuilt from consumed_train_samples) under
tpassrun with a planned swap of a tensor-parallel rank, against the same script under plain torchrun.

megatron-core's GPU-only calls go to the CPU through examples/megatron/cpu_shims.py only (both runs use it)."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/bootstrap.sh installs "
                                            "megatron-core==0.16.1)")

from faults import faults_env, hold_at, pids_by_rank, taint  # noqa: E402
from realjobs import assert_same_run, example, swap_pause_s, torchrun_job, tpassrun_job  # noqa: E402

SCRIPT = example("megatron", "train_gpt.py")
STEPS = 16
TINY = ["--tp", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "128",
        "--micro-batch", "2", "--num-microbatches", "2", "--steps", str(STEPS)]
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = torchrun_job(str(tmp_path_factory.mktemp("ref")), SCRIPT, 4, TINY).start()
    try:
        assert job.wait(300) == 0, job.log()[-3000:]
    finally:
        job.kill()
    return job


@pytest.mark.parametrize("rank", [1])
def test_tp2_planned_swap_is_bit_exact(tmp_path, etcd_server, run_id, reference, rank):
    """Rank 1 (TP rank 1 of the first data-parallel replica) moves to the spare at a random early step: the
    survivors re-create parallel_state's groups with the joiner and re-point the cached ones (layers, DDP
    buckets, optimizer), the joiner loads model shard, Adam state, scheduler, RNG tracker streams, counters and
    rebuilds its data iterator; everything ends torch.equal to torchrun's run, survivors keep their processes."""
    at = random.Random().randint(1, 8)
    hold = hold_at(tmp_path, at)     # the swap is set while the job stands at step `at`, however slow the machine
    job = tpassrun_job(str(tmp_path / "job"), SCRIPT, 4, TINY, endpoint=etcd_server.endpoint, run_id=run_id,
                       env=faults_env(hold.fault)).start()
    try:
        hold.wait_reached(job)
        assert taint(etcd_server.endpoint, run_id, rank=rank, reason=f"test at step {at}") == 0
        hold.release_after(job, "swap_boundary")
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        hold.release()
        job.kill()
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    assert_same_run(job, reference, 4)
    pids = pids_by_rank(job, 4)
    assert all(len(pids[r]) == 1 for r in range(4) if r != rank) and len(pids[rank]) == 2, pids
    print(f"megatron TP=2 planned swap pause: {swap_pause_s(job):.2f} s")
