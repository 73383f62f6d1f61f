"""``tpassctl``'s word while it cannot reach etcd: "waiting for etcd at X (N s)" on stderr from the first second.

An unreachable etcd gave seconds of silence (60 s before ``read_timeout`` was lowered) and then the error. Now,
from the first second until the first answer: on a terminal one line, rewritten in place each second; off a
terminal one line every :data:`EVERY_OFF_TTY_S`. The error at the timeout is unchanged; it starts on a line of
its own. :func:`due` (when to say it) is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any, Callable

from tpassrun.ops.cleantext import clean

FIRST_S = 1.0            # said from this long on (a reachable etcd answers well within it)
EVERY_OFF_TTY_S = 3.0    # off a terminal: one line this often (a log, a CI job)


def due(elapsed: float, last: float | None, tty: bool) -> bool:
    """Whether to say it at ``elapsed`` seconds, the last time said at ``last`` (``None``: never yet)."""
    if elapsed < FIRST_S:
        return False
    if last is None:
        return True
    return elapsed - last >= (1.0 if tty else EVERY_OFF_TTY_S)


class EtcdWait:
    """``async with EtcdWait(display) as w: ...; w.reached()``: the waiting line until ``reached()``."""

    def __init__(self, display: str, *, stream: Any = None, clock: Callable[[], float] = time.monotonic,
                 tick: float = 0.25) -> None:
        self.display = display
        self.stream = stream if stream is not None else sys.stderr
        self._clock = clock
        self._tick = tick
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._open_line = False        # a tty line written without its newline
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "EtcdWait":
        self._task = asyncio.ensure_future(self._say(self._clock()))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._stop(clear=exc[0] is None)

    def reached(self) -> None:
        """etcd answered: no more waiting lines (a tty's line is wiped)."""
        self._stop(clear=True)

    def _stop(self, *, clear: bool) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._open_line:
            self._write("\r\033[K" if clear else "\n")
            self._open_line = False

    async def _say(self, start: float) -> None:
        last: float | None = None
        while True:
            elapsed = self._clock() - start
            if due(elapsed, last, self._tty):
                last = elapsed
                text = clean(f"tpassctl: waiting for etcd at {self.display} ({elapsed:.0f} s)")
                if self._tty:
                    self._write(f"\r\033[K{text}")
                    self._open_line = True
                else:
                    self._write(text + "\n")
            await asyncio.sleep(self._tick)

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()
