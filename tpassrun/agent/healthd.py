"""The agent's health daemon: sensors and step times in, taint keys in etcd out.

:class:`AgentHealth` runs a :class:`tpassrun.health.HealthMonitor` next to the agent's other tasks. The
monitor polls NVML, the site file (``--health-file`` / ``TPASSRUN_HEALTH_FILE``) and, with
``--straggler-factor``, the step times the workers leave in the shared-memory channel. Each verdict that
changed goes through :func:`decide` (pure: verdict + what the slot holds + what we already wrote ->
action and reason), and this module only carries the action out:

* a tainting verdict on a slot that holds a rank writes ``P taints/<id>``; the leader's swap coordinator
  migrates that rank to a warm spare and marks the taint ``quarantined``;
* a tainting verdict on a slot without a rank (a spare) writes a taint with ``"rank": null`` so the slot
  is not handed out;
* ``FAIL`` on a slot that holds a rank kills the worker: its agent's unplanned recovery replaces it from a
  replica now instead of waiting for a cooperative boundary it may never reach;
* a verdict that is healthy again deletes the taint, which returns a quarantined slot to the spare pool.

The taint id is a function of (node, device, metric), so each problem is written once, however often the
monitor re-reports it, and a restarted generation finds its predecessor's taints again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import re
import signal
import time
from typing import Any, Callable, Mapping, Sequence

from tpassrun.channel import Field, SlotState
from tpassrun.health import (
    FileSensor,
    HealthMonitor,
    HealthVerdict,
    NvmlSensor,
    Policy,
    PolicyEngine,
    Sensor,
    Status,
    StragglerDetector,
    TaintEffect,
    device_for_local_rank,
)
from tpassrun.records import (
    HANDLED_KILLED,
    HealthKill,
    HealthMessage,
    HealthRecord,
    HealthTaint,
    HealthUntaint,
    HealthVerdictNoted,
    Keys,
    Taint,
    TaintSource,
    emit,
    load,
)
from tpassrun.settings import envnames as E
from tpassrun.swapper import HealthHost

log = logging.getLogger(__name__)

SOURCE = TaintSource.HEALTH.value
PUBLISH_EVERY_S = 5.0           # the snapshot also goes out on every change; this keeps `polls` fresh
KILLED = HANDLED_KILLED         # ``handled_by`` of a FAIL taint: the unplanned path owns the recovery
# Whole-step time is the same on every rank of a synchronous job (the gradient all-reduce waits for the
# slowest), so the worker's time *before* its first collective is what tells a straggler apart when the
# channel carries it (``Field.LAST_COMPUTE_NS``); the whole step otherwise, which only catches stragglers
# outside the collective's reach (e.g. an agent-side view of a non-synchronous job).
STEP_TIME_FIELD: Field = getattr(Field, "LAST_COMPUTE_NS", Field.LAST_STEP_NS)


class TaintOp(str, enum.Enum):
    WRITE = "write"
    DELETE = "delete"
    KEEP = "keep"               # nothing to change in etcd


@dataclasses.dataclass(frozen=True)
class SlotInfo:
    """What :func:`decide` needs to know about the slot a device belongs to."""

    index: int
    rank: int | None
    state: str


@dataclasses.dataclass(frozen=True)
class WrittenTaint:
    """A taint this node's health daemon wrote and has not deleted yet."""

    id: str
    device: str
    metric: str | None
    slot: int
    rank: int | None


@dataclasses.dataclass(frozen=True)
class TaintAction:
    op: TaintOp
    reason: str
    taint: Taint | None = None                 # WRITE: the taint
    delete: tuple[str, ...] = ()               # DELETE: taint ids
    kill_slot: int | None = None               # FAIL: the worker of this slot is killed


def taint_id(node_id: str, device: str, metric: str | None, slot: int | None = None) -> str:
    """Stable per (node, device, metric), readable in ``tpassctl status``, and safe as one etcd path part.

    A ``rank<R>`` device moves with its rank, so its slot is part of the id: a rank that is slow again in
    the spare it moved to is a new problem, in another slot.
    """
    where = f"-slot{slot}" if slot is not None and device.startswith("rank") else ""
    raw = f"h-{node_id}-{device}{where}-{metric or 'any'}"
    return re.sub(r"[^A-Za-z0-9_.:-]", "_", raw)


