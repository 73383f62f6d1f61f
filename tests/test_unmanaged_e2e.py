"""A script that never imports tpassrun, launched with spares: it runs exactly as under torchrun, its spare
parks quietly, and a taint restarts the group with the tainted slot replaced by the spare slot (a health-aware
restart) without spending a --max-restarts."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from faults import REPO, Job, taint

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PLAIN = os.path.join(REPO, "tests", "plain_train.py")


def _job(tmp_path, endpoint: str, run_id: str, steps: int, hold_at: int, release: str, extra=()) -> Job:
    out = str(tmp_path / "job")
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--nproc-per-node", "2", "--spares-per-node", "1", *extra,
            "--log-dir", os.path.join(out, "logs"), PLAIN, "--steps", str(steps), "--step-sleep", "0.05",
            "--out", out, "--hold-at", str(hold_at), "--release", release]
    return Job(argv=argv, out=out)


def _rows(job: Job, rank: int) -> list[dict]:
    path = os.path.join(job.out, f"steps_rank{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(x) for x in fh if x.strip()]


def test_taint_on_an_unmanaged_job_restarts_it_on_the_spare_slot(tmp_path, etcd_server, run_id):
    steps = 20
    release = tmp_path / "release"    # rank 0 waits at step 5 until the taint's restart is decided
    job = _job(tmp_path, etcd_server.endpoint, run_id, steps, 5, str(release)).start()
    try:
        deadline = time.monotonic() + 180
        while len(_rows(job, 1)) < 5:
            assert job.proc.poll() is None and time.monotonic() < deadline, job.log()[-3000:]
            time.sleep(0.1)
        assert taint(etcd_server.endpoint, run_id, rank=1, reason="ecc errors (test)") == 0
        job.wait_event("fallback")
        release.touch()
        assert job.wait(240) == 0, job.log()[-3000:]
    finally:
        release.touch()
        job.kill()
    log = job.log()
    assert "Traceback" not in log and "rank >= 0" not in log, log[-3000:]   # the parked spare said nothing
    events = job.events()
    fallback = [e for e in events if e["event"] == "fallback"]
    assert fallback and "health-aware restart" in fallback[0]["reason"]
    assert [e["slot"] for e in events if e["event"] == "slot_quarantined"] == [1]
    starts = [e for e in events if e["event"] == "workers_started"]
    assert len(starts) == 2
    first = {s["slot"]: s["rank"] for s in starts[0]["slots"]}
    second = {s["slot"]: s["rank"] for s in starts[1]["slots"]}
    assert first == {0: 0, 1: 1, 2: None}
    assert second == {0: 0, 2: 1}                  # rank 1 moved to the spare slot; slot 1 sits out
    assert not [e for e in events if e["event"] == "restart"]   # no --max-restarts spent (there are none)
    for r in range(2):
        rows = _rows(job, r)
        last = [x for x in rows if x["pid"] == rows[-1]["pid"]]
        assert [x["step"] for x in last] == list(range(steps))   # the restarted attempt ran to the end
        assert {x["restart"] for x in rows} == {0}


@pytest.mark.parametrize("restarts", [1, 0])
def test_a_dead_rank_of_an_unmanaged_job_restarts_onto_the_spare_or_says_why_not(tmp_path, etcd_server, run_id,
                                                                              restarts):
    """An unmodified torchrun script with --spares-per-node 1: a SIGKILLed rank failed the whole job (torchrun's
    default of 0 restarts) and nothing said why the warm spare was not used. With --max-restarts 1 the restart now
    puts the rank on the spare slot (the dead slot sits out, as a tainted one); with 0, one line says that live
    swaps need the worker API and that --max-restarts N would restart onto the spare."""
    import signal

    release = tmp_path / "release"
    job = _job(tmp_path, etcd_server.endpoint, run_id, 12, -1, str(release),
               extra=["--max-restarts", str(restarts)]).start()
    try:
        deadline = time.monotonic() + 180
        while len(_rows(job, 1)) < 3:
            assert job.proc.poll() is None and time.monotonic() < deadline, job.log()[-3000:]
            time.sleep(0.05)
        os.kill(_rows(job, 1)[-1]["pid"], signal.SIGKILL)
        code = job.wait(240)
    finally:
        job.kill()
    log, events = job.log(), job.events()
    said = [e for e in events if e["event"] == "unmanaged_death"]
    assert len(said) == 1 and "worker API" in said[0]["reason"], said
    assert "died (exit code -9): the script does not use tpassrun's worker API" in log, log[-3000:]
    if restarts:
        assert code == 0, log[-3000:]
        assert said[0]["restart_onto_spare"] is True
        starts = [e for e in events if e["event"] == "workers_started"]
        assert {s["slot"]: s["rank"] for s in starts[-1]["slots"]} == {0: 0, 2: 1}   # rank 1 on the spare slot
    else:
        assert code == 1, log[-3000:]
        assert "--max-restarts N would restart the group onto the spare" in log
