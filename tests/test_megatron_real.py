"""megatron-core 0.16.1 for real (CPU, gloo, TP=2 x DP=2 = 4 ranks + 1 spare = 5 worker processes):
examples/megatron/train_gpt.py (parallel_state, GPTModel with the local layer spec, Megatron's DDP,
get_megatron_optimizer's Adam without DistributedOptimizer, OptimizerParamScheduler, the RNG tracker with dropout
in tensor-parallel regions, the pipeline schedule, the data iterator rebuilt from consumed_train_samples) under
tpassrun with a planned swap of a tensor-parallel rank, against the same script under plain torchrun. And
tests/megatron_trainer.py, shaped like Megatron-LM's own trainer, through unplanned deaths at the instants that
went wrong (issue 22): survivors rolled back after counting the step, a mixed commit across TP x DP; and (slow)
SIGKILLs at random instants.

megatron-core's GPU-only calls go to the CPU through examples/megatron/cpu_shims.py only (both runs use it)."""

from __future__ import annotations

import os
import random
import time

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/bootstrap.sh installs "
                                            "megatron-core==0.16.1)")

from faults import REPO, faults_env, hold_at, kill_at, pids_by_rank, sigkill_rank, taint
from realjobs import assert_same_run, assert_trees_equal, example, swap_pause_s, torchrun_job, tpassrun_job

SCRIPT = example("megatron", "train_gpt.py")
STEPS = 16
TINY = ["--tp", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "128",
        "--micro-batch", "2", "--num-microbatches", "2", "--steps", str(STEPS)]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


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


# ---------------------------------------------------------------------------------------------
# tests/megatron_trainer.py: the shape of Megatron-LM's own pretrain_gpt.py / training.py (data on TP rank 0
# broadcast to its peer, the loss all-reduced over DP after the optimizer step), TP=2 x DP=2 + 1 spare

TRAINER = os.path.join(REPO, "tests", "megatron_trainer.py")
TRAINER_ITERS = 10


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory):
    job = torchrun_job(str(tmp_path_factory.mktemp("trainer-ref")), TRAINER, 4,
                       ["--train-iters", str(TRAINER_ITERS)]).start()
    try:
        assert job.wait(300) == 0, job.log()[-3000:]
    finally:
        job.kill()
    return job


def _trainer(tmp_path, etcd_server, run_id, *faults: dict, env: dict | None = None, extra: list | None = None):
    job = tpassrun_job(str(tmp_path / "job"), TRAINER, 4, ["--train-iters", str(TRAINER_ITERS)],
                       endpoint=etcd_server.endpoint, run_id=run_id, env={**faults_env(*faults), **(env or {})},
                       extra=extra).start()
    try:
        code = job.wait(360)
    finally:
        job.kill()
    return job, code


def _same_state_and_losses(job, ref, *, unlogged: set[int] = frozenset()) -> None:
    """Final state torch.equal on every rank; every logged loss the reference's; no step missing but ``unlogged``
    (finished by a mixed commit rolled forward, which skips the rest of the step: its logging)."""
    for r in range(4):
        assert_trees_equal(job.final(r), ref.final(r), f"rank {r}")
        want = {x["step"]: x["loss"] for x in ref.losses(r)}
        got = job.losses(r)
        assert [x["step"] for x in got if x["loss"] != want[x["step"]]] == [], f"rank {r}: losses differ"
        assert set(want) - {x["step"] for x in got} <= set(unlogged), f"rank {r}: steps lost"


def test_survivors_rolled_back_after_counting_the_step_resume_exactly(tmp_path, etcd_server, run_id,
                                                                      trainer_reference):
    """Issue 22's silent divergence ("recovered and resumed ... 0 steps lost, 1 redone", exit 0, every rank's loss
    different from the re-run step on). Rank 1 dies after its backward pass, before the data-parallel all-reduce:
    ranks 0 and 2 complete their all-reduce (they had counted the step's samples at its start) and fail in the
    optimizer's grad-norm all-reduce; every survivor rolls back. They rebuilt their data iterators from the counter
    not restored yet (per-rank objects loaded in a hash-seeded set order: PYTHONHASHSEED=4 puts the data first),
    in a world not re-formed yet (megatron-core's data-parallel size 0). Now: exact, the survivors keep their
    processes."""
    at = random.Random().randint(3, TRAINER_ITERS - 4)
    job, code = _trainer(tmp_path, etcd_server, run_id, kill_at(1, at, str(tmp_path / "fault"), where="finalize"),
                         env={"PYTHONHASHSEED": "4"})
    assert code == 0, job.log()[-4000:]
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    _same_state_and_losses(job, trainer_reference)
    pids = pids_by_rank(job, 4)
    assert all(len(pids[r]) == 1 for r in (0, 2, 3)) and len(pids[1]) == 2, pids


def test_a_mixed_commit_across_tp_and_dp_rolls_forward_from_each_ranks_replica(tmp_path, etcd_server, run_id,
                                                                                trainer_reference):
    """Rank 1 dies right after its part of the data-parallel all-reduce: rank 3 completes it and, with rank 2, the
    step; rank 0 fails in the grad-norm all-reduce with rank 1, before its commit point ("survivors stopped at
    different steps": a restart until now). Rank 3's only replica is rank 1, so nobody goes back: rank 0 catches
    up from rank 2 (its replica), the joiner takes rank 3's state and rank 1's seal written in its backward pass.
    The step is finished, not logged (its logging was skipped where it had failed)."""
    at = random.Random().randint(3, TRAINER_ITERS - 4)
    job, code = _trainer(tmp_path, etcd_server, run_id, kill_at(1, at, str(tmp_path / "fault"), where="finalized"))
    assert code == 0, job.log()[-4000:]
    assert "mixed commit: ranks [0]" in job.log() and "caught up" in job.log(), job.log()[-4000:]
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    _same_state_and_losses(job, trainer_reference, unlogged={at})