def decide(verdict: HealthVerdict, slot: SlotInfo | None, written: Sequence[WrittenTaint], *, node_id: str,
           now_wall: float) -> TaintAction:
    """The daemon's one decision: what a changed verdict does to the taints in etcd (pure).

    ``written`` are the taints we hold for ``verdict.device``.
    """
    device = verdict.device
    if not verdict.taints:
        if not written:
            return TaintAction(TaintOp.KEEP, f"{device}: {verdict.status.value}, no taint to remove")
        if verdict.status is not Status.HEALTHY:
            # An unreadable check is no proof of recovery (and a straggler that moved is warming up again).
            return TaintAction(TaintOp.KEEP, f"{device}: {verdict.status.value} ({verdict.reason}); the taint "
                                             "stays until the device reads healthy")
        if device.startswith("rank"):
            # A straggler verdict follows the rank, the taint stays with the slot it was slow in: only the
            # same rank recovering in that same slot clears it.
            here = [w for w in written if slot is not None and w.slot == slot.index]
            if not here:
                return TaintAction(TaintOp.KEEP, f"{device} is healthy in another slot now; slot(s) "
                                                 f"{', '.join(str(w.slot) for w in written)} stay tainted until "
                                                 "an operator untaints them")
            written = here
        ids = tuple(w.id for w in written)
        return TaintAction(TaintOp.DELETE, f"{device} healthy again ({verdict.reason}): remove {', '.join(ids)}",
                           delete=ids)
    if slot is None:
        return TaintAction(TaintOp.KEEP, f"{device}: {verdict.reason}; no local slot uses this device")
    tid = taint_id(node_id, device, verdict.metric, slot.index)
    if any(w.id == tid for w in written):
        return TaintAction(TaintOp.KEEP, f"{device}: already tainted as {tid}")
    effect = verdict.effect
    holds_rank = slot.rank is not None and slot.state == SlotState.RUNNING
    taint = Taint(id=tid, node_id=node_id, slot=slot.index,
                  rank=slot.rank if holds_rank and effect is not TaintEffect.EXCLUDE else None,
                  reason=f"{device}: {verdict.reason}", effect=effect, source=SOURCE, time=now_wall,
                  device=device, metric=verdict.metric, status=verdict.status.value)
    if effect is TaintEffect.EXCLUDE:
        return TaintAction(TaintOp.WRITE, f"exclude slot {slot.index} ({device}) from the spare pool: "
                                          f"{verdict.reason}", taint=taint)
    if not holds_rank:
        return TaintAction(TaintOp.WRITE, f"slot {slot.index} ({device}, {slot.state}) holds no rank: taint it "
                                          f"so it is not handed out: {verdict.reason}", taint=taint)
    if effect is TaintEffect.FAIL:
        return TaintAction(TaintOp.WRITE, f"rank {slot.rank} in slot {slot.index} ({device}) fails now: "
                                          f"{verdict.reason}", taint=taint.handled(KILLED, "killed"),
                           kill_slot=slot.index)
    return TaintAction(TaintOp.WRITE, f"migrate rank {slot.rank} off slot {slot.index} ({device}): {verdict.reason}",
                       taint=taint)


