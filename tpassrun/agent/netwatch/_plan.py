"""Pure: a node's link judged from figures every agent already has: (state, sample, now) -> verdict and reason.

No clock, no I/O: the daemon (``_daemon.py``) samples and acts; this module only decides.

A synchronous job's step time is the same on every rank (the gradient all-reduce waits for the slowest link), so
step times say *that* the network slows the job, not *whose* link does. The link figures say whose
(``_explain.py``): each node's round trip to etcd and, per remote address, what the kernel had to send again.
A node is *suspect* when the figures of every node point at its link *and* the job is slowed:

* its step time is up on its own healthy baseline (``slowdown_factor`` and ``slowdown_ms``). The baseline learns
  from training steps only (``LinkFigures.steady``: no start-up, stall or swap pause in the sample) taken after
  ``QUIET_N`` samples in a row in which no node's link stood out, not even by half the ``rtt_extra_ms``, and no
  suspicion ran;
* or, before that baseline exists (a link degraded from the first step), the node trains while its link stands out
  against its peers' at the same moment: the peers are the reference, not its own past.

Both are needed once there is a baseline: CPU noise slows steps but leaves no node's link standing out; a noisy link
that does not slow the job costs nothing. Suspect for ``hold_s`` without a break (``MISSES`` clear samples in a row
end it): *degraded*. Degraded, then clear for ``clear_s``: healthy again. When the figures point at more than one
node and cannot tell them apart, the suspects are *ambiguous* after the same hold: said, with the figures, and
nothing moved.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Any, Mapping

from tpassrun import schema
from tpassrun.agent.netwatch._explain import NodeFigures, Window, explain, fmt, rtt_stands_out
from tpassrun.health import LinkPolicy
from tpassrun.schema import Min

_POLICY = LinkPolicy()    # the thresholds' defaults are the health config's (one place)

HEALTHY, SUSPECT, DEGRADED, UNKNOWN, AMBIGUOUS = "healthy", "suspect", "degraded", "unknown", "ambiguous"
MISSES = 2       # clear observations in a row that end a suspicion
RTT_LEARN_N = 5  # round trips seen (nothing standing out) before a node's usual one is known
SMOOTH_N = 3     # step samples a node's step time is the median of
QUIET_N = 3      # quiet samples in a row before what is seen is learned as healthy
MUTE_N = 3       # samples left out after a link was down (TCP's backoff, the peers' samples across the outage)


Figure = Annotated[float, Min(0)]


@dataclass(frozen=True)
class LinkFigures:
    """One node's link figures over its last sampling interval (None / empty: not measured)."""

    rtt_ms: Figure | None = None          # median smoothed RTT of its connections to etcd
    step_ms: Figure | None = None         # wall time per step of its ranks (None: no rank, or none trained yet)
    addr: str | None = None               # its address (the source address of its route to etcd)
    sent_to: Mapping[str, tuple[Figure, Figure]] = field(default_factory=dict)   # addr -> (bytes sent, sent again)
    # step_ms is training only: no start-up, stall or pause in its samples; left out while true, so a steady node's
    # record is byte for byte what it was before the field existed (tests/golden/schema.json)
    steady: bool = field(default=True, metadata=schema.wire(omit_default=True))
    # addr -> the share (0-1) of the interval its busiest connection to that address had data waiting (``_probe``);
    # left out when not measured (an agent before it existed, or a sample without a previous one)
    busy_to: Mapping[str, Annotated[float, Min(0)]] | None = field(default=None,
                                                                   metadata=schema.wire(omit_default=True))

    def to_json(self) -> dict[str, Any]:
        return schema.dump(self)

    @classmethod
    def from_json(cls, doc: object) -> "LinkFigures | None":
        """A peer's figures, or None when they are not valid ones (not measured, as far as the judging goes)."""
        try:
            return schema.load(cls, doc)
        except schema.SchemaError:
            return None

    def node(self) -> NodeFigures:
        return NodeFigures(self.rtt_ms, self.addr, self.sent_to, self.busy_to or {})


def inbound_loss_pct(addr: str | None, senders: list[LinkFigures], min_bytes: float = 64 * 1024) -> float | None:
    """Percent of what ``senders`` sent to ``addr`` that they had to send again: loss on the way *to* that node
    (None: too little sent to it to say)."""
    if addr is None:
        return None
    sent = again = 0.0
    for f in senders:
        s, a = f.sent_to.get(addr, (0.0, 0.0))
        sent, again = sent + s, again + a
    return 100.0 * again / sent if sent >= min_bytes else None


@dataclass(frozen=True)
class LinkVerdict:
    state: str                 # healthy | suspect | degraded | ambiguous | unknown
    extra_ms: float            # step time above the healthy baseline (0 when not known)
    reason: str
    changed: bool = False      # the state went from/to degraded with this observation
    suspects: tuple[str, ...] = ()    # ambiguous: the nodes it cannot tell apart


