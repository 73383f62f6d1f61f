"""Pure: a node's link judged from figures every agent already has, and flaps told apart from outages.

No clock, no I/O: the daemon (``_daemon.py``) samples and acts; this module only decides.

Degraded link. A synchronous job's step time is the same on every rank (the gradient all-reduce waits for the
slowest link), so step times say *that* the network slows the job, not *whose* link does. The link figures say
whose: each node's round-trip time to etcd (a third party every node talks to anyway: the kernel's smoothed RTT
of the agent's own etcd connection, no probe sent) and, per remote address, what the kernel had to send again
(loss on the way to a node shows in what its *peers* resend to it). A node is *suspect* when its figures stand out
against the others' (RTT ``rtt_factor`` times its peers' median and ``rtt_extra_ms`` more; or ``retrans_pct`` % of
what its peers send it resent, and ``rtt_factor`` times the share for the other nodes) *and* the job's step
time is up on this node's own healthy baseline (``slowdown_factor`` and ``slowdown_ms``). Both are needed: CPU
noise slows steps but leaves no node's link standing out; a noisy link that does not slow the job costs nothing.
Suspect for ``hold_s`` without a break: *degraded*. Degraded, then clear (neither condition) for ``clear_s``:
healthy again.

Flap. The link of the node's own interface goes down and comes back (its operstate, or its etcd connection lost
and restored): if nothing of the job broke meanwhile (no fence, no lease lost), it was *ridden out*.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, Any, Mapping

from tpassrun import schema
from tpassrun.health import LinkPolicy
from tpassrun.schema import Min

_POLICY = LinkPolicy()    # the thresholds' defaults are the health config's (one place)

HEALTHY, SUSPECT, DEGRADED, UNKNOWN = "healthy", "suspect", "degraded", "unknown"
MISSES = 2       # clear observations in a row that end a suspicion
ECHO_S = 30.0     # an etcd connection lost this soon after the interface came back: the same outage, seen late


Figure = Annotated[float, Min(0)]


@dataclass(frozen=True)
class LinkFigures:
    """One node's link figures over its last sampling interval (None / empty: not measured)."""

    rtt_ms: Figure | None = None          # median smoothed RTT of its connections to etcd
    step_ms: Figure | None = None         # median step time of its ranks (None: it holds no rank)
    addr: str | None = None               # its address (the source address of its route to etcd)
    sent_to: Mapping[str, tuple[Figure, Figure]] = field(default_factory=dict)   # addr -> (bytes sent, sent again)

    def to_json(self) -> dict[str, Any]:
        return schema.dump(self)

    @classmethod
    def from_json(cls, doc: object) -> "LinkFigures | None":
        """A peer's figures, or None when they are not valid ones (not measured, as far as the judging goes)."""
        try:
            return schema.load(cls, doc)
        except schema.SchemaError:
            return None


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
    state: str                 # healthy | suspect | degraded | unknown
    extra_ms: float            # step time above the healthy baseline (0 when not known)
    reason: str
    changed: bool = False      # the state went from/to degraded with this observation


def _fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


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
    _baseline: deque[float] = field(default_factory=lambda: deque(maxlen=30), init=False, repr=False)
    _suspect_since: float | None = field(default=None, init=False, repr=False)
    _clear_since: float | None = field(default=None, init=False, repr=False)
    _misses: int = field(default=0, init=False, repr=False)
    degraded: bool = field(default=False, init=False)
    reason: str = field(default="", init=False)

    @classmethod
    def from_policy(cls, policy: object) -> "LinkWatch":
        names = ("rtt_factor", "rtt_extra_ms", "retrans_pct", "slowdown_factor", "slowdown_ms", "hold_s", "clear_s")
        given: dict[str, Any] = {n: float(getattr(policy, n)) for n in names if hasattr(policy, n)}
        return cls(**given)

    def baseline_ms(self) -> float | None:
        return statistics.median(self._baseline) if len(self._baseline) >= self.baseline_n else None

    def stands_out(self, mine: LinkFigures, peers: Mapping[str, LinkFigures]) -> str | None:
        """Why this node's link figures stand out against its peers' (None: they do not, or nothing to compare)."""
        rtts = [p.rtt_ms for p in peers.values() if p.rtt_ms is not None]
        if mine.rtt_ms is not None and rtts:
            ref = statistics.median(rtts)
            if mine.rtt_ms > ref * self.rtt_factor and mine.rtt_ms > ref + self.rtt_extra_ms:
                return f"round trip to etcd {_fmt(mine.rtt_ms)} ms against {_fmt(ref)} ms on {len(rtts)} peer(s)"
        # loss: what the peers send this node and have to send again, against the same for every other node
        everyone = {**peers, "": mine}
        mine_in = inbound_loss_pct(mine.addr, list(peers.values()))
        theirs = [inbound_loss_pct(p.addr, [f for k, f in everyone.items() if k != name])
                  for name, p in peers.items()]
        ref = statistics.median([x for x in theirs if x is not None] or [0.0])
        if mine_in is not None and mine_in >= self.retrans_pct and mine_in > ref * self.rtt_factor:
            return (f"{_fmt(mine_in)}% of what its peers send it is sent again against {_fmt(ref)}% to the "
                    f"other node(s)")
        return None

    def observe(self, mine: LinkFigures, peers: Mapping[str, LinkFigures], now: float) -> LinkVerdict:
        out = self.stands_out(mine, peers)
        base = self.baseline_ms()
        extra = 0.0
        slow = False
        if mine.step_ms is not None and base is not None:
            extra = mine.step_ms - base
            slow = extra >= self.slowdown_ms and mine.step_ms >= base * self.slowdown_factor
        if mine.step_ms is not None and out is None and not self.degraded and not slow:
            self._baseline.append(mine.step_ms)   # the baseline learns only from steps on a link that looks fine
        # a node whose ranks moved away has no step time: its link standing out keeps it degraded (never clears it)
        if out is not None and (slow or (self.degraded and mine.step_ms is None)):
            self._clear_since, self._misses = None, 0
            if self._suspect_since is None:
                self._suspect_since = now
            held = now - self._suspect_since
            why = f"+{_fmt(extra)} ms per step ({_fmt(mine.step_ms or 0)} against {_fmt(base or 0)} ms); {out}"
            if not self.degraded and held >= self.hold_s:
                self.degraded, self.reason = True, f"link degraded, {why}; held {_fmt(held)} s"
                return LinkVerdict(DEGRADED, extra, self.reason, changed=True)
            if self.degraded:
                return LinkVerdict(DEGRADED, extra, self.reason)
            return LinkVerdict(SUSPECT, extra, f"suspect for {_fmt(held)} s: {why}")
        # one clear observation inside a suspicion is noise (a link at its rate limit is not slow every second);
        # ``MISSES`` in a row end it
        self._misses += 1
        if self._suspect_since is not None and not self.degraded and self._misses < MISSES:
            held = now - self._suspect_since
            return LinkVerdict(SUSPECT, extra, f"suspect for {_fmt(held)} s (not in this sample)")
        self._suspect_since = None
        if self.degraded:
            if self._clear_since is None:
                self._clear_since = now
            if now - self._clear_since >= self.clear_s:
                self.degraded, self._clear_since = False, None
                return LinkVerdict(HEALTHY, extra, f"link healthy again for {_fmt(self.clear_s)} s", changed=True)
            return LinkVerdict(DEGRADED, extra, self.reason)
        if base is None:
            return LinkVerdict(UNKNOWN, 0.0, f"learning the step time: {len(self._baseline)}/{self.baseline_n}")
        if not peers:
            return LinkVerdict(UNKNOWN, extra, "no peer's link figures to compare against")
        return LinkVerdict(HEALTHY, extra, out or "link figures in line with the peers'")


