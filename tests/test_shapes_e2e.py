"""The usual shapes of a training script, bit-identical to torchrun through deaths and planned swaps.

One script (``examples/train_ddp.py``) with all of them at once: a ``torch.compile``d model inside
``sess.ddp``, CPU autocast (fp16) with a ``torch.amp.GradScaler`` that overflows and skips optimizer steps now and
then, two micro-batches per step (``no_sync`` on the first) and an optimizer step every second step (gradient
accumulation across ``step_fn`` calls), and batches from a ``DataLoader`` with 2 worker processes and a
``DistributedSampler`` (several epochs). One torchrun reference without faults; two tpassrun jobs (3 ranks + 2
spares) with a death or a planned swap at named instants, each ending ``torch.equal`` to it (parameters, optimizer
state, scaler, data position, per-step losses):

* SIGKILL inside a backward pass in the middle of an accumulation window (everyone rolls the window back), and
  right after a window's optimizer step (everyone resumes at the next step);
* a planned swap (``tpassctl taint``) asked for while a window is open (the boundary waits for the window's end,
  so no rank's accumulated gradients are dropped), then SIGKILL of rank 0 while it loads a batch.
"""

from __future__ import annotations

import os
import time

import pytest
from faults import Job, assert_bit_exact, faults_env, kill_at, pids_by_rank, taint

STEPS = 12
SLEEP = 0.02
SHAPES = ["--compile", "--amp", "fp16", "--micro", "2", "--accum-steps", "2", "--loader-workers", "2",
          "--samples", "480"]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = Job.torchrun(str(tmp_path_factory.mktemp("torchrun")), nproc=3, steps=STEPS, step_sleep=SLEEP,
                       script_args=SHAPES).start()
    try:
        assert job.wait(400) == 0, job.log()[-3000:]
    finally:
        job.kill()
    return job


def _run(tmp_path, etcd_server, run_id, faults, *, taint_rank: int | None = None) -> Job:
    # ranks with DataLoader workers are killed on purpose: their workers die with them and leave their pymp-*
    # directories in $TMPDIR (conftest's _nothing_left_behind): the job's goes to the test's tmp_path
    tmpdir = tmp_path / "t"
    tmpdir.mkdir()
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=3, spares=2,
                       steps=STEPS, step_sleep=SLEEP, extra=["--max-restarts", "0"], script_args=SHAPES,
                       env={"TMPDIR": str(tmpdir), **faults_env(*faults)}).start()
    try:
        if taint_rank is not None:
            held = str(tmp_path / "held")
            deadline = time.monotonic() + 300
            while not (os.path.exists(held) and any(e["event"] == "spare_ready" for e in job.events())):
                assert job.proc.poll() is None and time.monotonic() < deadline, job.log()[-3000:]
                time.sleep(0.05)
            assert taint(etcd_server.endpoint, run_id, rank=taint_rank, reason="test: inside a window") == 0
            # released once the boundary is fixed (every rank then stops there), not at the decision: the ranks
            # could run on past the window's end before their agent pauses them
            job.wait_event("swap_boundary", distinct="swap_id")
            open(tmp_path / "release", "w").close()
        assert job.wait(400) == 0, job.log()[-4000:]
    finally:
        open(tmp_path / "release", "w").close()
        job.kill()
    events = job.events()
    assert len([e for e in events if e["event"] == "swap_resumed"]) == 2, [
        (e["event"], e.get("reason")) for e in events if e["event"] in ("swap_phase", "fallback")]
    assert not [e for e in events if e["event"] in ("fallback", "restart")]
    return job


def test_deaths_inside_and_right_after_an_accumulation_window(tmp_path, etcd_server, run_id, reference):
    faults = [kill_at(1, 3, str(tmp_path / "f1"), where="backward"),    # window 2..3, its first micro-batch
              kill_at(2, 7, str(tmp_path / "f2"), where="after_opt")]   # window 6..7 committed
    job = _run(tmp_path, etcd_server, run_id, faults)
    resumed = [e["reason"] for e in job.events() if e["event"] == "swap_phase" and e.get("phase") == "transfer"]
    assert "at step 2" in resumed[0] and "at step 8" in resumed[1], resumed
    assert len(pids_by_rank(job, 3)[0]) == 1
    assert_bit_exact(job, reference, 3)
    for r in range(3):
        assert job.final(r)["scaler"] == reference.final(r)["scaler"]


def test_a_planned_swap_inside_a_window_waits_for_its_end_then_rank_0_dies_loading(tmp_path, etcd_server, run_id,
                                                                                  reference):
    hold = {"rank": 0, "step": 4, "where": "step", "action": "hold", "release": str(tmp_path / "release"),
            "marker": str(tmp_path / "held")}
    job = _run(tmp_path, etcd_server, run_id, [hold, kill_at(0, 9, str(tmp_path / "f0"), where="load")],
               taint_rank=1)
    boundary = [e["step"] for e in job.events() if e["event"] == "swap_boundary_reached"]
    assert boundary == [6], boundary       # window 4..5 ends before the swap
    assert len(pids_by_rank(job, 3)[2]) == 1
    assert_bit_exact(job, reference, 3)
    for r in range(3):
        assert job.final(r)["scaler"] == reference.final(r)["scaler"]