@dataclass
class LinkWatch:
    """Judges this node's link, one observation per sampling interval. Thresholds: ``health.LinkPolicy``."""

    rtt_factor: float = _POLICY.rtt_factor
    rtt_extra_ms: float = _POLICY.rtt_extra_ms
    retrans_pct: float = _POLICY.retrans_pct
    slowdown_factor: float = _POLICY.slowdown_factor
    slowdown_ms: float = _POLICY.slowdown_ms
    hold_s: float = _POLICY.hold_s
    clear_s: float = _POLICY.clear_s
    baseline_n: int = 10
    me: str = "this node"      # this node's name among its peers' (the daemon: its node id)
    _baseline: deque[float] = field(default_factory=lambda: deque(maxlen=30), init=False, repr=False)
    _rtts: dict[str, deque[float]] = field(default_factory=dict, init=False, repr=False)
    _window: Window = field(default_factory=Window, init=False, repr=False)
    _suspect_since: float | None = field(default=None, init=False, repr=False)
    _clear_since: float | None = field(default=None, init=False, repr=False)
    _misses: int = field(default=0, init=False, repr=False)
    _quiet: int = field(default=0, init=False, repr=False)
    _mute: int = field(default=0, init=False, repr=False)
    degraded: bool = field(default=False, init=False)
    reason: str = field(default="", init=False)

    @classmethod
    def from_policy(cls, policy: object) -> "LinkWatch":
        names = ("rtt_factor", "rtt_extra_ms", "retrans_pct", "slowdown_factor", "slowdown_ms", "hold_s", "clear_s")
        given: dict[str, Any] = {n: float(getattr(policy, n)) for n in names if hasattr(policy, n)}
        return cls(**given)

    def forget(self) -> None:
        """Drop the figures' window: a link (this node's or a peer's) was down, and what was sent again or waited
        on meanwhile says nothing about any link's quality; a suspicion on those figures ends with them. The next
        ``MUTE_N`` samples are left out too: the steps stalled by TCP's backoff after the outage, an etcd round trip
        smoothed over it, and a peer's sample that spans it (measured: suspect 2-5 s after a flap was ridden out)."""
        self._window.clear()
        self._mute = MUTE_N
        if not self.degraded:
            self._suspect_since, self._misses = None, MISSES

    def baseline_ms(self) -> float | None:
        return statistics.median(self._baseline) if len(self._baseline) >= self.baseline_n else None

    def _usual_rtts(self) -> dict[str, float]:
        return {n: statistics.median(d) for n, d in self._rtts.items() if len(d) >= RTT_LEARN_N}

    def stands_out(self, mine: LinkFigures, peers: Mapping[str, LinkFigures]) -> str | None:
        """Why this node's link stands out against its peers' in this one sample (None: it does not)."""
        nodes = {self.me: mine.node(), **{n: p.node() for n, p in peers.items()}}
        found = explain(nodes, self._usual_rtts(), retrans_pct=self.retrans_pct, rtt_factor=self.rtt_factor,
                        rtt_extra_ms=self.rtt_extra_ms)
        return found.reason if found.culprit == self.me else None

    def _slowed(self, mine: LinkFigures) -> tuple[bool, float, str]:
        """(the job is slowed as far as this node can tell, ms per step above its baseline, how it tells)."""
        if mine.step_ms is None:
            return False, 0.0, ""
        base = self.baseline_ms()
        if base is None:
            return True, 0.0, (f"{fmt(mine.step_ms)} ms per step, no healthy step time learned yet "
                               f"({len(self._baseline)}/{self.baseline_n}): judged against its peers")
        extra = mine.step_ms - base
        slow = extra >= self.slowdown_ms and mine.step_ms >= base * self.slowdown_factor
        return slow, extra, f"+{fmt(extra)} ms per step ({fmt(mine.step_ms)} against {fmt(base)} ms)"

    def observe(self, mine: LinkFigures, peers: Mapping[str, LinkFigures], now: float) -> LinkVerdict:
        if self._mute > 0:
            self._mute -= 1
            self._quiet = 0
            if self.degraded:
                return LinkVerdict(DEGRADED, 0.0, self.reason)
            return LinkVerdict(UNKNOWN, 0.0, "a link was down: the figures around the outage are left out")
        self._window.add({self.me: mine.node(), **{n: p.node() for n, p in peers.items()}})
        figs = self._window.figures()
        found = explain(figs, self._usual_rtts(), retrans_pct=self.retrans_pct, rtt_factor=self.rtt_factor,
                        rtt_extra_ms=self.rtt_extra_ms)
        out = found.reason if found.culprit == self.me else None
        ambiguous = found.ambiguous and self.me in found.candidates
        slow, extra, how = self._slowed(mine)
        has_base = self.baseline_ms() is not None
        # nothing stands out anywhere, not even half as much, for QUIET_N samples: what is seen now is what healthy
        # looks like (a rate-limited link's round trip stands out in some samples only; the ones between are not)
        quiet = not found.candidates and self._suspect_since is None and not self.degraded and not any(
            rtt_stands_out(n, figs, self.rtt_factor, self.rtt_extra_ms / 2) for n in figs)
        self._quiet = self._quiet + 1 if quiet else 0
        if self._quiet >= QUIET_N:
            for n, f in figs.items():
                if f.rtt_ms is not None:
                    self._rtts.setdefault(n, deque(maxlen=30)).append(f.rtt_ms)
            if mine.step_ms is not None and mine.steady and not (has_base and slow):
                self._baseline.append(mine.step_ms)
        if (out is not None or ambiguous) and (slow or (self.degraded and mine.step_ms is None and out is not None)):
            self._clear_since, self._misses = None, 0
            if self._suspect_since is None:
                self._suspect_since = now
            held = now - self._suspect_since
            if out is not None:
                why = f"{how}; {out}" if how else out
                if not self.degraded and held >= self.hold_s:
                    self.degraded, self.reason = True, f"link degraded, {why}; held {fmt(held)} s"
                    return LinkVerdict(DEGRADED, extra, self.reason, changed=True)
                if self.degraded:
                    return LinkVerdict(DEGRADED, extra, self.reason)
                return LinkVerdict(SUSPECT, extra, f"suspect for {fmt(held)} s: {why}")
            names = found.candidates
            why = (f"cannot tell which node's link slows the job: {', '.join(names)} "
                   f"stand out; {found.reason}; {how}")
            if not self.degraded and held >= self.hold_s:
                return LinkVerdict(AMBIGUOUS, extra, f"{why}; for {fmt(held)} s; nothing moved", suspects=names)
            if self.degraded:
                return LinkVerdict(DEGRADED, extra, self.reason)
            return LinkVerdict(SUSPECT, extra, f"suspect for {fmt(held)} s: {why}", suspects=names)
        # one clear observation inside a suspicion is noise (a link at its rate limit is not slow every second);
        # ``MISSES`` in a row end it
        self._misses += 1
        if self._suspect_since is not None and not self.degraded and self._misses < MISSES:
            held = now - self._suspect_since
            return LinkVerdict(SUSPECT, extra, f"suspect for {fmt(held)} s (not in this sample)")
        self._suspect_since = None
        if self.degraded:
            if self._clear_since is None:
                self._clear_since = now
            if now - self._clear_since >= self.clear_s:
                self.degraded, self._clear_since = False, None
                return LinkVerdict(HEALTHY, extra, f"link healthy again for {fmt(self.clear_s)} s", changed=True)
            return LinkVerdict(DEGRADED, extra, self.reason)
        if not peers:
            return LinkVerdict(UNKNOWN, extra, "no peer's link figures to compare against")
        if not has_base:
            return LinkVerdict(UNKNOWN, 0.0, f"learning the step time: {len(self._baseline)}/{self.baseline_n}")
        return LinkVerdict(HEALTHY, extra, "link figures in line with the peers'")


