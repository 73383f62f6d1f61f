"""Straggler detection from the per-rank step times the agent already sees. Pure: no clock, no I/O.

Each rank's recent step time is the median of its last ``window`` samples (robust to the odd slow
step: a checkpoint, a GC pause). A rank is *slow* in one observation when that median exceeds
``factor`` times the median of the *other* ranks' medians (comparing against the others, not the
whole set, keeps a 2-rank job meaningful). It is tainted after ``patience`` consecutive slow
observations and cleared after ``patience`` consecutive observations under ``clear_factor``
(hysteresis, default halfway between 1 and ``factor``).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from ._types import STEP_TIME, HealthVerdict, Status, TaintEffect, fmt


@dataclass
class _RankState:
    samples: deque[float]
    slow_streak: int = 0
    fast_streak: int = 0
    tainted: bool = False
    reason: str = ""


@dataclass
class StragglerDetector:
    """Taints a rank that is persistently slower than its peers, with the figures in the reason."""

    factor: float
    window: int = 20
    min_steps: int = 10
    patience: int = 5
    clear_factor: float | None = None
    effect: TaintEffect = TaintEffect.MIGRATE
    _ranks: dict[int, _RankState] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError(f"straggler factor must be > 1, got {self.factor}")
        if self.window < 1 or self.min_steps < 1 or self.patience < 1:
            raise ValueError("straggler window, min_steps and patience must be >= 1")
        if self.min_steps > self.window:
            raise ValueError(f"min_steps ({self.min_steps}) cannot exceed window ({self.window})")
        if self.clear_factor is None:
            self.clear_factor = 1 + (self.factor - 1) / 2
        if not 1 <= self.clear_factor <= self.factor:
            raise ValueError(f"clear_factor must be within [1, factor], got {self.clear_factor}")

    def forget(self, rank: int) -> None:
        """Drop a rank's history (its slot changed: a swap put another process behind the rank)."""
        self._ranks.pop(rank, None)

    def observe(self, step_times: Mapping[int, float | None], now: float) -> list[HealthVerdict]:
        """Add one step time per rank (None: no new step since); return a verdict for every rank in ``step_times``."""
        for rank, seconds in step_times.items():
            state = self._ranks.get(rank)
            if state is None:
                state = self._ranks[rank] = _RankState(deque(maxlen=self.window))
            if seconds is not None and seconds >= 0:
                state.samples.append(float(seconds))
        ready = {r: statistics.median(self._ranks[r].samples) for r in step_times
                 if len(self._ranks[r].samples) >= self.min_steps}
        return [self._judge(rank, ready, now) for rank in sorted(step_times)]

    def _judge(self, rank: int, ready: dict[int, float], now: float) -> HealthVerdict:
        state, device = self._ranks[rank], f"rank{rank}"
        if rank not in ready:
            return HealthVerdict(device, Status.UNKNOWN, TaintEffect.NONE,
                                 f"warming up: {len(state.samples)}/{self.min_steps} step times", STEP_TIME, now)
        peers = [median for other, median in ready.items() if other != rank]
        if not peers:
            return HealthVerdict(device, Status.UNKNOWN, TaintEffect.NONE,
                                 "no peer with enough step times to compare against", STEP_TIME, now)
        mine, reference = ready[rank], statistics.median(peers)
        ratio = mine / reference if reference > 0 else (float("inf") if mine > 0 else 1.0)
        figures = (f"rank {rank} median step {fmt(mine)}s over its last {len(state.samples)} steps is "
                   f"{fmt(ratio)}x the median of {len(peers)} other rank(s) ({fmt(reference)}s)")
        if ratio > self.factor:
            state.slow_streak, state.fast_streak = state.slow_streak + 1, 0
        elif ratio < self.clear_factor:  # type: ignore[operator]
            state.fast_streak, state.slow_streak = state.fast_streak + 1, 0
        else:
            # In the hysteresis band: neither confirms slowness nor recovery.
            state.slow_streak = state.fast_streak = 0
        if not state.tainted and state.slow_streak >= self.patience:
            state.tainted = True
            state.reason = f"straggler: {figures}; above {fmt(self.factor)}x for {state.slow_streak} checks"
        elif state.tainted and state.fast_streak >= self.patience:
            state.tainted, state.reason = False, ""
        if state.tainted:
            status = Status.FAILING if self.effect is TaintEffect.FAIL else Status.DEGRADED
            return HealthVerdict(device, status, self.effect, state.reason, STEP_TIME, now)
        return HealthVerdict(device, Status.HEALTHY, TaintEffect.NONE, figures, STEP_TIME, now)
