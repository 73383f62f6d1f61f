"""Pure: which node's link explains what every node's figures show (no clock, no I/O).

Every agent runs this on the same published figures (its own and its peers' health records), so every agent comes
to the same answer and only the node it names acts on it.

Loss. What node S sent to address D and had to send again is loss on the path S -> D: on S's link (its way out)
or on D's (its way in). A path is *lossy* when ``retrans_pct`` % of at least ``MIN_BYTES`` sent over the window was
sent again. A fault on one node's link makes every lossy path touch that node, and paths that do not touch it stay
clean: so the node is the one endpoint every lossy path between nodes has in common. When only one pair of nodes
has lossy paths, both ends have every lossy path in common; then

* only one direction lossy (S -> D): the loss is charged to the receiver D (what its peers send it is lost on the
  way in; ``tests/netrelay.lossy``), unless S's round trip to etcd stands out and D's does not (an uplink at its
  rate limit dropping what it sends),
* both directions lossy: what each sent to third parties (etcd, which every node talks to, or any address that is
  not a node) tells them apart when one of them lost there too and the other did not; else whose round trip to
  etcd stands out against the other nodes' or moved against its own learned one (by ``rtt_factor`` and
  ``rtt_extra_ms``); else it cannot be told, and the finding says so with the figures.

Rate. A link at its rate limit loses nothing (the sender's queue holds what it cannot send yet) but keeps its
sender busy: the share of the time the busiest connection from S to D had data waiting to be sent or acknowledged
(not held back by D's receive window). Healthy, that is a few percent (a step's all-reduce is a burst); a 20 mbit/s
limit on S's way out kept S busy 84-100% of every interval and its peer 25-54% (the peer's sends wait on
acknowledgements queued behind S's data). A node whose busiest path to another node is busy ``BUSY_SHARE`` of the
window and ``BUSY_RATIO`` x as busy as every other node's: that node (its way out), unless the receiver's round trip to
etcd stands out and its own does not (the receiver's way in, where its etcd replies queue too). CPU load slows every
node alike and keeps no queue full: no node stands out.

Round trip. A node's round trip to etcd (a third party) ``rtt_factor`` x the median of the others' and
``rtt_extra_ms`` more: that node (both ends of a slow link would see the same RTT on the link itself, which is why
etcd's is used).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

MIN_BYTES = 64 * 1024           # a path between nodes, summed over the window: less is too little to say
MIN_THIRD_BYTES = 8 * 1024      # a path to a third party (etcd's traffic is small): only ever a tie-breaker
BUSY_SHARE = 0.5                # a path whose sender was busy this share of the window is at its limit ...
BUSY_RATIO = 1.5                # ... when that is this many times the busiest path of every other node
WINDOW = 5                      # samples the figures are summed (loss) or taken the median of (RTT) over
RTT_WINDOW = 3


@dataclass(frozen=True)
class NodeFigures:
    """One node's figures over the window (see ``LinkFigures``: the same fields, per sample)."""

    rtt_ms: float | None
    addr: str | None
    sent_to: Mapping[str, tuple[float, float]]
    busy_to: Mapping[str, float] = field(default_factory=dict)    # addr -> busy share of the busiest connection


@dataclass(frozen=True)
class Finding:
    """What the figures say: ``culprit`` the node whose link explains them (None: none, or not one);
    ``candidates`` the nodes that stand out when it cannot be told apart; ``reason`` the figures that say so."""

    culprit: str | None = None
    candidates: tuple[str, ...] = ()
    reason: str = ""

    @property
    def ambiguous(self) -> bool:
        return self.culprit is None and len(self.candidates) > 1


def fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


class Window:
    """The last ``WINDOW`` samples of every node's figures (``rtt_ms``, ``addr``, ``sent_to``), summed per node."""

    def __init__(self, size: int = WINDOW) -> None:
        self._snaps: deque[Mapping[str, NodeFigures]] = deque(maxlen=size)

    def add(self, snap: Mapping[str, NodeFigures]) -> None:
        self._snaps.append(dict(snap))

    def clear(self) -> None:
        self._snaps.clear()

    def figures(self) -> dict[str, NodeFigures]:
        """Per node of the newest sample: the median RTT of its last ``RTT_WINDOW`` samples, what it sent to each
        address, summed over the window, and the mean busy share per address over the samples that have one."""
        if not self._snaps:
            return {}
        out = {}
        for node, now in self._snaps[-1].items():
            seen = [s[node] for s in self._snaps if node in s]
            rtts = [f.rtt_ms for f in seen[-RTT_WINDOW:] if f.rtt_ms is not None]
            sums: dict[str, tuple[float, float]] = {}
            busy: dict[str, list[float]] = {}
            for f in seen:
                for addr, (sent, again) in f.sent_to.items():
                    s0, a0 = sums.get(addr, (0.0, 0.0))
                    sums[addr] = (s0 + sent, a0 + again)
                for addr, share in f.busy_to.items():
                    busy.setdefault(addr, []).append(share)
            out[node] = NodeFigures(statistics.median(rtts) if rtts else None, now.addr, sums,
                                    {a: statistics.fmean(v) for a, v in busy.items()})
        return out


