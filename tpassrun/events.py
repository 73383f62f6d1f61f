"""The per-agent event log: one JSON object per line, each with wall and monotonic timestamps.

The log is the record of what the agent decided and when (swap phases, restarts, taints), so tests and
benchmarks read it instead of scraping human log lines.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable


class EventLog:
    def __init__(self, path: str | None, *, node_id: str = "", clock: Callable[[], float] = time.monotonic,
                 echo: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.path = path
        self.node_id = node_id
        self._clock = clock
        self._echo = echo
        self._lock = threading.Lock()
        self._fh = None

    def open(self) -> "EventLog":
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
        return self

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "time": time.time(), "mono": self._clock(), "node": self.node_id, **fields}
        with self._lock:
            if self._fh is not None:
                self._fh.write(json.dumps(record, default=str) + "\n")
        if self._echo is not None:
            self._echo(record)
        return record


def read_events(path: str) -> list[dict[str, Any]]:
    out = []
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out
