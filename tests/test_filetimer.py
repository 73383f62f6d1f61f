"""torchrun's file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``) as tpassrun's agent serves it (issue 30).

The expiry rule is pure (``expired``); the server is a real named pipe in a real event loop reaping a real
process; the end-to-end test runs torch's own ``FileTimerClient`` under ``python -m tpassrun``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from tpassrun.launch.filetimer import FileTimerServer, TimerRequest, expired, register

pytestmark = pytest.mark.timeout(300)


def test_register_acquire_release_and_the_expiry_rule():
    timers: dict = {}
    register(timers, [TimerRequest(1, "a", 10.0, 9), TimerRequest(1, "b", 5.0, 0), TimerRequest(2, "a", 20.0, 15)])
    assert expired(timers, 4.0) == {}
    # pid 1: "b" expired first but has no signal; "a" (the first with one) reaps it
    assert expired(timers, 12.0) == {1: TimerRequest(1, "a", 10.0, 9)}
    register(timers, [TimerRequest(1, "a", -1, 0)])   # a release
    assert expired(timers, 12.0) == {1: None}          # only the signal-less timer left: nothing is sent
    assert expired(timers, 30.0)[2].signal == 15


def test_torchs_client_lines_are_understood():
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest

    line = FileTimerRequest(worker_pid=42, scope_id="s", expiration_time=12.5, signal=9).to_json()
    assert TimerRequest.from_line(line) == TimerRequest(42, "s", 12.5, 9)


def _send(path: str, request: TimerRequest) -> None:
    """What ``FileTimerClient._send_request`` does: a non-blocking open for writing, one line, close."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "wt") as f:
        f.write(f'{{"version": 1, "pid": {request.pid}, "scope_id": "{request.scope_id}", '
                f'"expiration_time": {request.expiration_time}, "signal": {request.signal}}}\n')


def test_server_reaps_an_expired_worker_and_only_its_own(tmp_path):
    path = str(tmp_path / "watchdog_timer_x")
    worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    seen: list[tuple[TimerRequest, bool]] = []

    async def main() -> None:
        server = FileTimerServer(path, allowed=lambda pid: pid == worker.pid,
                                 on_expired=lambda r, sent: seen.append((r, sent))).start()
        try:
            assert os.path.exists(path) and oct(os.stat(path).st_mode & 0o777) == "0o600"
            _send(path, TimerRequest(worker.pid, "step", time.time() + 0.3, signal.SIGKILL))
            _send(path, TimerRequest(worker.pid, "released", time.time() + 0.3, signal.SIGKILL))
            _send(path, TimerRequest(worker.pid, "released", -1, 0))
            _send(path, TimerRequest(stranger.pid, "x", time.time() + 0.3, signal.SIGKILL))
            for _ in range(600):
                if worker.poll() is not None and len(seen) == 2:
                    break
                await asyncio.sleep(0.05)
        finally:
            await server.stop()

    try:
        asyncio.run(main())
        assert worker.wait(10) == -signal.SIGKILL
        assert stranger.poll() is None          # not this agent's: never signalled
        assert sorted((r.scope_id, sent) for r, sent in seen) == [("step", True), ("x", False)]
        assert not os.path.exists(path)         # the pipe goes with the server
    finally:
        for p in (worker, stranger):
            p.kill()
            p.wait()


SCRIPT = """
import os, sys, time
from torch.distributed.elastic.timer import FileTimerClient, configure, expires
configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print("timer file", os.environ["TORCHELASTIC_TIMER_FILE"], "attempt", attempt, flush=True)
with expires(after=5, scope="step"):
    if os.environ["RANK"] == "1" and attempt == "0":
        time.sleep(600)   # hung: the timer's SIGKILL ends it
print("rank", os.environ["RANK"], "done in attempt", attempt, flush=True)
"""


@pytest.mark.e2e
def test_an_expired_timer_kills_the_worker_and_the_group_restarts(tmp_path):
    """torchrun 2.13 SIGKILLs the worker, then its own agent (exit 137, the other workers left running); tpassrun
    kills the worker and takes the usual path: here a whole-group restart (--max-restarts 1), which succeeds."""
    script = tmp_path / "timer_job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "PET_", "TPASSRUN_"))}
    env.update(TORCHELASTIC_ENABLE_FILE_TIMER="1", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "tpassrun", "--nproc-per-node", "2", "--max-restarts", "1",
                           "--event-log", str(tmp_path / "events.jsonl"), str(script)],
                          env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "rank 0 done in attempt 1" in out and "rank 1 done in attempt 1" in out
    assert "rank 1 done in attempt 0" not in out
    files = {line.split()[2] for line in out.splitlines() if line.startswith("timer file")}
    # one pipe per group of workers started, as torchrun's (a new <tmp>/watchdog_timer_<uuid4> each time)
    assert len(files) == 2 and all(os.path.basename(f).startswith("watchdog_timer_") for f in files)
    assert not any(os.path.exists(f) for f in files)
    assert "file timer 'step' expired: sent SIGKILL" in proc.stderr
