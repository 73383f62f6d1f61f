"""Fault points for tests and benchmarks (no effect unless ``TPASSRUN_FAULTS`` is set).

Off the production path: tpassrun's own fault points are guarded by :data:`ENABLED` (read once, when the
module is imported, from the environment a worker was started with), so a job without ``TPASSRUN_FAULTS``
pays one attribute read at the two places a transfer could be faulted, and nothing per step.

A training script calls :func:`fault_point` at interesting places (``tpassrun``'s example does so in the
step loop and inside backward). ``TPASSRUN_FAULTS`` holds a JSON list of faults; each fires at most once
per job, across processes, thanks to a marker file, so a joiner that re-executes the same step does not
trip over the fault that killed its predecessor::

    [{"rank": 1, "step": 7, "where": "backward", "action": "kill", "marker": "/tmp/f1"}]

Actions: ``kill`` (SIGKILL self), ``kill_node`` (SIGKILL the agent that started this worker, then self: the
whole node dies at that point, its other workers with it), ``stop`` (SIGSTOP self: a hang), ``exit`` (``os._exit(code)``),
``sleep`` (``seconds``: a straggler, every step from ``step`` on, no marker needed; with ``unless``, only while
that file does not exist: a harness slows a job's last steps down until it is done with it), ``raise``, ``hold``
(wait until the file ``release`` exists: lets a test line up a spare or a taint at an exact step), ``fail`` (a
collective failing here: wait until the process that claimed the marker ``after`` is dead, then raise
``torch.distributed.DistError``, as a collective with that dead rank would; with ``synced`` after a step's
all-reduce it stages a mixed commit: this rank did not complete the collective, the others did).
``"any_step": true`` fires at the first step that reaches the point (with a marker a harness deletes to arm
it: ``tests/faults.py``'s ``FaultSwitches``). tpassrun's own points: ``send``, ``receive``, ``reform``, ``join``
(in a swap), ``spare_start`` (a warm spare before it says hello, as rank -1: a spare slow to start) and
``loaded`` (``"action": "corrupt"``: a rank that has just loaded its state in a swap or recovery flips one bit of
one tensor of it, ``"tensor"`` names which, e.g. ``"model.fc1.weight"``, else its first; the replica check after
the recovery must catch it, ``tpassrun/worker/replicas.py``). Staged by tpassrun itself (:func:`wants`):
``send``/``corrupt`` (a byte of the next transfer flipped) and ``send``/``cut_handshake`` (the next transfer's
first connection cut after 18 of the proof's 68 bytes).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from typing import Any

FAULTS_ENV = "TPASSRUN_FAULTS"
ENABLED = bool(os.environ.get(FAULTS_ENV))


@functools.lru_cache(maxsize=1)
def _faults() -> tuple[dict[str, Any], ...]:
    raw = os.environ.get(FAULTS_ENV)
    return tuple(json.loads(raw)) if raw else ()


def _claim(marker: str | None) -> bool:
    if not marker:
        return True
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    # pid and wall time: a file's mtime can be several ms coarse here, which benches timing a kill cannot afford
    os.write(fd, f"{os.getpid()} {time.time():.6f}".encode())
    os.close(fd)
    return True


def wants(rank: int, step: int, where: str, action: str) -> bool:
    """True (once, by marker) when a fault of ``action`` is scheduled here; the caller performs it.

    Used inside tpassrun for faults only it can stage, e.g. ``{"where": "send", "action": "corrupt"}`` flips a
    byte of the next state transfer of ``rank``.
    """
    return claim(rank, step, where, action) is not None


def claim(rank: int, step: int, where: str, action: str) -> dict[str, Any] | None:
    """:func:`wants`, returning the fault itself (its other fields say how), or None."""
    for f in _faults():
        if (f.get("where") == where and f.get("action") == action and int(f.get("rank", -1)) == rank
                and int(f.get("step", step)) <= step and _claim(f.get("marker"))):
            return dict(f)
    return None


def fault_point(rank: int, step: int, where: str = "step") -> None:
    for f in _faults():
        if f.get("where", "step") != where or int(f.get("rank", -1)) != rank:
            continue
        action = f.get("action", "kill")
        if action == "sleep":
            if step >= int(f.get("step", 0)) and step < int(f.get("until", 1 << 62)) \
                    and not (f.get("unless") and os.path.exists(f["unless"])):
                time.sleep(float(f.get("seconds", 0.1)))
            continue
        if (not f.get("any_step") and step != int(f.get("step", -1))) or not _claim(f.get("marker")):
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "kill_node":
            os.kill(os.getppid(), signal.SIGKILL)     # the agent; the node's other workers follow it (PDEATHSIG)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "exit":
            os._exit(int(f.get("code", 1)))
        elif action == "hold":
            while not os.path.exists(f["release"]):
                time.sleep(0.02)
        elif action == "raise":
            raise RuntimeError(f"injected fault at rank {rank} step {step}")
        elif action == "fail":
            _wait_dead(f.get("after"), float(f.get("timeout", 60)))
            import torch.distributed as dist

            raise dist.DistError(f"injected: a collective failed at rank {rank} step {step} (a peer died)")


def _wait_dead(marker: str | None, timeout: float) -> None:
    """Until the process that claimed ``marker`` (its pid is the file's first word) is gone or a zombie."""
    deadline = time.monotonic() + timeout
    while marker and time.monotonic() < deadline:
        try:
            with open(marker) as fh:
                pid = int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            time.sleep(0.005)
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except (OSError, IndexError):
            return
        time.sleep(0.005)
