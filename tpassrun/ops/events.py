"""The per-agent event log: one JSON object per line, each with wall and monotonic timestamps.

The log is the record of what the agent decided and when (swap phases, restarts, taints), so tests and
benchmarks read it instead of scraping human log lines. Every event also goes to the listeners: the console
(:mod:`tpassrun.ops.console`, one line per event and the exit summary) and the metrics (:mod:`tpassrun.ops.metrics`).

Writing an event never raises into the agent: a full disk or a listener's bug mid-swap is reported once on
stderr and the log degrades (the file is given up, the console and metrics go on), the job goes on; the file is
tried again every few seconds and, once it takes writes again (the disk freed), an ``event_log_gap`` record
says how many events it missed, and stderr says once that it is back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, TextIO

Listener = Callable[[dict[str, Any]], None]
RETRY_S = 5.0     # a given-up event log file is tried again this often
log = logging.getLogger("tpassrun.ops.events")


class EventLog:
    def __init__(self, path: str | None, *, node_id: str = "", clock: Callable[[], float] = time.monotonic,
                 echo: Listener | None = None) -> None:
        self.path = path
        self.node_id = node_id
        self._clock = clock
        self._listeners: list[Listener] = [echo] if echo is not None else []
        self._lock = threading.Lock()
        self._fh: TextIO | None = None
        self.write_error: str | None = None      # why the file was given up, while it is
        self._down: list[float] = []             # while given up: [since, last try, events dropped]
        self._listener_errors: set[int] = set()

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def open(self) -> "EventLog":
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
        return self

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass   # the last buffered line of a full disk: already reported, or nothing to report

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": time.time(), "mono": self._clock(), "node": self.node_id, **fields}
        with self._lock:
            if self._fh is None and self._down:
                self._try_again()
            if self._fh is not None:
                try:
                    self._fh.write(json.dumps(record, default=str) + "\n")
                except (OSError, ValueError) as exc:   # ENOSPC, EIO, a closed file
                    self._give_up(exc)
            elif self._down:
                self._down[2] += 1
        for i, listener in enumerate(self._listeners):
            try:
                listener(record)
            except Exception as exc:  # noqa: BLE001 - an observer never breaks what it observes
                if i not in self._listener_errors:
                    self._listener_errors.add(i)
                    log.warning("event listener %r failed (reported once): %s: %s", listener, type(exc).__name__, exc)
        return record

    def _give_up(self, exc: BaseException) -> None:
        fh, self._fh = self._fh, None
        try:
            fh.close()   # type: ignore[union-attr]  # only called while a file is open
        except (OSError, ValueError):
            pass
        now = self._clock()
        if self._down:          # a retry that failed again: said already
            self._down[1] = now
            self._down[2] += 1
            return
        self.write_error = f"{type(exc).__name__}: {exc}"
        self._down = [now, now, 1]
        print(f"tpassrun: warning: cannot write the event log {self.path} ({self.write_error}); "
              f"events go on to the console only (trying the file again every {RETRY_S:g} s), the job goes on",
              file=sys.stderr, flush=True)

    def _try_again(self) -> None:
        """Every RETRY_S while given up: reopen the file (a full disk freed); said once when it works again."""
        since, last, dropped = self._down
        if self._clock() - last < RETRY_S or not self.path:
            return
        gap = {"event": "event_log_gap", "time": time.time(), "mono": self._clock(), "node": self.node_id,
               "dropped": int(dropped), "error": self.write_error}
        try:
            fh = open(self.path, "a", buffering=1)
        except OSError:
            self._down[1] = self._clock()
            return
        try:
            fh.write(json.dumps(gap, default=str) + "\n")     # line-buffered: written (or refused) here
        except (OSError, ValueError):
            self._down[1] = self._clock()
            with contextlib.suppress(OSError, ValueError):
                fh.close()
            return
        self._fh, self._down = fh, []
        print(f"tpassrun: the event log {self.path} is written again ({int(dropped)} event(s) dropped over "
              f"{self._clock() - since:.0f} s)", file=sys.stderr, flush=True)
        self.write_error = None


def read_events(path: str) -> list[dict[str, Any]]:
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue   # a torn last line (the agent was killed mid-write, or the disk filled up)
    return out
