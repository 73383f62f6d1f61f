"""Sharded state of a user's own (``sess.track_sharded``) recovered live from an in-memory mirror, for real:
examples/train_ddp.py --zero (ZeroAdamW: ZeRO-1 by hand, each rank holds the AdamW state of one slice of the
parameters only), against the same script under plain torchrun.

* two agents on one etcd (two "nodes", 1 rank + 1 spare each: 4 processes): rank 1's slice is mirrored in node
  A's memory; SIGKILLed inside its optimizer step (after its own slice changed), its replacement on node B takes
  the slice from A's mirror and the model from rank 0; rank 0 keeps its process, 0 steps lost;
* one agent (2 ranks + 1 spare), rank 1 killed at a random instant from outside (refreshes at the default
  interval, and every 3 steps: then up to 2 steps are recomputed from older copies); and killed inside step 0,
  from the step-0 copy.
DeepSpeed ZeRO-1/2 and FSDP2 are in tests/test_deepspeed_real.py and tests/test_torchtitan_real.py."""

from __future__ import annotations

import os
import random
import sys
import time

import pytest
from faults import EXAMPLE, Job, faults_env, hold_at, kill_at, pids_by_rank, sigkill_rank
from realjobs import assert_trees_equal


def assert_same_run(job: Job, ref: Job, world: int) -> None:
    """Final model, optimizer slice, scheduler, sampler and step torch.equal to the reference on every rank (the
    process identity aside), and every step's logged loss the reference's (a rollback re-logs some steps)."""
    for r in range(world):
        mine, want = job.final(r), ref.final(r)
        for d in (mine, want):
            d.pop("pid"), d.pop("joined")
        assert_trees_equal(mine, want, f"rank {r}")
        ref_losses = {x["step"]: x["loss"] for x in ref.losses(r)}
        got = [(x["step"], x["loss"]) for x in job.losses(r)]
        assert {s for s, _ in got} == set(ref_losses), f"rank {r}: steps lost"
        assert all(loss == ref_losses[s] for s, loss in got), f"rank {r}: a loss differs from the reference's"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = 24
ARGS = ["--steps", str(STEPS), "--step-sleep", "0.05", "--zero", "--quiet"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Job:
    out = str(tmp_path_factory.mktemp("ref"))
    job = Job(argv=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    EXAMPLE, *ARGS, "--out", out], out=out).start()
    assert job.wait(240) == 0, job.log()[-3000:]
    return job


def _agent(out: str, train: str, endpoint: str, run_id: str, env: dict[str, str], extra: tuple[str, ...] = ()) -> Job:
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "1", "--spares-per-node", "1",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *extra,
            "--log-dir", os.path.join(out, "logs"), EXAMPLE, *ARGS, "--out", train]
    return Job(argv=argv, out=out, env=env)


@pytest.mark.parametrize("encrypt", [False, True], ids=["clear", "encrypted"])
def test_a_ranks_slice_comes_back_from_the_other_nodes_mirror(tmp_path, etcd_server, run_id, reference, encrypt):
    """``encrypted``: the run has ``--rdzv-conf encrypt=true`` (issue 27): the mirror servers of both agents refuse
    frames in clear (tests/test_mirror_seal.py), so the slice that came back from the other node's mirror travelled
    sealed both ways, as did the model sent by rank 0."""
    train = str(tmp_path / "train")
    marker = str(tmp_path / "fault")
    env = faults_env(kill_at(1, random.Random().randint(3, 8), marker, where="opt_step"))
    extra = ("--rdzv-conf", "encrypt=true") if encrypt else ()
    a = _agent(str(tmp_path / "a"), train, etcd_server.endpoint, run_id, env, extra)
    b = _agent(str(tmp_path / "b"), train, etcd_server.endpoint, run_id, env, extra)
    try:
        a.start()
        b.start()
        assert a.wait(240) == 0, a.log()[-4000:] + b.log()[-4000:]
        assert b.wait(60) == 0, b.log()[-4000:]
    finally:
        a.kill()
        b.kill()
    assert os.path.exists(marker), "the fault never fired"
    job = Job(argv=[], out=train)
    assert_same_run(job, reference, 2)
    pids = pids_by_rank(job, 2)
    assert len(pids[0]) == 1 and len(pids[1]) == 2, pids
    evs = a.events() + b.events()
    assert [e for e in evs if e["event"] == "swap_resumed"], a.log()[-3000:]
    # the slice came from the other node's memory, and both nodes said what mirroring costs
    holder = {e["node"] for e in evs if e["event"] == "swap_phase" and "from the mirror on" in (e.get("reason") or "")
              or "rolls back to its copy" in (e.get("reason") or "")}
    assert holder, [e.get("reason") for e in evs if e["event"] == "swap_phase"]
    said = [e for e in evs if e["event"] == "shard_mirror"]
    assert {e["rank"] for e in said} == {0, 1} and all(e["buddy"] for e in said), said
    if encrypt:
        ends = [e for e in evs if e["event"] == "swap_transfer_end" and e.get("checksum")]
        assert ends and all(e["checksum"].startswith("aes-256-gcm:") for e in ends), ends


