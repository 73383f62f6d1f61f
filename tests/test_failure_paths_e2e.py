"""Every failure kind ends in an exit: a recovery that finishes the job, or torchrun's failure report.

One small job per kind (2 ranks + 1 spare, the default ``--max-restarts 0``), real processes and signals. The
timeouts only bound a hang: a test that needed them would fail, not pass slowly.
"""

from __future__ import annotations

import os

import pytest
from faults import Job, faults_env, hold_at, kill_at, stop_at

from tpassrun.channel import WorkerPhase
from tpassrun.plan.failkind import FailureKind, classify_death, recoverable

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
STEPS = 30


def _job(tmp_path, *faults, extra=None, endpoint=None, run_id="") -> Job:
    return Job.tpassrun(str(tmp_path), endpoint=endpoint, run_id=run_id, nproc=2, spares=1, steps=STEPS,
                        step_sleep=0.02, extra=extra, env=faults_env(*faults)).start()


def _names(job: Job) -> list[str]:
    return [e["event"] for e in job.events()]


def test_classification_comes_from_the_worker_report_not_from_messages():
    assert classify_death(1, WorkerPhase.RAISED)[0] == FailureKind.USER_ERROR
    assert classify_death(-9, WorkerPhase.RAISED)[0] == FailureKind.SIGNAL      # killed while unwinding
    assert classify_death(1, WorkerPhase.FAILED)[0] == FailureKind.COLLECTIVE
    assert classify_death(3, WorkerPhase.RUNNING) == (FailureKind.EXIT_CODE, "exited with code 3")
    assert classify_death(-9, WorkerPhase.RUNNING) == (FailureKind.SIGNAL, "killed by SIGKILL")
    assert not recoverable(FailureKind.USER_ERROR)
    assert all(recoverable(k) for k in FailureKind if k != FailureKind.USER_ERROR)


def test_a_user_exception_takes_torchruns_path_at_once_even_with_a_spare(tmp_path):
    m = str(tmp_path / "f")
    job = _job(tmp_path, {"rank": 1, "step": 8, "where": "step", "action": "raise", "marker": m})
    try:
        assert job.wait(180) == 1, job.log()[-3000:]
    finally:
        job.kill()
    log = job.log()
    assert "RuntimeError: injected fault at rank 1 step 8" in log
    assert "Root Cause (first observed failure)" in log and "rank      : 1 (local_rank: 1)" in log
    names = _names(job)
    assert "user_error" in names and "swap_pause" not in names and "recovery_decided" not in names, names


def test_a_death_after_the_training_loop_is_a_failure_as_under_torchrun(tmp_path):
    """A rank killed after its ``sess.run()`` returned (in the script's final save) leaves no step for a spare:
    the job fails with torchrun's report, never "all workers succeeded" with that rank's save missing."""
    job = _job(tmp_path, {"rank": 1, "step": STEPS, "where": "done", "action": "kill", "marker": str(tmp_path / "k")})
    try:
        assert job.wait(180) == 1, job.log()[-3000:]
    finally:
        job.kill()
    log = job.log()
    assert "rank 1 died after its training loop" in log and "rank      : 1 (local_rank: 1)" in log, log[-3000:]
    assert "recovery_decided" not in _names(job)


def test_an_exit_code_is_recovered_and_a_second_one_without_a_spare_ends_in_the_report(tmp_path):
    """The first os._exit(3) goes to the spare; the joiner's own os._exit(3) finds no spare left: torchrun's
    whole-group path (here, no restarts left: the report and exit 1). This path used to hang forever."""
    job = _job(tmp_path, {"rank": 1, "step": 6, "where": "step", "action": "exit", "code": 3, "marker": str(tmp_path / "a")},
               {"rank": 1, "step": 12, "where": "step", "action": "exit", "code": 3, "marker": str(tmp_path / "b")})
    try:
        assert job.wait(180) == 1, job.log()[-3000:]
    finally:
        job.kill()
    names = _names(job)
    assert "swap_resumed" in names and "fallback" in names, names
    assert "exitcode  : 3" in job.log()


def test_a_signal_is_recovered_by_the_spare(tmp_path):
    job = _job(tmp_path, kill_at(1, 6, str(tmp_path / "k"), where="step"))
    try:
        assert job.wait(180) == 0, job.log()[-3000:]
    finally:
        job.kill()
    died = [e for e in job.events() if e["event"] == "worker_died"]
    assert died and died[0]["kind"] == "signal", died
    assert "swap_resumed" in _names(job)


def test_a_hang_is_killed_and_recovered(tmp_path):
    job = _job(tmp_path, stop_at(1, 6, str(tmp_path / "s")), extra=["--hang-timeout", "3"])
    try:
        assert job.wait(180) == 0, job.log()[-3000:]
    finally:
        job.kill()
    names = _names(job)
    assert "hang_detected" in names and "swap_resumed" in names, names


def test_losing_etcd_for_good_ends_the_run(tmp_path, fresh_etcd, run_id):
    """etcd gone mid-run: the single node keeps training (nobody else could hold its ranks) and exits."""
    hold = hold_at(tmp_path, 3)     # etcd goes with the job at step 3, whatever the machine's speed
    # a short reconnect window: past the end of the job the agent waits out its remainder before it gives up on
    # etcd (30 s by default, twice)
    job = _job(tmp_path / "job", hold.fault, endpoint=fresh_etcd.endpoint, run_id=run_id,
               extra=["--rdzv-conf", "read_timeout=3,reconnect_timeout=5"])
    try:
        hold.wait_reached(job)
        fresh_etcd.stop()
        hold.release()
        code = job.wait(200)
    finally:
        hold.release()
        job.kill()
    assert code in (0, 1), job.log()[-3000:]
    assert os.path.exists(os.path.join(str(tmp_path / "job"), "final_rank0.pt")) or code == 1


def test_a_full_disk_for_the_event_log_mid_recovery_loses_nothing_but_the_log(tmp_path):
    """Issue 11: every event-log write fails (ENOSPC); the recovery and the run go on, said once."""
    job = _job(tmp_path, kill_at(1, 6, str(tmp_path / "k"), where="step"), extra=["--event-log", "/dev/full"])
    try:
        assert job.wait(180) == 0, job.log()[-3000:]
    finally:
        job.kill()
    log = job.log()
    assert log.count("cannot write the event log /dev/full") == 1, log[-3000:]
    assert "recovered and resumed" in log
