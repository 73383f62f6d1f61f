"""The per-agent event log: one JSON object per line, each with wall and monotonic timestamps.

The log is the record of what the agent decided and when (swap phases, restarts, taints), so tests and
benchmarks read it instead of scraping human log lines. Every event also goes to the listeners: the console
(:mod:`tpassrun.console`, one line per event and the exit summary) and the metrics (:mod:`tpassrun.metrics`).

Writing an event never raises into the agent: a full disk or a listener's bug mid-swap is reported once on
stderr and the log degrades (the file is given up, the console and metrics go on), the job goes on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

Listener = Callable[[dict[str, Any]], None]
log = logging.getLogger("tpassrun.events")


class EventLog:
    def __init__(self, path: str | None, *, node_id: str = "", clock: Callable[[], float] = time.monotonic,
                 echo: Listener | None = None) -> None:
        self.path = path
        self.node_id = node_id
        self._clock = clock
        self._listeners: list[Listener] = [echo] if echo is not None else []
        self._lock = threading.Lock()
        self._fh = None
        self.write_error: str | None = None      # why the file was given up, once it was
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
            if self._fh is not None:
                try:
                    self._fh.write(json.dumps(record, default=str) + "\n")
                except (OSError, ValueError) as exc:   # ENOSPC, EIO, a closed file
                    self._give_up(exc)
        for i, listener in enumerate(self._listeners):
            try:
                listener(record)
            except Exception as exc:  # noqa: BLE001 - an observer never breaks what it observes
                if i not in self._listener_errors:
                    self._listener_errors.add(i)
                    log.warning("event listener %r failed (reported once): %s: %s", listener, type(exc).__name__, exc)
        return record

    def _give_up(self, exc: BaseException) -> None:
        self.write_error = f"{type(exc).__name__}: {exc}"
        fh, self._fh = self._fh, None
        try:
            fh.close()   # type: ignore[union-attr]
        except (OSError, ValueError):
            pass
        print(f"tpassrun: warning: cannot write the event log {self.path} ({self.write_error}); "
              "events go on to the console only, the job goes on", file=sys.stderr, flush=True)


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
