"""How often sharded state is refreshed (``--shard-mirror-interval``): a fixed K, or ``auto`` (the default).

A refresh (:mod:`tpassrun.worker.shards`) costs a healthy step little on its own thread (the ``state_dict()`` calls), but
it costs CPU in the background: the copy, the frame and its MAC, the socket, and the receiving agent's side. On a
host whose cores all compute (a CPU job; a GPU host whose data loaders use every core) that CPU is taken from the
step. ``auto`` bounds it: the first :data:`DECIDE_STEP` - 1 steps refresh every step and measure what a refresh
costs (CPU of the training thread's part, the copy thread, the pusher thread, and as much again for the receiver)
and how long a step takes (the shortest one); at step :data:`DECIDE_STEP` the rank picks the smallest K that keeps
the amortized cost
within :data:`BUDGET` of a step (at most :data:`MAX_INTERVAL`): :func:`choose`.

Every rank must refresh at the same steps (a recovery needs a step that the survivors' local copies and the lost
rank's mirror both hold), so the ranks agree on one K: at the :data:`DECIDE_STEP`-th step they run (step 8 of a
fresh run; a script resumed from its checkpoint counts from its first step) each one proposes its K to the world's
store with a compare-and-set, and the first proposal wins for all (one store round trip, once). In a re-formed
world (each has a store prefix of its own) the survivors write K there, or, not decided yet, the step at which
they will decide; a joiner reads it at its first step and adopts K, or decides with them at that step. A rank
that cannot reach the store refreshes every step and says so.
"""

from __future__ import annotations

import logging
import math
import statistics
from datetime import timedelta
from typing import Any, Sequence

log = logging.getLogger(__name__)

AUTO = "auto"
DECIDE_STEP = 8         # steps 1..7 refresh every step and measure; K is fixed at this step's start
MAX_INTERVAL = 16       # the most steps an unplanned recovery recomputes is MAX_INTERVAL - 1
BUDGET = 0.01           # the background CPU of refreshes, amortized, as a fraction of the step time
RECEIVER_FACTOR = 1.0   # the receiving agent's CPU per refresh, relative to the pusher's (recv, tag, store)
STORE_KEY = "tpassrun/shard_mirror_interval"
FETCH_TIMEOUT_S = 60.0
_PENDING = "pending:"


def parse(raw: str | int | None) -> int | None:
    """``--shard-mirror-interval``'s value -> K (0: off), or None for ``auto``. Raises ValueError."""
    if raw is None or (isinstance(raw, str) and raw.strip().lower() == AUTO):
        return None
    value = int(raw)
    if value < 0:
        raise ValueError(f"must be >= 0 or {AUTO!r} (got {raw})")
    return value


def choose(refresh_cpu_s: Sequence[float], step_s: Sequence[float]) -> tuple[int, str]:
    """Pure: K from the measured background CPU of a refresh (the median) and the step time (the shortest: a step
    slowed by a passing load on the host says nothing of what a refresh takes from an unloaded one), and why."""
    if not refresh_cpu_s or not step_s:
        return 1, "nothing measured"
    cost, step = statistics.median(refresh_cpu_s), min(step_s)
    if step <= 0:
        return 1, "no step time"
    k = min(MAX_INTERVAL, max(1, math.ceil(cost / (BUDGET * step) - 1e-9)))
    return k, (f"a refresh costs {cost * 1e3:.2f} ms of background CPU, a step takes {step * 1e3:.1f} ms: every {k} "
               f"step(s) keeps it at {cost / k / step * 100:.2f}% of a step")


def _default_store() -> Any:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return c10d._get_default_store()