@pytest.mark.parametrize("interval,kill_from", [("auto", 3), ("3", 9)], ids=["auto", "every-3"])
def test_a_kill_at_a_random_instant_is_recovered_from_the_mirror(tmp_path, etcd_server, run_id, reference, interval,
                                                                  kill_from):
    """With every 3 steps (killed after step 8), the recovery recomputes up to 2 steps from older copies."""
    out = str(tmp_path / "job")
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
            etcd_server.endpoint, "--rdzv-id", run_id, "--nproc-per-node", "2", "--spares-per-node", "1",
            "--shard-mirror-interval", interval, "--log-dir", os.path.join(out, "logs"), EXAMPLE, *ARGS, "--out", out]
    # rank 0 waits at a late step until the kill is done, so the job cannot end first (if it gets there, the kill
    # finds rank 1 waiting in that step's collective: an instant like any other)
    late = hold_at(tmp_path, STEPS - 4)
    job = Job(argv=argv, out=out, env=faults_env(late.fault)).start()
    rnd = random.Random()
    try:
        job.wait_step(rnd.randint(kill_from, kill_from + 9), 240, rank=1)
        time.sleep(rnd.uniform(0.0, 0.08))
        assert sigkill_rank(out, 1) is not None
        late.release()
        assert job.wait(240) == 0, job.log()[-4000:]
    finally:
        late.release()
        job.kill()
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    assert_same_run(job, reference, 2)
    pids = pids_by_rank(job, 2)
    assert len(pids[0]) == 1 and len(pids[1]) == 2, pids


def test_a_death_inside_step_0_is_recovered_from_the_step_0_copy(tmp_path, etcd_server, run_id, reference):
    """Issue 35 item 3: rank 1 dies in its backward pass of step 0 (inside the first accumulation window, before
    the step's commit point): its step-0 copy is in the buddy's memory before the step ran
    (``ZeroAdamW.copy_at_start``), and its slot says it keeps sharded state from ``track_sharded`` on. Before, the
    slot said so only from the step's commit point on, and such a death restarted the group
    (tests/test_shard_step0.py). Live, no step lost, rank 0 keeps its process."""
    out = str(tmp_path / "job")
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint",
            etcd_server.endpoint, "--rdzv-id", run_id, "--nproc-per-node", "2", "--spares-per-node", "1",
            "--max-restarts", "0", "--log-dir", os.path.join(out, "logs"), EXAMPLE, *ARGS, "--out", out]
    job = Job(argv=argv, out=out, env=faults_env(kill_at(1, 0, str(tmp_path / "fault"), where="backward"))).start()
    try:
        assert job.wait(240) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert os.path.exists(tmp_path / "fault"), "the fault did not fire"
    assert [e for e in job.events() if e["event"] == "swap_resumed"], job.log()[-3000:]
    assert_same_run(job, reference, 2)
    assert len(pids_by_rank(job, 2)[0]) == 1
