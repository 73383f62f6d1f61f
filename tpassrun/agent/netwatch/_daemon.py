"""The agent's link watch: samples what the kernel knows (``_probe``), publishes it with the node's health record,
judges it against the peers' (``_plan``, pure) and carries the verdict out.

Effects, and only here:

* events ``link_down`` / ``link_ridden_out`` (a flap: the console says "link to node X lost for 4.2 s, ridden
  out", one line, written by the console from the event and nowhere else), ``link_suspect``, ``link_degraded`` /
  ``link_healthy`` ("node X: link degraded, +38 ms per step"), ``link_ambiguous`` (the figures point at more than
  one node and cannot tell them apart: which nodes and why, every ``AMBIGUOUS_EVERY_S`` while it lasts);
* with a degraded link, ``effect`` migrate and a spare node in the job: a taint on each of this node's slots
  through the health daemon's own taint path (running ranks migrate as planned swaps; this node's spares are
  not handed out, since they sit behind the same link); the taints go when the link is healthy again;
* otherwise reported only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from typing import Any, Callable

from tpassrun.agent.netwatch import _probe
from tpassrun.agent.netwatch._flaps import FlapBook, flap_line
from tpassrun.agent.netwatch._plan import AMBIGUOUS, DEGRADED, HEALTHY, SUSPECT, LinkFigures, LinkVerdict, LinkWatch, StepMeter
from tpassrun.records import HealthUntaint, LinkAmbiguous, LinkDegraded, LinkDown, LinkHealthy, LinkSuspect, emit

log = logging.getLogger("tpassrun.agent.netwatch")

READINGS_DEVICE = "link"     # the device name of the link figures in a node's health record
AMBIGUOUS_EVERY_S = 6.0      # how often an ambiguous finding is said again while it lasts
RTT_READS = 4                # round trips to etcd read per sampling interval (one ``ss`` each), averaged
# events during which (and for one sampling interval after) the ranks may be paused, not training: a swap's pause,
# a world re-formed, a restart. Step samples then are not what the link costs, and the baseline never learns them.
PAUSE_EVENTS = ("swap_decided", "swap_boundary_reached", "swap_phase", "swap_world_reformed", "swap_resumed",
                "generation_joined", "generation_committed", "generation_ended", "restart", "membership_change",
                "training_resumed", "ranks_recovered", "worker_died", "hang_held")


def figures_of(readings: Any) -> LinkFigures | None:
    """A peer's link figures, from the readings of its health record."""
    for r in readings or ():
        if isinstance(r, dict) and r.get("device") == READINGS_DEVICE and r.get("metric") == "figures":
            return LinkFigures.from_json(r.get("value"))
    return None