def _share(sent: float, again: float) -> float:
    return 100.0 * again / sent if sent > 0 else 0.0


def lossy_paths(nodes: Mapping[str, NodeFigures], retrans_pct: float) -> tuple[dict[tuple[str, str], float],
                                                                               dict[tuple[str, str], float]]:
    """(between nodes, to third parties): (sender, receiver) -> % sent again, for the paths that are lossy. A
    receiver is a node's name when the address is a node's, else the address itself."""
    name_of = {f.addr: n for n, f in nodes.items() if f.addr}
    between: dict[tuple[str, str], float] = {}
    third: dict[tuple[str, str], float] = {}
    for src, f in nodes.items():
        for addr, (sent, again) in f.sent_to.items():
            dst = name_of.get(addr)
            if dst == src:
                continue
            share = _share(sent, again)
            if dst is not None and sent >= MIN_BYTES and share >= retrans_pct:
                between[(src, dst)] = share
            elif dst is None and sent >= MIN_THIRD_BYTES and share >= retrans_pct:
                third[(src, addr)] = share
    return between, third


def rtt_stands_out(node: str, nodes: Mapping[str, NodeFigures], factor: float, extra_ms: float) -> str | None:
    mine = nodes[node].rtt_ms
    others = [f.rtt_ms for n, f in nodes.items() if n != node and f.rtt_ms is not None]
    if mine is None or not others:
        return None
    ref = statistics.median(others)
    if mine > ref * factor and mine > ref + extra_ms:
        return f"round trip to etcd {fmt(mine)} ms against {fmt(ref)} ms on {len(others)} peer(s)"
    return None


def _paths(paths: Iterable[tuple[tuple[str, str], float]]) -> str:
    return ", ".join(f"{s}->{d} {fmt(p)}%" for (s, d), p in sorted(paths))


def explain(nodes: Mapping[str, NodeFigures], rtt_learned: Mapping[str, float], *, retrans_pct: float,
            rtt_factor: float, rtt_extra_ms: float) -> Finding:
    """Whose link the figures point at (see the module's doc). ``rtt_learned``: each node's usual round trip to etcd
    (learned while nothing stood out; a node missing: not known)."""
    between, third = lossy_paths(nodes, retrans_pct)
    if between:
        ends = {e for pair in between for e in pair}
        common = sorted(e for e in ends if all(e in pair for pair in between))
        one_way = len(common) == 2 and len(between) == 1
        if one_way:
            # one pair, one way: the receiver (loss on its way in), unless the sender's round trip to etcd stands
            # out and the receiver's does not (a congested or rate-limited uplink dropping what it sends)
            (src, dst), = between
            slow = [n for n in (src, dst) if rtt_stands_out(n, nodes, rtt_factor, rtt_extra_ms)]
            common = [slow[0] if len(slow) == 1 else dst]
        if len(common) == 1:
            node = common[0]
            if all(d == node for _, d in between):
                return Finding(node, (node,), f"{fmt(_inbound(node, nodes))}% of what its peers send it is sent "
                                              f"again against {fmt(_others_inbound(node, nodes))}% to the other node(s)")
            return Finding(node, (node,), f"every lossy path has it at one end ({_paths(between.items())}), "
                                          "none without it")
        suspects = tuple(common) if common else tuple(sorted(ends))
        told = _tie_break(suspects, nodes, third, rtt_learned, rtt_factor, rtt_extra_ms)
        said = f"lossy paths {_paths(between.items())}"
        if told is not None:
            node, why = told
            return Finding(node, (node,), f"{said}; {why}")
        rtts = ", ".join(f"{n} {fmt(nodes[n].rtt_ms or 0)} ms" + (f" (usually {fmt(rtt_learned[n])})"
                                                                   if n in rtt_learned else "") for n in suspects)
        return Finding(None, suspects, f"{said}; their round trips to etcd {rtts}; nothing sent to a third party "
                                       "was lost more on one of them: cannot tell whose link")
    limited = rate_limited(nodes, rtt_factor, rtt_extra_ms)
    if limited is not None:
        return Finding(limited[0], (limited[0],), limited[1])
    out = {n: w for n in nodes if (w := rtt_stands_out(n, nodes, rtt_factor, rtt_extra_ms)) is not None}
    if len(out) == 1:
        ((node, reason),) = out.items()
        return Finding(node, (node,), reason)
    if len(out) > 1:
        return Finding(None, tuple(sorted(out)), "; ".join(f"{n}: {w}" for n, w in sorted(out.items())))
    return Finding()