class IntervalPolicy:
    """One rank's refresh interval: fixed, or ``auto`` (measured, then agreed; see the module docstring).
    ``store``: a ``torch.distributed.Store`` (tests); None: the default group's, looked up when needed."""

    def __init__(self, raw: str | int | None, store: Any = None) -> None:
        fixed = parse(raw)
        self.auto = fixed is None
        self.interval = 1 if fixed is None else fixed
        self.decided = not self.auto
        self.why = "" if self.auto else "fixed by --shard-mirror-interval"
        self._store = store
        self._costs: list[float] = []
        self._steps: list[float] = []
        self._last: tuple[int, float] | None = None
        self.decide_at: int | None = None   # the step K is agreed at (the DECIDE_STEP-th this process runs)
        self.joiner = False                 # set by a joiner's session: it reads K (or decide_at) from the survivors
        self._pending = ""                  # the store's value before the agreement ("" in a world's first run)
        self._was_joiner = False

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def joined(self) -> None:
        """This process joined a running world (a spare that took a rank): at its next step it reads K, or when
        the survivors will decide it, from them (once)."""
        if not self._was_joiner:
            self._was_joiner = self.joiner = True

    def store(self) -> Any:
        return self._store if self._store is not None else _default_store()

    # --- measuring ---
    def step_started(self, step: int, now: float) -> None:
        if self.decide_at is None:
            self.decide_at = step + DECIDE_STEP - 1    # a script resumed from its checkpoint starts past step 1
        if self.auto and self._last is not None and step > self._last[0]:
            # per step: under gradient accumulation only a window's first step is seen (a copy is a window's start)
            self._steps.append((now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)

    def refresh_cost(self, cpu_s: float) -> None:
        if self.auto and not self.decided:
            self._costs.append(cpu_s)

    # --- deciding ---
    def due(self, step: int) -> bool:
        """Whether ``step`` is a refresh step (deciding K first, at the :data:`DECIDE_STEP`-th step run)."""
        if self.auto:
            if self.joiner and not self.decided:
                self.joiner = False
                self._fetch()                  # what the survivors decided, or when they will decide
            # (or the first step seen past it: under gradient accumulation only windows' first steps are seen;
            # every rank sees the same ones)
            if step == self.decide_at or (not self.decided and self.decide_at is not None and step > self.decide_at):
                self._agree()
        return self.enabled and step % self.interval == 0

    def _agree(self) -> None:
        if self.decided:
            proposal, why = self.interval, self.why        # re-executing this step in a re-formed world
        else:
            # the first refreshes are a process's warm-up: measure the later ones
            proposal, why = choose(self._costs[2:] or self._costs, self._steps[2:] or self._steps)
        try:
            store = self.store()
            agreed = proposal if store is None else int(store.compare_set(STORE_KEY, self._pending, str(proposal)))
        except Exception as exc:  # noqa: BLE001 - no store: refresh every step, as a fixed K = 1 would
            log.warning("cannot agree on a shard mirror interval with the other ranks (%s): refreshing every step",
                        exc)
            agreed, why = 1, f"no agreement ({exc})"
        self._set(agreed, why if agreed == proposal else f"agreed with the other ranks (this one proposed {proposal})")

    def _fetch(self) -> None:
        """A joiner: the survivors wrote K, or ``pending:<step>`` (they decide at that step: so does it)."""
        try:
            store = self.store()
            if store is None:
                raise RuntimeError("no process group")
            store.wait([STORE_KEY], timedelta(seconds=FETCH_TIMEOUT_S))
            value = store.get(STORE_KEY).decode()
            if value.startswith(_PENDING):
                at = int(value[len(_PENDING):])
                self._pending, self.decide_at = value, (at if at >= 0 else self.decide_at)
                return
            agreed, why = int(value), "the interval the other ranks agreed on"
        except Exception as exc:  # noqa: BLE001 - as above
            log.warning("cannot read the shard mirror interval the other ranks use (%s): refreshing every step", exc)
            agreed, why = 1, f"no agreement ({exc})"
        self._set(agreed, why)

    def _set(self, k: int, why: str) -> None:
        self.interval, self.why, self.decided = max(1, min(MAX_INTERVAL, k)), why, True
        log.info("shard mirror interval: every %d step(s): %s", self.interval, why)

    def after_reform(self) -> None:
        """In a re-formed world (a survivor): write K under the new world's store prefix for the joiners, or, not
        decided yet, the step at which every rank will decide it."""
        if not self.auto:
            return
        # not started yet (re-formed before its first step): -1, everyone decides at the 8th step it runs, the same
        value = str(self.interval) if self.decided else f"{_PENDING}{-1 if self.decide_at is None else self.decide_at}"
        if not self.decided:
            self._pending = value
        try:
            store = self.store()
            if store is not None:
                store.set(STORE_KEY, value)
        except Exception as exc:  # noqa: BLE001 - a joiner then falls back to K = 1 and says so
            log.warning("cannot publish the shard mirror interval to the re-formed world: %s", exc)


__all__ = ["AUTO", "BUDGET", "DECIDE_STEP", "IntervalPolicy", "MAX_INTERVAL", "choose", "parse"]