class LinkDaemon:
    """One per agent (state survives generations). ``health`` is the agent's ``healthd.AgentHealth``."""

    def __init__(self, health: Any, policy: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.health = health
        self.agent = health.agent
        self.policy = policy
        self.clock = clock
        self.watch = LinkWatch.from_policy(policy)
        self.watch.me = self.agent.node_id
        self.book = FlapBook()
        self.figures = LinkFigures()
        self.state = HEALTHY
        self.extra_ms = 0.0
        self.reason = ""
        self.down_at: float | None = None     # clock when this node's link was last seen down (None: never)
        self.down_wall = 0.0                   # the same in wall time (published: the peers' watchdogs read it)
        self.peer_down_wall = 0.0              # the latest of the peers' (from their health records)
        self.tainted: set[str] = set()
        self.meter = StepMeter()
        self._rtts: list[float | None] = []    # round trips to etcd read since the last sample
        self._paused_at: float | None = None     # clock of the last pause event (PAUSE_EVENTS)
        self._ambiguous_said: float | None = None  # clock the ambiguous finding was last said
        # this host's connections at the last sample (``_probe.conns``) and the clock then; None: start over
        self._sent: tuple[float, dict[_probe.Conn, tuple[str, int, int, int]]] | None = None
        self._dev: str | None = None
        self._addr: str | None = None
        self._downs: int | None = None
        self.agent.events.add_listener(self._on_event)

    # ------------------------------------------------------------------ flaps
    def _on_event(self, ev: dict[str, Any]) -> None:
        name, now = ev.get("event"), self.clock()
        if name in PAUSE_EVENTS:
            self._paused_at = now
        if name == "etcd_connection_lost":
            self.book.etcd_lost(now)
            self.down_at, self.down_wall = now, time.time()
        elif name == "etcd_connection_restored":
            self._said(self.book.etcd_restored(now, float(ev.get("seconds") or 0.0)))
        elif name in ("fenced", "lease_lost") and self.book.down:
            self.book.broken()

    def explains_stall(self, within_s: float) -> bool:
        """This node's link is down, or was within the last ``within_s``: ranks stalled meanwhile wait on TCP's
        retransmissions (whose backoff outlasts the outage by seconds), not on a hung process."""
        if self.book.down or (self.down_at is not None and self.clock() - self.down_at < within_s):
            return True
        return time.time() - self.peer_down_wall < within_s     # a peer's flap stalls our ranks the same way

    def _said(self, flap: Any) -> None:
        if flap is None:
            return
        self._sent = None          # the outage's retransmissions and waits are not the link's quality
        self.watch.forget()
        # one line per flap: the console says the event's line (I ridden out, W fenced); no log line besides
        self.agent.events.write("link_ridden_out" if flap.ridden_out else "link_flap_broke", seconds=flap.seconds,
                                seen_by=flap.seen_by, line=flap_line(self.agent.node_id, flap))

    def _poll_iface(self) -> None:
        if self._dev is None:
            return
        st = _probe.iface_state(self._dev)
        if st is None:
            return
        flapped = self._downs is not None and st.downs != self._downs
        self._downs = st.downs
        was_down = self.book.down
        if not st.up or flapped or was_down:
            self.down_at, self.down_wall = self.clock(), time.time()
        flap = self.book.interface(st.up, self.clock(), flapped=flapped)
        if flap is not None:
            # what the kernel sent again (or waited on) during the outage is the outage's, not the link's quality
            self._sent = None
            self.watch.forget()
            self.meter.restart()
        self._said(flap)
        if not st.up and not was_down:
            emit(self.agent.events, LinkDown(dev=self._dev))

    # ------------------------------------------------------------------ figures
    def _step_sample(self) -> tuple[float | None, bool]:
        """This node's ranks' step (the highest among its running ranks) fed to its ``StepMeter``."""
        from tpassrun.channel import Field, SlotState

        slots = self.agent.slots
        steps = [slots.field(s, Field.STEP) for s in slots.slots if s.rank is not None and s.state == SlotState.RUNNING]
        now = self.clock()
        paused = self._paused_at is not None and now - self._paused_at <= float(self.policy.interval_s) * 1.5
        return self.meter.sample(now, max(steps) if steps else None, paused)

    async def sample(self) -> LinkFigures:
        host, port = self.agent.rdzv.store.config.endpoints[0]
        if self._dev is None:
            self._dev, self._addr = await asyncio.to_thread(_probe.route, host)
        sent, at = await asyncio.to_thread(_probe.conns), self.clock()
        delta, busy = (_probe.conn_delta(self._sent[1], sent, 1000.0 * (at - self._sent[0])) if self._sent is not None
                       else ({}, {}))
        self._sent = (at, sent)
        reads = [r for r in self._rtts if r is not None]
        self._rtts.clear()
        rtt = statistics.fmean(reads) if reads else await asyncio.to_thread(_probe.rtt_ms, host, port)
        step_ms, steady = self._step_sample()
        self.figures = LinkFigures(rtt, step_ms, self._addr, delta, steady, busy or None)
        return self.figures

    def readings(self) -> list[dict[str, Any]]:
        """The figures as one reading of the node's health record (what the peers compare against)."""
        return [{"device": READINGS_DEVICE, "metric": "figures", "value": self.figures.to_json(),
                 "time": time.time(), "state": self.state, "extra_ms": round(self.extra_ms, 1),
                 "down_wall": self.down_wall}]

    def verdicts(self) -> list[dict[str, Any]]:
        """This node's link as one verdict of its health record (``tpassctl status`` shows it with the devices')."""
        effect = self.policy.effect.value if self.state == DEGRADED else "none"
        return [{"v": 1, "device": READINGS_DEVICE, "status": self.state, "effect": effect, "reason": self.reason,
                 "metric": "link", "time": time.time()}]

    async def peers(self) -> dict[str, LinkFigures]:
        from tpassrun.records import HealthRecord, Keys, load

        rdzv = self.agent.rdzv
        out: dict[str, LinkFigures] = {}
        for key, doc, rev in await rdzv.store.get_prefix_json(Keys(rdzv.key("")).family("health")):
            rec = load(HealthRecord.from_json, key, doc, rev)
            if rec is not None and rec.node_id != self.agent.node_id:
                fig = figures_of(rec.readings)
                if fig is not None:
                    out[rec.node_id] = fig
                for r in rec.readings:
                    down = r.get("down_wall") if r.get("device") == READINGS_DEVICE else None
                    if isinstance(down, (int, float)) and not isinstance(down, bool) and down > self.peer_down_wall:
                        self.peer_down_wall = float(down)
                        # a peer's link was down: what every node sent it again or waited on meanwhile is the
                        # outage's, not any link's quality (the peer starts its own figures over the same way)
                        self.watch.forget()
        return out

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """The interface polled on its own (a sample waits on etcd, for seconds when the link is down), the
        figures sampled, published and judged every ``interval_s`` while the link is up."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._iface_loop())
            tg.create_task(self._sample_loop())

    async def _iface_loop(self) -> None:
        while True:
            self._poll_iface()
            await asyncio.sleep(0.2)

    async def _sample_loop(self) -> None:
        interval = float(self.policy.interval_s)
        while True:
            if not self.book.down:
                with contextlib.suppress(Exception):   # etcd unreachable: the next sample tries again
                    await self.sample()
                    await self.health.publish()
                    await self.judge(await self.peers())
            # the round trip to etcd is read RTT_READS times per interval and averaged: the kernel's smoothed RTT
            # of a connection that carries a request now and then moves with whichever request it last timed
            for _ in range(RTT_READS):
                await asyncio.sleep(interval / RTT_READS)
                if not self.book.down:
                    await self._read_rtt()

    async def _read_rtt(self) -> None:
        with contextlib.suppress(Exception):
            host, port = self.agent.rdzv.store.config.endpoints[0]
            self._rtts.append(await asyncio.to_thread(_probe.rtt_ms, host, port))

    async def judge(self, peers: dict[str, LinkFigures]) -> None:
        verdict = self.watch.observe(self.figures, peers, self.clock())
        before, self.state, self.extra_ms = self.state, verdict.state, verdict.extra_ms
        node = self.agent.node_id
        self.reason = verdict.reason
        if verdict.state == SUSPECT and before != SUSPECT:
            emit(self.agent.events, LinkSuspect(reason=self.reason, figures=self.figures.to_json()))
        if verdict.state == AMBIGUOUS:
            self._say_ambiguous(verdict, peers)
        else:
            self._ambiguous_said = None
        if not verdict.changed:
            return
        if verdict.state == DEGRADED:
            spare = await self._spare_node()
            acts = spare is not None and self.policy.effect.value == "migrate"
            emit(self.agent.events, LinkDegraded(extra_ms=round(verdict.extra_ms, 1), reason=verdict.reason,
                                                 figures=self.figures.to_json(), peers={k: v.to_json() for k, v in peers.items()},
                                                 action="migrate" if acts else "report", line=f"node {node}: {verdict.reason}" + (
                                        f"; its ranks move off it (spares ready on {spare})" if acts else
                                        "; reported only (no spare on another node)" if spare is None else "; reported only")))
            if acts:
                await self._taint(verdict.reason)
        elif verdict.state == HEALTHY:
            emit(self.agent.events, LinkHealthy(reason=verdict.reason, line=f"node {node}: {verdict.reason}"))
            await self._untaint(verdict.reason)

    def _say_ambiguous(self, verdict: LinkVerdict, peers: dict[str, LinkFigures]) -> None:
        """The console (and ``tpassctl status``, through this node's link verdict) says which nodes and why, every
        ``AMBIGUOUS_EVERY_S`` while it lasts: not silently nothing."""
        now = self.clock()
        if self._ambiguous_said is not None and now - self._ambiguous_said < AMBIGUOUS_EVERY_S:
            return
        self._ambiguous_said = now
        emit(self.agent.events, LinkAmbiguous(suspects=list(verdict.suspects), reason=self.reason, figures=self.figures.to_json(),
                                              peers={k: v.to_json() for k, v in peers.items()},
                                              line=f"node {self.agent.node_id}: {self.reason}"))

    async def _spare_node(self) -> str | None:
        """Another node with a ready spare (its ``status/`` record): somewhere this node's ranks can go. This
        node's own spares sit behind the same link: they do not count."""
        from tpassrun.records import Keys, NodeStatus, load

        rdzv = self.agent.rdzv
        found = []
        for key, doc, rev in await rdzv.store.get_prefix_json(Keys(rdzv.key("")).family("status")):
            st = load(NodeStatus.from_json, key, doc, rev)
            if st is not None and st.node_id != self.agent.node_id:
                found += [st.node_id for w in st.workers if w.state == "spare" and w.managed]
        return min(found, key=lambda n: (-found.count(n), n)) if found else None

    def _verdict(self, device: str, reason: str, now: float, holds_rank: bool) -> Any:
        from tpassrun.health import HealthVerdict, Status, TaintEffect

        effect = TaintEffect.MIGRATE if holds_rank else TaintEffect.EXCLUDE
        return HealthVerdict(device, Status.DEGRADED, effect, reason, "link", now)

    async def _taint(self, reason: str) -> None:
        from tpassrun.channel import SlotState

        now = self.clock()
        # this node's spares first: once a rank's taint is out the coordinator picks a spare for it, and one here
        # sits behind the same link
        order = sorted(self.agent.slots.slots, key=lambda s: s.state != SlotState.SPARE)
        for s in order:
            if s.state not in (SlotState.RUNNING, SlotState.SPARE):
                continue
            holds = s.rank is not None and s.state == SlotState.RUNNING
            device = f"rank{s.rank}" if holds else f"slot{s.index}"
            verdict = self._verdict(device, reason, now, holds)
            taint = await self.health.apply_verdict(verdict, s.index, s.rank, s.state)
            if taint is not None:
                self.tainted.add(taint)

    async def _untaint(self, reason: str) -> None:
        from tpassrun.records import Keys

        rdzv = self.agent.rdzv
        for tid in sorted(self.tainted):
            with contextlib.suppress(Exception):
                await rdzv.store.delete(Keys(rdzv.key("")).taint(tid))
                self.health.written.pop(tid, None)
                emit(self.agent.events, HealthUntaint(id=tid, device="link", reason=reason))
        self.tainted.clear()