def busiest_path(node: str, nodes: Mapping[str, NodeFigures]) -> tuple[str, float] | None:
    """(receiver, busy share) of the path from ``node`` to another node its sender was busiest on, among the paths
    that carried at least ``MIN_BYTES`` over the window (None: none did, or no busy figures)."""
    name_of = {f.addr: n for n, f in nodes.items() if f.addr}
    paths = [(name_of[a], share) for a, share in nodes[node].busy_to.items()
             if name_of.get(a) not in (None, node) and nodes[node].sent_to.get(a, (0.0, 0.0))[0] >= MIN_BYTES]
    return max(paths, key=lambda p: p[1]) if paths else None


def rate_limited(nodes: Mapping[str, NodeFigures], rtt_factor: float, rtt_extra_ms: float) -> tuple[str, str] | None:
    """(node, why) when one node's busiest path to another node is at its limit (see the module's doc)."""
    busiest = {n: p for n in nodes if (p := busiest_path(n, nodes)) is not None}
    for src, (dst, share) in busiest.items():
        others = [p[1] for n, p in busiest.items() if n != src]
        if share < BUSY_SHARE or not others or share < BUSY_RATIO * max(others):
            continue
        said = (f"sending to {dst} kept busy {100 * share:.0f}% of the time against {100 * max(others):.0f}% at "
                "most on the other node(s)")
        if rtt_stands_out(dst, nodes, rtt_factor, rtt_extra_ms) and not rtt_stands_out(src, nodes, rtt_factor,
                                                                                        rtt_extra_ms):
            return dst, f"{src} {said}; {dst}'s round trip to etcd stands out: its way in is at its limit"
        return src, f"{said}: its way out is at its limit"
    return None


def _inbound(node: str, nodes: Mapping[str, NodeFigures]) -> float:
    """The share of what the other nodes sent ``node`` that they sent again."""
    addr = nodes[node].addr or ""
    sent = sum(f.sent_to.get(addr, (0.0, 0.0))[0] for n, f in nodes.items() if n != node)
    again = sum(f.sent_to.get(addr, (0.0, 0.0))[1] for n, f in nodes.items() if n != node)
    return _share(sent, again)


def _others_inbound(node: str, nodes: Mapping[str, NodeFigures]) -> float:
    """The median of the same share for the nodes other than ``node`` (0 when too little was sent to say)."""
    shares = []
    for n, f in nodes.items():
        if n == node or f.addr is None:
            continue
        if sum(g.sent_to.get(f.addr, (0.0, 0.0))[0] for m, g in nodes.items() if m != n) >= MIN_BYTES:
            shares.append(_inbound(n, nodes))
    return statistics.median(shares) if shares else 0.0


def _tie_break(suspects: tuple[str, ...], nodes: Mapping[str, NodeFigures], third: Mapping[tuple[str, str], float],
               rtt_learned: Mapping[str, float], rtt_factor: float, rtt_extra_ms: float) -> tuple[str, str] | None:
    """The one suspect that also lost what it sent to third parties, or whose round trip to etcd stands out against
    the other nodes' or moved against its own usual one."""
    lost = [n for n in suspects if any(s == n for s, _ in third)]
    if len(lost) == 1:
        n = lost[0]
        return n, f"{n} also resends to third parties ({_paths((p, v) for p, v in third.items() if p[0] == n)})"
    slow = [(n, f"{n}'s {w}") for n in suspects if (w := rtt_stands_out(n, nodes, rtt_factor, rtt_extra_ms))]
    if len(slow) == 1:
        return slow[0]
    moved = []
    for n in suspects:
        now, usual = nodes[n].rtt_ms, rtt_learned.get(n)
        if now is not None and usual is not None and now > usual * rtt_factor and now > usual + rtt_extra_ms:
            moved.append((n, f"{n}'s round trip to etcd went from {fmt(usual)} to {fmt(now)} ms"))
    return moved[0] if len(moved) == 1 else None
