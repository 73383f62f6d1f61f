"""Bit-identical to torchrun: the reference is the same script under plain ``torchrun`` with a hand-built
``DistributedDataParallel(model)`` and no fault, as a user moving from torchrun runs it.

Under tpassrun, with ``sess.ddp(model)`` or with a hand-built DDP, without faults and with a planned swap at a
random step, every rank ends with parameters, optimizer state and per-step losses ``torch.equal`` to it. The
job runs past step 11, where a DDP with another gradient bucket layout than torch's re-bucketed one drifts
(in the last bits of the loss). One run does its swap in an environment where numpy cannot be imported (numpy
is not a dependency). At most 5 worker processes run at once (4 ranks + 1 spare).
"""

from __future__ import annotations

import os
import random

import pytest
from faults import Job, assert_bit_exact, faults_env, hold_at, pids_by_rank, taint

STEPS = 40
SLEEP = 0.05
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NO_NUMPY = '''\
import os
import sys

sys.modules["numpy"] = None   # import numpy raises ModuleNotFoundError; importlib.util.find_spec says None
with open(os.environ["TEST_NO_NUMPY_PIDS"], "a") as fh:
    fh.write(f"{os.getpid()}\\n")
'''


@pytest.fixture(scope="module")
def torchrun_ref(reference_run):
    return reference_run(4, STEPS)      # torchrun, a hand-built DistributedDataParallel, no fault


@pytest.mark.parametrize("ddp", ["session", "torch"])
def test_no_fault_run_equals_torchrun(tmp_path, torchrun_ref, ddp):
    job = Job.tpassrun(str(tmp_path), endpoint=None, run_id="", nproc=4, steps=STEPS, step_sleep=0.0,
                       script_args=["--ddp", ddp]).start()
    try:
        assert job.wait(240) == 0, job.log()[-3000:]
    finally:
        job.kill()
    assert_bit_exact(job, torchrun_ref, 4)


def _swap_once(tmp_path, etcd_server, run_id, ddp: str, env: dict[str, str] | None = None,
               at: int | None = None) -> Job:
    """A planned swap of rank 2 decided while rank 0 is held at the start of a random step (so that a spare
    slow to warm up on a busy host cannot let the job end first); the boundary is the agent's choice, and the
    hold is released once it is fixed."""
    at = random.Random().randint(3, 25) if at is None else at
    hold = hold_at(tmp_path, at)
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=4, spares=1,
                       steps=STEPS, step_sleep=SLEEP, script_args=["--ddp", ddp],
                       env={**(env or {}), **faults_env(hold.fault)}).start()
    try:
        hold.wait_reached(job)
        assert taint(etcd_server.endpoint, run_id, rank=2, reason=f"test at step {at}") == 0
        hold.release_after(job, "swap_boundary")
        assert job.wait(240) == 0, job.log()[-3000:]
    finally:
        hold.release()
        job.kill()
    pids = pids_by_rank(job, 4)
    assert len(pids[2]) == 2 and all(len(pids[r]) == 1 for r in (0, 1, 3)), (at, pids)   # one live swap
    return job


def test_planned_swap_with_session_ddp_equals_torchrun(tmp_path, etcd_server, run_id, torchrun_ref):
    job = _swap_once(tmp_path, etcd_server, run_id, "session")
    assert_bit_exact(job, torchrun_ref, 4)


def test_swap_before_torch_rebuckets_equals_torchrun(tmp_path, etcd_server, run_id, torchrun_ref):
    """Decided during step 1: DDP re-buckets at step 1's forward (by step 0's ready order), its logging data
    shows the new layout only after step 2; the layout handed over is computed from the ready order."""
    job = _swap_once(tmp_path, etcd_server, run_id, "session", at=1)
    assert_bit_exact(job, torchrun_ref, 4)


def test_swap_without_numpy_equals_torchrun(tmp_path, etcd_server, run_id, torchrun_ref):
    """Launcher, agent, workers and the spare all run where ``import numpy`` fails."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_NUMPY)
    path = os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH", "")) if p)
    pids = tmp_path / "pids"
    job = _swap_once(tmp_path, etcd_server, run_id, "session",
                     env={"PYTHONPATH": path, "TEST_NO_NUMPY_PIDS": str(pids)})
    blocked = {int(line) for line in pids.read_text().split()}
    workers = set().union(*pids_by_rank(job, 4).values())
    assert len(workers) == 5 and workers <= blocked, (workers, blocked)   # the spare too
    assert_bit_exact(job, torchrun_ref, 4)
