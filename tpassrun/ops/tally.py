"""The run's tally: what failures cost, reduced from the event stream (pure: no I/O, no clock but the events').

One reducer feeds the exit summary (:func:`tpassrun.ops.console.summary_lines`), the Prometheus gauges
(:mod:`tpassrun.ops.metrics`) and ``tpassctl status`` / ``tpassctl events``, so they cannot disagree.
``RunTally.feed(ev)`` takes one event record after another; :func:`tally_of` folds a whole log.

What counts as lost (the first start-up counts as good, as under an uninterrupted torchrun):

- a live swap or recovery: the workers' pause (``swap_resumed`` / ``ranks_recovered`` / ``node_recovered``), and the
  in-flight steps an unplanned recovery ran again (a rank's death step minus the boundary it resumed from, + 1);
- an aborted swap: the time it held the workers;
- a whole-group restart: its own wall time, from the failure (the first sign of it after the group formed: a
  death, a hang, a fallback; else the group's end) until the new group runs a step again, plus the steps it ran
  again at the step time before the failure. Only a script that reports its steps (the worker API) says when it
  runs a step again and which step it resumed at (``training_resumed``); for any other script the restart's time
  is counted until the new workers were started (a lower bound: their start-up is not seen) and the steps it ran
  again, hence the goodput, are *unknown*, never 0.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Mapping

#: the one line that says how to make unknown costs known (the summary, tpassctl status, docs/operations.md)
HOW_TO_KNOW = ("the script does not report its steps to tpassrun, so the steps a restart ran again and the new "
               "workers' start-up are not seen; with the worker API (README: 'The worker API') they are counted")

#: events that are the first sign of a failure of the running group (a restart's time counts from the first)
_FAILURE_EVENTS = frozenset({"worker_died", "unmanaged_death", "user_error", "hang_detected", "fallback",
                             "exception_cause", "node_lost", "health_kill"})


@dataclasses.dataclass(frozen=True)
class SwapCost:
    kind: str              # planned, unplanned, node
    swap_id: str
    pause_s: float
    redone: int = 0        # in-flight steps an unplanned recovery ran again


@dataclasses.dataclass(frozen=True)
class RestartCost:
    """One whole-group restart. ``redone``/``redone_s`` are None while unknown (no step reported since)."""

    why: str
    down_s: float                  # the failure -> a step runs again (known) / the new workers started (unknown)
    redone: int | None = None      # steps run again: progress since the script's last checkpoint
    redone_s: float | None = None  # what they cost, at the step time before the failure
    resumed_at: int | None = None  # the step the restarted script resumed at

    @property
    def known(self) -> bool:
        return self.redone is not None


@dataclasses.dataclass
class RunTally:
    """What the exit summary reports; :meth:`feed` is the reducer."""

    started: float | None = None
    ended: float | None = None
    code: Any = None                 # the launcher's exit code (agent_exit), None while it runs
    swaps: list[SwapCost] = dataclasses.field(default_factory=list)
    restarts: list[RestartCost] = dataclasses.field(default_factory=list)
    aborted: list[tuple[str, float]] = dataclasses.field(default_factory=list)       # (swap id, held s)
    fallbacks: int = 0
    given_back: str = ""             # a pool node's spare node that its job gave back to the pool (why)
    hang_kills: int = 0
    # --- the reducer's own state (not reported) ---
    _failed_at: float | None = None  # the first sign of the running group's failure (a restart counts from it)
    _restart: tuple[str, float] | None = None     # (why, since): a group ended by a failure, not yet re-formed
    _open: tuple[int, float] | None = None   # (index in restarts, counted until): the one not yet running a step
    _died: dict[Any, int] = dataclasses.field(default_factory=dict)      # rank -> the step it died at
    _swap: dict[str, tuple[str, Any, int | None]] = dataclasses.field(default_factory=dict)  # sid -> kind, rank, boundary
    _swap_start: dict[str, float] = dataclasses.field(default_factory=dict)
    _lost_nodes: set[str] = dataclasses.field(default_factory=set)

    # --- what it reports ---
    @property
    def wall(self) -> float:
        if self.started is None:
            return 0.0
        return max(0.0, (self.ended if self.ended is not None else time.monotonic()) - self.started)

    @property
    def known(self) -> bool:
        """Every restart's steps run again are known (no restart, or each reported by the worker API)."""
        return all(r.known for r in self.restarts)

    @property
    def lost(self) -> float:
        """Seconds lost to failures: a lower bound while :attr:`known` is False."""
        return (sum(s.pause_s for s in self.swaps) + sum(r.down_s + (r.redone_s or 0.0) for r in self.restarts)
                + sum(d for _i, d in self.aborted))

    @property
    def steps_redone(self) -> int:
        """In-flight steps live recoveries ran again (always known: only the worker API recovers live)."""
        return sum(s.redone for s in self.swaps)

    @property
    def restart_redone(self) -> int | None:
        """Steps whole-group restarts ran again ("steps lost"); None when unknown."""
        return sum(r.redone or 0 for r in self.restarts) if self.known else None

    @property
    def goodput(self) -> float | None:
        """Share of wall time that was useful training, in percent; None when unknown."""
        if not self.known:
            return None
        wall = self.wall
        return 100.0 if wall <= 0 else max(0.0, 100.0 * (wall - self.lost) / wall)

    def to_json(self) -> dict[str, Any]:
        """The costs as ``tpassctl status --json`` gives them (docs/operations.md: field reference)."""
        goodput, steps_lost = self.goodput, self.restart_redone
        return {"wall_s": round(self.wall, 3), "lost_s": round(self.lost, 3), "known": self.known,
                "swaps": sum(1 for s in self.swaps if s.kind not in ("unplanned", "node")),
                "recoveries": sum(1 for s in self.swaps if s.kind in ("unplanned", "node")),
                "restarts": len(self.restarts), "aborted_swaps": len(self.aborted), "hang_kills": self.hang_kills,
                "steps_lost": steps_lost, "steps_redone": self.steps_redone,
                "goodput_pct": None if goodput is None else round(goodput, 1),
                "unknown_because": None if self.known else HOW_TO_KNOW, "exit_code": self.code}

    def last_swap(self) -> SwapCost | None:
        return self.swaps[-1] if self.swaps else None

    # --- the reducer ---
    def feed(self, ev: Mapping[str, Any]) -> None:   # one branch per event that costs something
        name, now = ev.get("event"), float(ev.get("mono") or 0.0)
        sid = str(ev.get("swap_id"))
        if name == "agent_started":
            self.started = now
        elif name == "agent_exit":
            self.ended, self.code = now, ev.get("code")
        if self._failed_at is None and (name in _FAILURE_EVENTS or (
                name == "worker_exit" and ev.get("code") not in (0, None) and ev.get("state") == "running")):
            self._failed_at = now
        if name == "fallback":
            self.fallbacks += 1
        elif name == "hang_detected":
            self.hang_kills += 1
        elif name == "worker_died":
            self._died[ev.get("rank")] = int(ev.get("step") or 0)
        elif name == "node_lost":
            self._lost_nodes.add(str(ev.get("lost_node")))
        elif name == "pool_given_back":
            self.given_back = str(ev.get("reason") or "given back")
        elif name is not None and name.startswith("swap_") and name[5:] in (
                "pause", "boundary", "transfer", "send", "reform", "done", "aborted"):
            kind, rank, boundary = self._swap.get(sid, ("planned", None, None))
            kind, rank = ev.get("kind") or kind, ev.get("rank") if ev.get("rank") is not None else rank
            if ev.get("boundary") is not None:
                boundary = int(ev["boundary"])
            self._swap[sid] = (str(kind), rank, boundary)
            if name == "swap_pause":
                self._swap_start.setdefault(sid, now)
        elif name == "swap_resumed":
            kind, rank, boundary = self._swap.get(sid, ("planned", ev.get("rank"), None))
            died = self._died.get(rank)
            redone = max(0, died - boundary + 1) if kind == "unplanned" and died is not None and boundary is not None \
                else 0
            self._recovered(SwapCost(kind, sid, float(ev.get("seconds") or 0.0), redone), sid)
        elif name in ("ranks_recovered", "node_recovered"):
            kind = "unplanned" if name == "ranks_recovered" else "node"
            self._recovered(SwapCost(kind, sid, float(ev.get("seconds") or 0.0)), sid)
        elif name == "swap_aborted_here":
            start = self._swap_start.pop(sid, None)
            if start is not None:        # the time it held the workers is lost all the same
                self.aborted.append((sid, max(0.0, now - start)))
                self._failed_at = now    # a restart after it counts from here (not twice)
        elif name == "generation_ended":
            if ev.get("outcome") in ("failed", "membership"):
                since = self._failed_at if self._failed_at is not None else now
                self._restart = (str(ev.get("reason")), min(since, now))
        elif name == "generation_joined":
            back_as_spare = (self._restart is not None and self._restart[0].startswith("fenced:")
                             and ev.get("node") not in (ev.get("members") or []))
            if self._restart is not None and not back_as_spare:
                why, since = self._restart
                self.restarts.append(RestartCost(why, max(0.0, now - since)))
                self._open = (len(self.restarts) - 1, now)
            self._restart = None
            self._failed_at = None
        elif name == "workers_started" and self._open is not None and not ev.get("spare_node"):
            i, mark = self._open     # the launcher's part of the restart ends here (all an unknown one counts)
            self.restarts[i] = dataclasses.replace(self.restarts[i], down_s=self.restarts[i].down_s + now - mark)
            self._open = (i, now)
        elif name == "training_resumed" and self._open is not None:
            i, mark = self._open     # the worker API saw the new group run a step: the restart ends here
            self.restarts[i] = dataclasses.replace(
                self.restarts[i], down_s=self.restarts[i].down_s + max(0.0, now - mark),
                redone=int(ev.get("redone") or 0), redone_s=float(ev.get("redone_s") or 0.0),
                resumed_at=ev.get("step"))
            self._open = None

    def _recovered(self, cost: SwapCost, sid: str) -> None:
        self.swaps.append(cost)
        self._swap_start.pop(sid, None)
        self._failed_at = None


def tally_of(events: Iterable[Mapping[str, Any]]) -> RunTally:
    """The tally of a whole event log (pure)."""
    t = RunTally()
    for ev in events:
        t.feed(ev)
    return t