@dataclass(frozen=True)
class Flap:
    """A link outage that ended: how long, how it was seen, and whether the job rode it out."""

    seconds: float
    seen_by: str               # "interface" (its operstate) | "etcd" (its connection lost and restored)
    ridden_out: bool


@dataclass
class FlapBook:
    """Bookkeeping of this node's link outages. Feed it what the agent sees; it returns each outage once over.

    Two witnesses: the interface's operstate (exact, when the fault is on this host's own link) and the etcd
    connection (lost / restored: a fault anywhere on the path). One outage seen by both is one flap, timed by the
    interface when it saw it. A fence or a lost lease meanwhile means it was not ridden out."""

    _down_since: float | None = None
    _seen_by: str = ""
    _etcd_since: float | None = None
    _broken: bool = False
    _iface_ended: float | None = None     # when the interface last came back (its etcd echo is the same outage)
    _etcd_ended: float | None = None      # when an outage only etcd saw last ended

    @property
    def down(self) -> bool:
        return self._down_since is not None or self._etcd_since is not None

    def interface(self, up: bool, now: float, *, flapped: bool = False) -> Flap | None:
        """The interface's state now; ``flapped``: it went down and up again since the last sample."""
        if not up:
            if self._down_since is None or self._seen_by != "interface":
                self._down_since, self._seen_by = now, "interface"
            return None
        if self._down_since is not None and self._seen_by == "interface":
            return self._end(now - self._down_since, "interface", now)
        recent = self._etcd_ended is not None and now - self._etcd_ended < ECHO_S
        if flapped and self._etcd_since is None and not recent:
            return self._end(0.0, "interface", now)
        return None

    def etcd_lost(self, now: float) -> None:
        if self._etcd_since is None:
            self._etcd_since = now
        echo = self._iface_ended is not None and now - self._iface_ended < ECHO_S
        if self._down_since is None and not echo:
            self._down_since, self._seen_by = now, "etcd"

    def etcd_restored(self, now: float, lasted: float) -> Flap | None:
        self._etcd_since = None
        if self._down_since is not None and self._seen_by == "etcd":
            return self._end(max(lasted, now - self._down_since), "etcd", now)
        return None

    def broken(self) -> None:
        """A fence or a lost lease: the outage in progress (if any) was not ridden out."""
        self._broken = True

    def _end(self, seconds: float, seen_by: str, now: float) -> Flap:
        flap = Flap(round(seconds, 2), seen_by, not self._broken)
        if seen_by == "interface":
            self._iface_ended = now
        else:
            self._etcd_ended = now
        self._down_since, self._seen_by, self._broken = None, "", False
        if self._etcd_since is not None and seen_by == "interface":
            self._etcd_since = None     # the etcd side of the same outage: said once, here
        return flap


def flap_line(node: str, flap: Flap) -> str:
    how = "" if flap.seen_by == "interface" else " (its etcd connection)"
    if flap.ridden_out:
        return f"link to node {node} lost for {flap.seconds:.1f} s{how}, ridden out"
    return f"link to node {node} lost for {flap.seconds:.1f} s{how}; the node was fenced"
