"""Warnings about strangers, said once per source per window with a count (pure but for the injected clock).

A port scan or a misconfigured neighbour can open thousands of connections a minute to a listener (the spare,
the mirror, the agent's port). Each refused connection is worth knowing about, but one console line each
buried the job's own lines (348 warning lines in a minute under a scan). A :class:`Throttle` lets the first
warning of a source through at once and then at most one line per ``window`` seconds, saying how many were
held back since the last line.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable


@dataclasses.dataclass
class _Source:
    said_at: float
    held: int = 0


class Throttle:
    """``check(source)``: None to stay quiet, else the count of warnings held back since the source's last line
    (0 for its first). Sources not heard of for a window are forgotten, so the table stays small."""

    def __init__(self, window: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_sources: int = 4096) -> None:
        self.window = window
        self._clock = clock
        self._max = max_sources
        self._sources: dict[str, _Source] = {}

    def check(self, source: str) -> int | None:
        now = self._clock()
        seen = self._sources.get(source)
        if seen is not None and now - seen.said_at < self.window:
            seen.held += 1
            return None
        held = seen.held if seen is not None else 0
        if seen is None and len(self._sources) >= self._max:
            self._forget(now)
        self._sources[source] = _Source(said_at=now)
        return held

    def _forget(self, now: float) -> None:
        for key in [k for k, s in self._sources.items() if now - s.said_at >= self.window]:
            del self._sources[key]
        while len(self._sources) >= self._max:       # all recent: the oldest goes (bounded memory under a flood)
            del self._sources[next(iter(self._sources))]


def held_note(held: int, window: float) -> str:
    """`` (and 12 more from it in the last 60 s)`` for a line that speaks for warnings held back."""
    return f" (and {held} more from it in the last {window:.0f} s)" if held else ""