class AgentHealth:
    """The health monitor of one agent, wired to its slots, its event log and etcd.

    Construct it once per agent and call :meth:`run` in every generation (state such as counter baselines
    and the taints written survives); constructing it per generation works too, it then adopts the taints
    its predecessor wrote.

    Args:
        agent: what the daemon reads of its agent (:class:`tpassrun.swapper.agentport.HealthHost`: ``cfg``, ``node_id``,
            ``rdzv``, ``slots``, ``events``, ``environ``).
        sensors: replaces the default NVML + file sensors (tests, benchmarks).
        clock: monotonic time the verdicts are judged at.
        wall_clock: wall time written into taints.
    """

    def __init__(self, agent: HealthHost, *, sensors: Sequence[Sensor] | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.agent = agent
        self._sensors = list(sensors) if sensors is not None else None
        self._clock = clock
        self._wall_clock = wall_clock
        self.monitor: HealthMonitor | None = None
        self.straggler: StragglerDetector | None = None
        self.written: dict[str, WrittenTaint] = {}
        self._rank_slot: dict[int, int] = {}        # rank -> slot its step times came from
        self._rank_step: dict[int, int] = {}        # rank -> step of the last sample taken
        self.link: Any = None                       # netwatch.LinkDaemon: this node's link, judged against its peers

    # ------------------------------------------------------------------ setup (first run)
    def _build(self) -> HealthMonitor:
        cfg = self.agent.cfg
        policy = Policy.load(cfg.health_config) if cfg.health_config else Policy.default()
        sensors = self._sensors if self._sensors is not None else self._default_sensors()
        from tpassrun.agent.netwatch import LinkDaemon

        self.link = LinkDaemon(self, policy.link, clock=self._clock)
        straggler_factor = float(cfg.straggler_factor or 0.0)
        if straggler_factor > 0:
            self.straggler = StragglerDetector(factor=straggler_factor)
        return HealthMonitor(sensors, PolicyEngine(policy), interval=float(cfg.health_interval),
                             on_verdicts=self._on_verdicts, clock=self._clock, log=self._say,
                             straggler=self.straggler, step_times=self._step_times if self.straggler else None)

    def _default_sensors(self) -> list[Sensor]:
        sensors: list[Sensor] = [NvmlSensor()]
        path = getattr(self.agent.cfg, "health_file", None) or self.agent.environ.get(E.TPASSRUN_HEALTH_FILE)
        if path:
            sensors.append(FileSensor(path))
        return sensors

    def _say(self, message: str) -> None:
        # "no GPU" is the normal state of a CPU cluster: say it once, quietly (the console stays torchrun's).
        (log.info if "no GPU" in message else log.warning)("%s", message)
        emit(self.agent.events, HealthMessage(message=message))

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Poll and publish until cancelled (the agent cancels it at the end of each generation)."""
        if self.monitor is None:
            self.monitor = self._build()
        await self._sync_taints()
        # Our taints' devices: their next verdict must reach us even if it looks like no change to the
        # monitor (a previous run may have been cancelled between writing a taint and recording that).
        self.monitor.redeliver({w.device for w in self.written.values()})
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.monitor.run())
            tg.create_task(self._publish_loop())
            if self.link is not None:
                tg.create_task(self.link.run())

    async def _sync_taints(self) -> None:
        """Make ``written`` match etcd: adopt what an earlier instance on this node wrote (ours to delete
        when the device recovers) and forget what an operator removed meanwhile."""
        rdzv = self.agent.rdzv
        found: dict[str, WrittenTaint] = {}
        for key, doc, rev in await rdzv.store.get_prefix_json(Keys(rdzv.key("")).family("taints")):
            t = load(Taint.from_json, key, doc, rev)
            if (t is not None and t.source == SOURCE and t.node_id == self.agent.node_id and t.device
                    and t.slot is not None):
                found[t.id] = WrittenTaint(t.id, t.device, t.metric, t.slot, t.rank)
        self.written = found

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_EVERY_S)
            await self.publish()

    async def publish(self) -> None:
        if self.monitor is None:
            return
        rdzv = self.agent.rdzv
        snap = self.monitor.snapshot()
        link = self.link      # netwatch: this node's link figures (what the peers compare with) and verdict
        record = HealthRecord(node_id=self.agent.node_id, time=self._wall_clock(), taints=tuple(sorted(self.written)),
                              polls=int(snap.get("polls", 0)), unavailable=dict(snap.get("unavailable") or {}),
                              readings=tuple(snap.get("readings") or ()) + tuple(link.readings() if link else ()),
                              verdicts=tuple(snap.get("verdicts") or ()) + tuple(link.verdicts() if link else ()))
        with contextlib.suppress(Exception):  # status is best effort; the taints are what must land
            await rdzv.store.put_json(Keys(rdzv.key("")).health(self.agent.node_id), record.to_json(), lease=True)

    # ------------------------------------------------------------------ inputs
    def slot_for_device(self, device: str) -> SlotInfo | None:
        """``gpuN`` -> the slot using that GPU; ``rankR`` -> the running slot holding rank R."""
        slots = self.agent.slots.slots
        if device.startswith("rank") and device[4:].isdigit():
            rank = int(device[4:])
            for s in slots:
                if s.rank == rank and s.state == SlotState.RUNNING:
                    return SlotInfo(s.index, s.rank, s.state)
            return None
        visible = self.agent.environ.get(E.CUDA_VISIBLE_DEVICES)
        for s in slots:
            try:
                if device_for_local_rank(s.index, visible) == device:
                    return SlotInfo(s.index, s.rank, s.state)
            except ValueError:  # more slots than visible GPUs: those slots have no device to watch
                continue
        return None

    def _step_times(self) -> Mapping[int, float | None]:
        """rank -> duration of its last step, one sample per completed step (None: no new step since)."""
        slots = self.agent.slots
        out: dict[int, float | None] = {}
        for s in slots.slots:
            if s.rank is None or s.state != SlotState.RUNNING:
                continue
            if self._rank_slot.get(s.rank) != s.index:
                # Another process now carries this rank (a swap): the old history says nothing about it.
                assert self.straggler is not None
                self.straggler.forget(s.rank)
                self._rank_slot[s.rank] = s.index
                self._rank_step.pop(s.rank, None)
            step, last_ns = slots.field(s, Field.STEP), slots.field(s, STEP_TIME_FIELD)
            if last_ns <= 0 or self._rank_step.get(s.rank) == step:
                out[s.rank] = None
                continue
            self._rank_step[s.rank] = step
            out[s.rank] = last_ns / 1e9
        return out

    # ------------------------------------------------------------------ outputs
    async def _on_verdicts(self, verdicts: list[HealthVerdict]) -> None:
        for verdict in verdicts:
            slot = self.slot_for_device(verdict.device)
            mine = [w for w in self.written.values() if w.device == verdict.device]
            action = decide(verdict, slot, mine, node_id=self.agent.node_id, now_wall=self._wall_clock())
            if action.op is TaintOp.KEEP and not verdict.taints and not mine:
                continue  # routine news (warming up, healthy): the snapshot shows it, the event log need not
            emit(self.agent.events, HealthVerdictNoted(device=verdict.device, status=verdict.status.value,
                                                       effect=verdict.effect.value, metric=verdict.metric, reason=verdict.reason,
                                                       slot=slot.index if slot else None, rank=slot.rank if slot else None,
                                                       action=action.op.value, why=action.reason))
            await self._apply(action, verdict)
        await self.publish()

    async def apply_verdict(self, verdict: HealthVerdict, index: int, rank: int | None, state: str) -> str | None:
        """A verdict found outside the monitor (the link watch) for a slot's device, decided and carried out as the
        monitor's are; -> the id of the taint written, if any."""
        written = [w for w in self.written.values() if w.device == verdict.device]
        action = decide(verdict, SlotInfo(index, rank, state), written, node_id=self.agent.node_id,
                        now_wall=time.time())
        await self._apply(action, verdict)
        return action.taint.id if action.taint is not None else None

    async def _apply(self, action: TaintAction, verdict: HealthVerdict) -> None:
        rdzv = self.agent.rdzv
        if action.op is TaintOp.WRITE:
            taint = action.taint
            assert taint is not None and taint.slot is not None
            # Recorded before the write: a generation ending mid-write must not leave a taint nobody removes.
            self.written[taint.id] = WrittenTaint(taint.id, verdict.device, verdict.metric, taint.slot, taint.rank)
            # create, not put: never clobber the coordinator's handled_by/state on a taint we already wrote.
            created = await rdzv.store.create_json(Keys(rdzv.key("")).taint(taint.id), taint.to_json())
            emit(self.agent.events, HealthTaint(id=taint.id, slot=taint.slot, rank=taint.rank, effect=taint.effect.value,
                                                reason=taint.reason, created=created))
            if action.kill_slot is not None:
                self._kill(action.kill_slot, taint.reason)
        elif action.op is TaintOp.DELETE:
            for tid in action.delete:
                await rdzv.store.delete(Keys(rdzv.key("")).taint(tid))
                self.written.pop(tid, None)
                emit(self.agent.events, HealthUntaint(id=tid, device=verdict.device, reason=action.reason))

    def _kill(self, index: int, reason: str) -> None:
        slot = self.agent.slots.slots[index]
        if slot.proc is not None and slot.proc.signal_group(signal.SIGKILL):
            emit(self.agent.events, HealthKill(slot=index, rank=slot.rank, pid=slot.pid, reason=reason))

__all__ = ["AgentHealth", "SlotInfo", "TaintAction", "TaintOp", "WrittenTaint", "decide", "taint_id"]
