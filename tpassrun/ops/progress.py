"""How far this node's ranks have trained in a run of workers, and what a whole-group restart cost in steps (pure).

A whole-group restart (torchrun's answer to every failure, tpassrun's fallback) throws away the progress made
since the script's last checkpoint: the new workers start again from the step the script resumes at, and every
step between it and the highest step reached before is run again. The agent cannot know the script's checkpoints,
but it sees the step each managed rank runs (the shared-memory channel): the highest step reached in one group of
workers and the first step the next group runs give the steps redone, and the last step times give what they
cost. Read on the status loop the agent already runs (once a second), never on a worker's step.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class RankPosition:
    """One managed rank as the channel shows it: the step it runs and its last step time."""

    step: int
    running: bool          # phase RUNNING (a step is being executed; not starting, paused or a spare)
    last_step_ms: float = 0.0
    run_from: int = -1     # the step its run() started at (-1: not known)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The first running step of a group of workers started after a whole-group restart."""

    step: int              # the step the restarted script resumed at
    reached: int           # the highest step the group before it had reached (-1: never ran a managed step)
    redone: int            # steps run again: progress since the script's last checkpoint
    redone_s: float        # what those steps cost, at the group before's step time


@dataclasses.dataclass
class Progress:
    """The highest step and step time of the current group of workers; what the next one redoes.

    ``started(after_restart)`` opens a group; ``note(ranks)`` returns a :class:`Resumed` once, at the first
    running step of a group opened after a restart."""

    high: int = -1
    step_ms: float = 0.0
    _before: tuple[int, float] | None = None    # (high, step_ms) of the group a restart ended
    _said: bool = True

    def started(self, after_restart: bool) -> None:
        self._before = (self.high, self.step_ms) if after_restart else None
        self._said = not after_restart
        self.high, self.step_ms = -1, 0.0

    def ended(self, ranks: Iterable[RankPosition]) -> None:
        """The group's workers are gone: the last step each showed counts, whatever its phase (the status loop
        samples once a second; a rank killed inside a step still shows that step)."""
        self.high = max([self.high, *(r.step for r in ranks)])

    def note(self, ranks: Iterable[RankPosition]) -> Resumed | None:
        running = [r for r in ranks if r.running]
        if not running:
            return None
        self.high = max(self.high, max(r.step for r in running))
        times = [r.last_step_ms for r in running if r.last_step_ms > 0]
        if times:
            self.step_ms = sorted(times)[len(times) // 2]
        if self._said or self._before is None:
            return None
        self._said = True
        reached, ms = self._before
        first = min(r.run_from if r.run_from >= 0 else r.step for r in running)
        redone = max(0, reached - first) if reached >= 0 else 0
        return Resumed(step=first, reached=reached, redone=redone, redone_s=redone * ms / 1000.0)