@dataclass
class StepMeter:
    """A node's wall time per step, one sample per sampling interval, from the step its ranks are at (pure).

    ``sample(now, step, paused)`` -> (ms per step, the median of the last ``SMOOTH_N`` samples; whether all of
    those are training only). None before a step completed (start-up is not a step) or without ranks. An interval
    in which no step completed once training began is a stall: counted as one step that long (a link can make a
    step outlast the interval) but not steady; the first steps (their start-up in them) and an interval next to a
    pause event (a swap's pause, a restart) are not steady either, and nor is any sample whose median includes
    one of those."""

    _steps: deque[float] = field(default_factory=lambda: deque(maxlen=SMOOTH_N), init=False, repr=False)
    _last: tuple[float, int] | None = field(default=None, init=False, repr=False)
    _trained: bool = field(default=False, init=False, repr=False)
    _unsteady: int = field(default=0, init=False, repr=False)

    def restart(self) -> None:
        """What comes next is not comparable with before (the link was down: TCP's backoff in the next steps)."""
        self._steps.clear()
        self._last, self._unsteady = None, SMOOTH_N

    def sample(self, now: float, step: int | None, paused: bool = False) -> tuple[float | None, bool]:
        prev = self._last
        if step is None:
            self._last, self._trained, self._unsteady = None, False, 0
            self._steps.clear()
            return None, False
        self._last = (now, step)
        if prev is None or step < prev[1] or now <= prev[0]:
            return (statistics.median(self._steps) if self._steps else None), False
        done = step - prev[1]
        if done == 0 and not self._trained:
            return None, False                       # starting up: nothing to measure yet
        if done == 0 or paused or not self._trained:
            self._unsteady = SMOOTH_N
        self._trained = True
        self._steps.append(1000.0 * (now - prev[0]) / max(1, done))
        steady = self._unsteady == 0
        self._unsteady = max(0, self._unsteady - 1)
        return statistics.median(self._steps), steady
