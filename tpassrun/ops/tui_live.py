"""The effects around the live view (:mod:`tpassrun.ops.tui`): polling a run, the terminal, keys, the outcome.

``tpassctl status --watch`` runs :func:`watch`: on a terminal a full-screen view (the alternate screen, like
htop), redrawn every ``interval`` seconds and on every key; elsewhere (a pipe, a CI log) one summary line per
change. Either way it returns the run's outcome as an exit code when the run ends:

====  ===========================================================================================
0     the run closed with ``succeeded``
1     the run closed for any other reason (workers failed, ...)
3     the run's etcd stopped answering for ``lost_after`` seconds before a close was seen (a
      ``--standalone`` run takes its etcd with it when it ends) and the launcher's event log (found
      through the run registry) does not say how it ended either
====  ===========================================================================================

Whether to stop is decided by :class:`WatchTracker`, a pure function of what each poll returned and the time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterator, Mapping

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from tpassrun.ops.cleantext import clean
from tpassrun.ops.tui import ViewState, _dict, apply_key, render_status, summary_line

__all__ = ["WatchEnd", "WatchTracker", "outcome_from_event_log", "run_outcome", "terminal_keys", "watch"]

EXIT_LOST = 3


@dataclass(frozen=True)
class WatchEnd:
    """Why the watch stops, and the exit code of ``tpassctl status --watch``."""

    code: int
    message: str


def run_outcome(doc: Mapping[str, Any]) -> WatchEnd | None:
    """The end of the run, if the document shows one: the ``closed`` record or a closed generation."""
    closed = _dict(doc.get("closed"))
    gen = _dict(doc.get("generation"))
    if not closed and gen.get("state") != "closed":
        return None
    reason = str(closed.get("reason") or gen.get("reason") or "closed")
    return WatchEnd(0 if reason == "succeeded" else 1, f"run {doc.get('run_id') or '?'} ended: {reason}")


def outcome_from_event_log(path: str | None) -> WatchEnd | None:
    """The launcher's exit code from its event log (``agent_exit``), for a run whose etcd went away with it
    (``--standalone``) before the watch saw the ``closed`` record. None if unknown."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()[-200:]
    except OSError:
        return None
    import json

    for line in reversed(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "agent_exit" and isinstance(event.get("code"), int):
            code = event["code"]
            return WatchEnd(0 if code == 0 else 1, f"the run ended: its launcher exited with {code} (event log {path})")
    return None


class WatchTracker:
    """Decides, poll by poll, whether the watch goes on. Fetch errors are shown and survived (etcd restarting,
    a partition) until they last ``lost_after`` seconds."""

    def __init__(self, lost_after: float, on_lost: Callable[[], WatchEnd | None] | None = None) -> None:
        self.lost_after = lost_after
        self.on_lost = on_lost     # a second source for the outcome (the launcher's event log)
        self.last_doc: dict[str, Any] | None = None
        self.failing_since: float | None = None

    def update(self, doc: dict[str, Any] | None, error: str | None, now: float) -> WatchEnd | None:
        if doc is not None:
            self.last_doc, self.failing_since = doc, None
            return run_outcome(doc)
        if self.failing_since is None:
            self.failing_since = now
        if self.on_lost is not None and (end := self.on_lost()) is not None:
            return end
        if now - self.failing_since < self.lost_after:
            return None
        last = f"; last seen: {summary_line(self.last_doc)}" if self.last_doc is not None else ""
        return WatchEnd(EXIT_LOST, f"lost the run: no answer for {self.lost_after:g}s ({error}); it has most "
                                   f"likely ended (a --standalone run's etcd ends with it){last}")


def _say(console: Console, text: str) -> None:
    """A plain line after the view (or instead of it, off a terminal), its control characters escaped."""
    console.print(clean(text), markup=False, highlight=False, soft_wrap=True)


async def _poll(fetch: Callable[[], Awaitable[dict[str, Any]]]) -> tuple[dict[str, Any] | None, str | None]:
    """One fetch; a failure (etcd briefly unreachable) is shown, not raised, so the view outlives it."""
    try:
        return await fetch(), None
    except Exception as exc:  # noqa: BLE001 - any fetch error is reported in the view and retried
        return None, clean(f"fetch failed: {type(exc).__name__}: {exc}")


def _split_keys(data: str) -> list[str]:
    """Bytes read from a terminal in cbreak mode -> keys (an escape sequence such as PgDn is one key)."""
    keys: list[str] = []
    i = 0
    while i < len(data):
        if data.startswith("\x1b[", i):
            end = i + 2
            while end < len(data) and not ("@" <= data[end] <= "~"):
                end += 1
            keys.append(data[i:end + 1])
            i = end + 1
        else:
            keys.append(data[i])
            i += 1
    return keys


@contextlib.contextmanager
def terminal_keys(queue: "asyncio.Queue[str]") -> Iterator[bool]:
    """Put stdin (when it is a terminal) in cbreak mode and feed its keys to ``queue``; restore on exit.
    Yields whether keys are read at all."""
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else -1
    if fd < 0:
        yield False
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 64).decode(errors="replace")
        except OSError:
            return
        for key in _split_keys(data):
            queue.put_nowait(key)

    try:
        tty.setcbreak(fd)
        loop.add_reader(fd, readable)
        yield True
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _next_key(queue: "asyncio.Queue[str]", timeout: float) -> str | None:
    if not queue.empty():
        return queue.get_nowait()
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except asyncio.TimeoutError:
        return None


