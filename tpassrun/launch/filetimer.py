"""torchrun's file-based watchdog (``TORCHELASTIC_ENABLE_FILE_TIMER=1``), served without torch.

torchrun's agent runs torch's ``FileTimerServer`` on a named pipe for each group of workers it starts and gives
them its path as ``TORCHELASTIC_TIMER_FILE`` (``$TORCHELASTIC_TIMER_FILE`` if the agent was given one, else
``<tmp>/watchdog_timer_<uuid4>``, a new one per start); a worker's ``FileTimerClient`` writes one JSON line per
``acquire``/``release`` (``{"version": 1, "pid", "scope_id", "expiration_time", "signal"}``, a negative
expiration time is a release). When a timer expires the server sends the timer's signal (SIGKILL by default) to
that pid (agent/server/local_elastic_agent.py ``_setup_local_watchdog``, timer/file_based_local_timer.py).

This module speaks the same wire format from the agent's event loop, so a script using ``FileTimerClient`` sees
exactly torchrun's pipe, and the launcher still never imports torch (torch's server would also SIGKILL its own
process, the whole torchrun agent, after reaping a worker: torchrun 2.13 exits 137 and leaves the other workers
running; here the reaped worker's exit takes the agent's usual failure path). The expiry rule is
:func:`expired`, pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal as _signal
import stat
import time
from collections.abc import Callable, Mapping

from tpassrun.rendezvous import pid_alive

log = logging.getLogger("tpassrun.launch.filetimer")

MAX_INTERVAL_S = 0.1   # torchrun's agent starts its server with max_interval=0.1


@dataclasses.dataclass(frozen=True)
class TimerRequest:
    """One line a ``FileTimerClient`` wrote (torch's ``FileTimerRequest``)."""

    pid: int
    scope_id: str
    expiration_time: float   # wall clock (time.time()); < 0: a release
    signal: int

    @classmethod
    def from_line(cls, line: str) -> "TimerRequest":
        d = json.loads(line)
        return cls(int(d["pid"]), str(d["scope_id"]), float(d["expiration_time"]), int(d["signal"]))


Timers = dict[tuple[int, str], TimerRequest]


def register(timers: Timers, requests: list[TimerRequest]) -> None:
    """torch's ``register_timers``: an acquire sets (pid, scope), a release removes it."""
    for r in requests:
        if r.expiration_time < 0:
            timers.pop((r.pid, r.scope_id), None)
        else:
            timers[(r.pid, r.scope_id)] = r


def expired(timers: Mapping[tuple[int, str], TimerRequest], now: float) -> dict[int, TimerRequest | None]:
    """The pids to reap at ``now`` and the timer that reaps each: the earliest expired one with a signal > 0 (None:
    its expired timers have no signal, nothing is sent), as torch's ``_run_watchdog``."""
    by_pid: dict[int, list[TimerRequest]] = {}
    for r in timers.values():
        if r.expiration_time <= now:
            by_pid.setdefault(r.pid, []).append(r)
    return {pid: next((r for r in sorted(rs, key=lambda r: r.expiration_time) if r.signal > 0), None)
            for pid, rs in by_pid.items()}


class FileTimerServer:
    """The named pipe and its timers for one group of workers: :meth:`start` when they start, :meth:`stop` when
    they stop (torchrun's lifetime). ``allowed(pid)`` says whether a pid is this agent's to signal (a worker or a
    process of its session); ``on_expired(request, sent)`` is told of each expired timer that was acted on."""

    def __init__(self, path: str, *, allowed: Callable[[int], bool],
                 on_expired: Callable[[TimerRequest, bool], None]) -> None:
        self.path = path
        self._allowed = allowed
        self._on_expired = on_expired
        self._timers: Timers = {}
        self._fd: int | None = None
        self._buf = b""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> "FileTimerServer":
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISFIFO(os.lstat(self.path).st_mode) or os.path.isfile(self.path):
                os.remove(self.path)   # torch's server replaces what is there
        os.mkfifo(self.path, 0o600)
        # read-write: this end never sees end-of-file when the last client closes (a reader alone would spin)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        loop = asyncio.get_running_loop()
        loop.add_reader(self._fd, self._readable)
        self._task = asyncio.ensure_future(self._watch())
        log.debug("file timer server on %s", self.path)
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def _readable(self) -> None:
        assert self._fd is not None
        try:
            chunk = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        *lines, self._buf = (self._buf + chunk).split(b"\n")
        requests = []
        for line in lines:
            try:
                requests.append(TimerRequest.from_line(line.decode()))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("file timer: ignoring a malformed request %r: %s", line[:200], exc)
        register(self._timers, requests)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(MAX_INTERVAL_S)
            self.reap(time.time())

    def reap(self, now: float) -> None:
        reaped = set()
        for pid, request in expired(self._timers, now).items():
            reaped.add(pid)
            if request is None:
                continue
            sent = False
            if self._allowed(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, request.signal)
                    sent = True
            else:
                log.warning("file timer: pid %d is not a worker of this agent; not sending it signal %d", pid,
                            request.signal)
            self._on_expired(request, sent)
        for key in list(self._timers):
            if key[0] in reaped or not pid_alive(key[0]):
                del self._timers[key]


def signal_name(sig: int) -> str:
    with contextlib.suppress(ValueError):
        return _signal.Signals(sig).name
    return str(sig)