@pytest.mark.slow
@pytest.mark.parametrize("trial", [0, pytest.param(1, marks=pytest.mark.acceptance)])   # CI: one random instant
def test_sigkill_at_a_random_instant_is_live_and_exact_or_explained(tmp_path, etcd_server, run_id,
                                                                    trainer_reference, trial):
    """A random rank SIGKILLed from outside at a uniformly random instant (bench/megatron.py runs more): live and
    torch.equal to torchrun, or a fallback the console explains (README: limits) that re-runs the script."""
    rnd = random.Random()
    victim, at = rnd.randrange(4), rnd.randint(2, TRAINER_ITERS - 4)
    late = hold_at(tmp_path, TRAINER_ITERS - 2)      # rank 0 waits there until the kill is done
    job = tpassrun_job(str(tmp_path / "job"), TRAINER, 4, ["--train-iters", str(TRAINER_ITERS)],
                       endpoint=etcd_server.endpoint, run_id=run_id, env=faults_env(late.fault),
                       extra=["--max-restarts", "1"]).start()
    try:
        job.wait_step(at, 300, rank=victim)
        time.sleep(rnd.uniform(0.0, 1.0))
        assert sigkill_rank(job.out, victim) is not None
        late.release()
        assert job.wait(360) == 0, job.log()[-4000:]
    finally:
        late.release()
        job.kill()
    fallback = [ln for ln in job.log().splitlines() if "recovery decided (fallback)" in ln]
    if fallback:
        print(f"trial {trial}: rank {victim} after step {at}: fallback: {fallback[0]}")
        return
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    _same_state_and_losses(job, trainer_reference, unlogged=set(range(TRAINER_ITERS)))
    print(f"trial {trial}: rank {victim} after step {at}: live, exact, pause {swap_pause_s(job):.2f} s")


# ---------------------------------------------------------------------------------------------
# Megatron's DistributedOptimizer (--use-distributed-optimizer, gradient clipping 1.0), TP=2 x DP=2: each DP rank's
# fp32 main-param and Adam shard exists on that rank only; tpassrun keeps it (and, TP > 1, the rank's model
# chunks) in its buddy's memory (sess.track_sharded) and recovers a dead rank from there

DISTOPT = ["--train-iters", str(TRAINER_ITERS), "--use-distributed-optimizer", "--clip-grad", "1.0"]


@pytest.fixture(scope="module")
def distopt_reference(tmp_path_factory):
    job = torchrun_job(str(tmp_path_factory.mktemp("distopt-ref")), TRAINER, 4, DISTOPT).start()
    try:
        assert job.wait(300) == 0, job.log()[-3000:]
    finally:
        job.kill()
    return job


def test_distributed_optimizer_rank_killed_mid_step_is_recovered_from_the_mirror(tmp_path, etcd_server, run_id,
                                                                                distopt_reference):
    """A rank dies after its backward pass, before the data-parallel reduce-scatter of a random step: nobody holds
    its optimizer shard but its buddy's mirror; the joiner loads it (and its model chunks) from there, the
    scheduler from a survivor, the survivors roll back to the same step's local copy and the step is re-executed.
    Final state (model, DistributedOptimizer state, scheduler, RNG tracker, counters) and every logged loss
    torch.equal to torchrun's; the survivors keep their processes."""
    at = random.Random().randint(2, TRAINER_ITERS - 4)
    job = tpassrun_job(str(tmp_path / "job"), TRAINER, 4, DISTOPT, endpoint=etcd_server.endpoint, run_id=run_id,
                       env=faults_env(kill_at(1, at, str(tmp_path / "fault"), where="finalize"))).start()
    try:
        assert job.wait(360) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    assert [e for e in job.events() if e["event"] == "shard_mirror"], "the optimizer shard was not mirrored"
    _same_state_and_losses(job, distopt_reference)
    pids = pids_by_rank(job, 4)
    assert all(len(pids[r]) == 1 for r in (0, 2, 3)) and len(pids[1]) == 2, pids


def test_a_distributed_optimizer_configuration_not_handed_over_runs_as_under_torchrun(tmp_path, etcd_server,
                                                                                      run_id):
    """Never worse than torchrun: --overlap-param-gather (the parameter all-gather runs into the next step's
    forward pass) is not handed over live. A rank's death then restarts the group, as torchrun does, with one
    console line quoting why; the restarted job ends torch.equal to torchrun's run."""
    args = [*DISTOPT, "--overlap-grad-reduce", "--overlap-param-gather"]
    ref = torchrun_job(str(tmp_path / "ref"), TRAINER, 4, args).start()
    try:
        assert ref.wait(300) == 0, ref.log()[-3000:]
    finally:
        ref.kill()
    job = tpassrun_job(str(tmp_path / "job"), TRAINER, 4, args, endpoint=etcd_server.endpoint, run_id=run_id,
                       env=faults_env(kill_at(2, 3, str(tmp_path / "fault"), where="step")),
                       extra=["--max-restarts", "1"]).start()
    try:
        assert job.wait(360) == 0, job.log()[-4000:]
    finally:
        job.kill()
    said = [ln for ln in job.log().splitlines() if "recovery decided (fallback)" in ln]
    assert len(said) == 1 and "overlap_param_gather" in said[0], job.log()[-4000:]
    for r in range(4):
        assert_trees_equal(job.final(r), ref.final(r), f"rank {r}")