async def watch(fetch: Callable[[], Awaitable[dict[str, Any]]], *, interval: float = 0.5, console: Console | None = None,
                clock: Callable[[], float] = time.time, lost_after: float = 10.0,
                keys: "asyncio.Queue[str] | None" = None, screen: bool = True,
                on_lost: Callable[[], WatchEnd | None] | None = None) -> int:
    """Show the run until it ends (returns its exit code, see the module doc), ``q`` or cancellation.

    ``keys``: where keys come from (default: the terminal's stdin). ``auto_refresh=False`` keeps all drawing
    on this task (rich would otherwise redraw from its own thread while the document changes).
    """
    console = console or Console()
    tracker = WatchTracker(lost_after, on_lost)
    doc: dict[str, Any] | None = None
    error: str | None = None
    end: WatchEnd | None = None
    if not console.is_terminal:
        last = None
        while True:
            doc, error = await _poll(fetch)
            end = tracker.update(doc, error, clock())
            line = error or summary_line(doc or {})
            if line != last:   # off a terminal (a log file): every line says when
                _say(console, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")
                last = line
            if end is not None:
                _say(console, end.message)
                return end.code
            await asyncio.sleep(interval)

    queue: asyncio.Queue[str] = keys if keys is not None else asyncio.Queue()
    view = ViewState()

    def frame() -> RenderableType:
        width, height = console.size
        if doc is None:
            body = Text(error or "waiting for the first status...", style="bold red" if error else "dim")
            return Group(body)
        lines = render_status(doc, now=clock(), width=width, height=height - (1 if error else 0), view=view)
        return Group(lines, Text(error, style="bold red", no_wrap=True, overflow="ellipsis")) if error else lines

    with contextlib.ExitStack() as stack:
        if keys is None:
            stack.enter_context(terminal_keys(queue))
        with Live(get_renderable=frame, console=console, auto_refresh=False, screen=screen,
                  redirect_stdout=False, redirect_stderr=False) as live:
            next_poll = 0.0
            while end is None:
                if time.monotonic() >= next_poll:
                    got, error = await _poll(fetch)
                    doc = got if got is not None else doc
                    end = tracker.update(got, error, clock())
                    next_poll = time.monotonic() + interval
                live.refresh()
                if end is not None:
                    break
                key = await _next_key(queue, max(0.0, next_poll - time.monotonic()))
                if key is not None:
                    view, quit_now = apply_key(view, key)
                    if quit_now:
                        return 0
    # Off the alternate screen: leave the outcome (and the last summary) in the scrollback.
    if doc is not None:
        _say(console, summary_line(doc))
    _say(console, end.message)
    return end.code
