"""The replica check after a recovery, in a real job (issue 22 item 2): 4 ranks and a spare (gloo, real etcd, a
real SIGKILL). A recovery once reported success while every rank's loss diverged from torchrun's from the re-run
step on (megatron-core TP=2 x DP=2, 1 of 15 SIGKILL trials), and nothing noticed. Now the ranks compare an exact
digest of their replicated state at the first step after every swap or recovery: a joiner that loaded one wrong
bit is named on the console with the tensor, takes its state from a replica, and the run ends ``torch.equal`` to
torchrun; a clean recovery says in one line that the replicas agree. (The decision and the collectives alone:
tests/test_digest.py.)"""

from __future__ import annotations

import os
import random

import pytest
from faults import Job, assert_bit_exact, faults_env, kill_at

STEPS = 40           # the session's 4-rank reference (conftest.reference_run)
SLEEP = 0.05
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def baseline4(reference_run):
    return reference_run(4, STEPS)


def _checks(job: Job) -> list[dict]:
    return [e for e in job.events() if e["event"] == "replicas_checked"]


def _recover(tmp_path, etcd_server, run_id, *faults: dict) -> tuple[Job, int]:
    at = random.Random().randint(5, 25)
    marker = str(tmp_path / "kill")
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=4, spares=1,
                       steps=STEPS, step_sleep=SLEEP, env=faults_env(kill_at(1, at, marker), *faults)).start()
    try:
        assert job.wait(240) == 0, job.log()[-3000:]
    finally:
        job.kill()
    assert os.path.exists(marker), "the kill never fired"
    return job, at


def test_a_corrupted_joiner_is_named_on_the_console_and_repaired_from_a_replica(tmp_path, etcd_server, run_id,
                                                                                 baseline4):
    corrupt = {"rank": 1, "where": "loaded", "action": "corrupt", "tensor": "model.fc1.weight",
               "marker": str(tmp_path / "corrupt")}
    job, at = _recover(tmp_path, etcd_server, run_id, corrupt)
    assert os.path.exists(corrupt["marker"]), "the joiner was never corrupted"
    first, again = _checks(job)
    assert first["ok"] is False and first["action"] == "repair" and first["step"] == at
    assert list(first["differ"]) == ["1"], first
    assert first["differ"]["1"]["tensors"] == ["model.fc1.weight"] and first["differ"]["1"]["source"] == 0
    assert again["ok"] is True and again["recheck"] is True and again["ranks"] == 4
    log = job.log()
    assert (f"replica check at step {at}: MISMATCH: rank 1 differs in model.fc1.weight: takes model "
            f"from rank 0 (repairing from a replica)") in log, log[-3000:]
    assert f"replicas agree again at step {at} after the repair (4 rank(s) compared)" in log
    assert not [e for e in job.events() if e["event"] == "fallback"]
    assert_bit_exact(job, baseline4, 4)


def test_a_clean_recovery_says_the_replicas_agree_in_one_line_and_stays_exact(tmp_path, etcd_server, run_id,
                                                                              baseline4):
    job, at = _recover(tmp_path, etcd_server, run_id)
    (check,) = _checks(job)
    assert check["ok"] is True and check["step"] == at and check["ranks"] == 4 and check["groups"] == 1
    assert check["nbytes"] > 0 and not check["recheck"]
    lines = [line for line in job.log().splitlines() if "replica" in line and "agree" in line]
    assert len(lines) == 1 and f"replicas agree at step {at}: 4 rank(s) in 1 replica group(s)" in lines[0], lines
    assert_bit_exact(job, baseline4, 4)
