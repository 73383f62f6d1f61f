"""Live swaps: the effects around the pure planner in :mod:`tpassrun.plan.swap`.

Two roles run in every agent:

* **participant** (every agent): follows ``swaps/<id>`` in etcd and carries out its node's part of the
  current phase (pause its workers, let them run to the boundary, hand a spare its rank, tell the leaver to
  stream, re-form the world), then writes ``reports/<id>/<seq>/<node>``.
* **coordinator** (the rendezvous leader only, :mod:`tpassrun.swapper.coordinator`): turns taints and worker deaths
  into plans, and advances a plan when every report for its phase is in (:mod:`tpassrun.plan.triage`, pure).

The swapper sees its agent only through :class:`tpassrun.swapper.agentport.AgentPort`. This module follows the plans and the
agent's hooks; what this node does in each phase is :mod:`tpassrun.swapper.phases` (a node plan's:
:mod:`tpassrun.swapper.nodeswap`).

All of it happens while workers are stopped between two steps; healthy ranks never wait on etcd otherwise.
A planned swap's joiner is handed its rank as BOUNDARY starts, so it already listens when the survivors reach
the boundary and TRANSFER costs no handshake with it (it stays able to take an abort or a new assignment).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from tpassrun.channel import STOP_NOW, Failed, Field, Raise, Reserve, Slot, SlotState, WorkerPhase
from tpassrun.plan import Phase, SwapKind, classify_death, recoverable
from tpassrun.records import (
    AgentGone,
    Failure,
    FailureDropped,
    Fallback,
    HandBack,
    Keys,
    MigrateBackRequested,
    NodeHandedBack,
    NodeLost,
    PoolNodeLeft,
    Report,
    SpareReturned,
    SwapPlan,
    SwapPlanSeen,
    SwapResumed,
    Taint,
    TaintEffect,
    TaintSource,
    UserError,
    WorkerDied,
    emit,
    load,
    seal,
)
from tpassrun.swapper import shardplane
from tpassrun.swapper.agentport import (
    AgentEvent,
    AgentPort,
    EventSink,
    FallbackRequested,
    HandedBack,
    HealthHost,
    HealthRestartRequested,
    LeaseLost,
    RendezvousChanged,
    SignalReceived,
    SpawnFailed,
    StatusHost,
    SwapSettings,
    WorkerExited,
    WorkerSaid,
    annotated,
)
from tpassrun.swapper.coordinator import Coordinator
from tpassrun.swapper.mirrorplane import MirrorPlane
from tpassrun.swapper.nodeswap import NodePlans
from tpassrun.swapper.phases import Phases
from tpassrun.swapper.ranks import LocalRanks

if TYPE_CHECKING:
    from tpassrun.channel import LocalSlots
    from tpassrun.rendezvous import EtcdStore, Generation

log = logging.getLogger(__name__)

FAILED_STEP_GRACE_S = 30.0    # a worker that failed in a collective with no recovery planned by then re-raises
# A slot whose worker was killed by a signal (SIGKILL, the OOM killer, a hang kill; a rank recovered live or a
# spare) comes back as a spare once the swap is over, unless a taint holds it or it keeps dying:
# DEATHS_TO_QUARANTINE deaths within DEATH_WINDOW_S keep it out for good (a crash loop, a bad device). Without
# this every such death cost a spare for the rest of the run. A worker that exited with a code of its own (it may
# have seen its device fail) leaves its slot quarantined, as before.
DEATHS_TO_QUARANTINE = 3
DEATH_WINDOW_S = 600.0


def me_in(plan: SwapPlan, node: str) -> bool:
    """Whether ``node`` takes part in ``plan`` (its joiners' and leavers' nodes are among its nodes)."""
    return node in plan.nodes or any(node in (m.joiner.node, m.leaver.node) for m in plan.all_moves)


class Swapper:
    """The participant half of live swaps (every agent): follows the plans, answers the agent's hooks, and runs
    this node's part of each phase through its :class:`Phases` (node plans through its ``NodePlans``), which are
    given what they need and return their reports. The plan being carried out (``_active``) is the swapper's alone."""

    def __init__(self, port: AgentPort) -> None:
        self.port = port
        self._done: set[tuple[str, int]] = set()     # (swap id, seq) this node already handled
        self._active: SwapPlan | None = None
        self.coordinator = Coordinator(port)
        self._failed_timers: dict[int, asyncio.TimerHandle] = {}
        self._probe: asyncio.Future[None] | None = None
        self.ranks = LocalRanks(port)
        self.phases = Phases(port, self.ranks, view=self.coordinator.view, died=self.died)
        self.node_plans = NodePlans(port, self.ranks, self.phases)
        self._deaths: dict[int, list[float]] = {}    # slot -> when its workers died (to re-admit it as a spare)
        # plans given up while their world re-formed (a rank died on its way in): their joiners hold their ranks
        # and enter the world the next plan re-forms; their ranks resumed live once that plan is done
        self._joining: list[SwapPlan] = []

    # ------------------------------------------------------------------ agent hooks
    @property
    def busy(self) -> bool:
        return self._active is not None and self._active.phase not in (Phase.DONE, Phase.ABORTED)

    @property
    def recovering(self) -> bool:
        """A recovery of a dead rank or a lost node is under way (a planned swap is not a failure)."""
        return self.busy and self._active is not None and self._active.kind in (SwapKind.UNPLANNED, SwapKind.NODE)

    def probe_agents(self) -> None:
        """A worker here failed: declare a node whose agent is gone lost now (once at a time)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._probe_agents())

    async def _probe_agents(self) -> None:
        """A collective failed here, so a peer died. A node whose agent is gone (it crashed or was killed: its
        workers died with it) is declared lost at once by revoking its lease, instead of after the lease's TTL;
        the node plan starts from there. Anything less certain (no answer at all) waits for the lease."""
        mirror, gen = self.port.mirror(), self.port.latest() or self.port.generation()
        if mirror is None or gen is None:
            return

        async def probe(node: str) -> None:
            try:
                if await mirror.agent_gone(node) and await self._store.revoke_lease_of(self._keys.node(node)):
                    log.warning("node %s: its agent is gone (its mirror port refuses connections); revoked its "
                                "lease", node)
                    emit(self.port.events, AgentGone(lost_node=node,
                                                     reason="its agent's port refuses connections: declared lost now"))
            except Exception as exc:  # noqa: BLE001 - the lease expiry still comes
                log.debug("probing node %s: %s", node, exc)

        nodes = [m.node_id for m in gen.members] + list(gen.spare_nodes)
        await asyncio.gather(*(probe(n) for n in nodes if n != self.port.node_id and n not in gen.lost))

    @property
    def _slots(self) -> LocalSlots:
        return self.port.slots

    @property
    def _keys(self) -> Keys:
        return Keys(self.port.rdzv.key(""))

    @property
    def _store(self) -> EtcdStore:
        return self.port.rdzv.store

    def on_spare_lost(self, slot: Slot) -> None:
        self.died(slot)
        self.coordinator.kick()
        asyncio.ensure_future(self.port.publish_status())
        if not self.busy:
            asyncio.ensure_future(self.readmit_dead_slots())

    def died(self, slot: Slot) -> None:
        """Note that ``slot``'s worker died (a signal: see DEATHS_TO_QUARANTINE)."""
        if slot.exit_code is not None and slot.exit_code < 0:
            self._deaths.setdefault(slot.index, []).append(time.monotonic())

    async def readmit_dead_slots(self) -> None:
        """Start a spare in each slot of this node whose worker was killed by a signal, once no swap is in
        flight (see DEATHS_TO_QUARANTINE)."""
        if self.busy or not self.port.master()[1]:
            return
        held = None
        now = time.monotonic()
        for index, deaths in sorted(self._deaths.items()):
            s = self._slots.slots[index]
            if s.state not in (SlotState.DEAD, SlotState.QUARANTINED) or s.alive or s.exit_code is None \
                    or s.exit_code >= 0:
                continue
            recent = [t for t in deaths if now - t < DEATH_WINDOW_S]
            if len(recent) >= DEATHS_TO_QUARANTINE:
                continue
            if held is None:
                held = {(t.node_id, t.slot) for t in await self.coordinator.taints()}
            if (self.port.node_id, index) in held or self.busy or s.state not in (SlotState.DEAD,
                                                                                 SlotState.QUARANTINED):
                continue
            s.quarantine_reason, s.home_rank = None, None
            await self.port.spawn_spare(s)
            why = f"its worker died ({len(recent)} time(s) in {DEATH_WINDOW_S:g} s): re-admitted"
            emit(self.port.events, SpareReturned(slot=index, reason=why))

    def hint_spares(self) -> None:
        """Tell this node's ready spares how much state a rank here holds (what the ranks publish after their
        first step), so they pre-fault a receive arena while idle. Never during a swap: an assigned spare is
        busy, and faulting memory in would compete with the transfer."""
        if self.busy:
            return
        size = max((self._slots.field(s, Field.STATE_BYTES) for s in self._slots.active()), default=0)
        if size <= 0:
            return
        want = size + size // 16 + (16 << 20)   # the leaver also sends RNG and per-rank objects
        for s in self._slots.slots:
            if s.state == SlotState.SPARE and s.alive and s.managed and s.reserved < size:
                s.reserved = want
                self._slots.send(s, Reserve(nbytes=want))

    def on_generation_committed(self, gen: "Generation") -> None:
        pass

    async def on_node_lost(self, node_id: str) -> bool:
        """The leader heard that a node's lease ended: its coordinator moves the node's ranks live (a node plan)
        or restarts the group saying why; a node that held no ranks (an idle spare node) costs nothing. A pool
        node's spare node the job gave back leaves as expected, and is said so."""
        pool = self.coordinator.pool
        key = self._keys.handback(node_id)
        doc, rev = await self._store.get_json(key)
        handback = load(HandBack.from_json, key, doc, rev) if doc is not None else None
        if handback is not None:       # handed back to the scheduler, holding no rank: no loss
            emit(self.port.events, NodeHandedBack(lost_node=node_id, sched_node=handback.node, reason=handback.reason))
        elif pool is not None and node_id in pool.given_back:
            emit(self.port.events, PoolNodeLeft(lost_node=node_id, pool=pool.name, pool_node=pool.given_back.pop(node_id)))
        else:
            emit(self.port.events, NodeLost(lost_node=node_id))
        self.coordinator.kick()
        return True

    def on_worker_failed_step(self, slot: Slot, msg: Failed) -> None:
        """A survivor's collective failed. Normally a death elsewhere is being recovered; if nothing claims
        this worker within the grace period, it re-raises and the ordinary failure path takes over."""
        loop = asyncio.get_running_loop()
        old = self._failed_timers.pop(slot.index, None)
        if old is not None:
            old.cancel()

        def expire() -> None:
            if not self.busy and self._slots.phase(slot) == WorkerPhase.FAILED:
                self._slots.send(slot, Raise(reason="no recovery was planned for this failure"))

        # a pool node (--spare-pool) may be claimed and start its spares meanwhile: its wait counts too
        self._failed_timers[slot.index] = loop.call_later(FAILED_STEP_GRACE_S + self.port.settings.pool_wait, expire)
        self.probe_agents()

    async def on_worker_death(self, slot: Slot, code: int) -> bool:
        """Return True when an unplanned swap will take care of this death."""
        cfg = self.port.settings
        if not slot.managed or slot.rank is None:
            return False
        gen = self.port.annotated()     # spare nodes that joined since the generation formed count
        if gen is None or (cfg.spares_per_node == 0 and not gen.spare_nodes and not cfg.pool_wait):
            return False
        step = self._slots.field(slot, Field.STEP)
        lease = self._store.lease_id      # the lease this death is seen under (see the failure's write below)
        kind, why = classify_death(code, self._slots.phase(slot))
        if not recoverable(kind):   # a spare would only raise again: torchrun's path, at once
            emit(self.port.events, UserError(slot=slot.index, rank=slot.rank, code=code, step=step, why=why))
            return False
        light = self._slots.channel.read_light(slot.index) if self._slots.channel else None
        failure = Failure(node=self.port.node_id, slot=slot.index, rank=slot.rank, code=code, step=step,
                          light=light is not None, generation=gen.number, time=time.time(),
                          replicas=slot.replicas, alone=slot.alone,
                          sharded=shardplane.tracks_sharded(self._slots.channel, slot.index))
        emit(self.port.events, WorkerDied(slot=slot.index, rank=slot.rank, code=code, step=step, kind=kind.value, why=why))
        # Stop the other local ranks at their next step start (the ones blocked in a collective will fail).
        for s in self._slots.active():
            if s is not slot:
                self._slots.set_run_until(s, STOP_NOW)
        self._keep_dead_lights(slot)
        # Only under the lease the death was seen under: a node cut off from etcd (its watchdog killed a rank
        # blocked on the partition) wrote this record when etcd came back, after the others had declared it lost
        # and moved all of its ranks live; read then, it made the leader "recover" a rank that ran elsewhere.
        if not await self._store.put_json_while_leased(self._keys.failure(self.port.node_id, slot.index),
                                                       failure.to_json(), guard=self._keys.node(self.port.node_id),
                                                       lease_id=lease):
            emit(self.port.events, FailureDropped(slot=slot.index, rank=slot.rank,
                                                  reason="this node's etcd lease ended since the death: its ranks are the lost "
                                          "node's plan's"))
            return True      # (this node fences itself for the same reason: no restart from here)
        await self.port.publish_status()
        return True

    def _keep_dead_lights(self, slot: Slot) -> None:
        """Copy a dead worker's two light snapshots from shared memory into this node's mirror store, under its
        rank: a plan replacing several dead ranks at once (a second fault during a recovery) reads every dead
        rank's snapshot from its node's mirror, as a node plan reads a lost node's."""
        mirror, ch = self.port.mirror(), self._slots.channel
        if mirror is None or ch is None or slot.rank is None:
            return
        frames = []
        for previous in (True, False):           # older first: the store keeps the newest two
            step, data = ch.light_step(slot.index, previous), ch.read_light(slot.index, previous)
            if step is not None and data is not None:
                frames.append((step, data))
        mirror.keep_lights(slot.rank, frames)

    # ------------------------------------------------------------------ main loop
    async def run(self, gen: "Generation") -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._follow_plans())
            tg.create_task(self.coordinator.run())
            tg.create_task(self._follow_taint_removals())
            tg.create_task(self._follow_fallbacks())
            tg.create_task(self._follow_handback())

    async def _follow_plans(self) -> None:
        prefix = self._keys.family("swaps")
        items, header = await self._store.read_prefix_json(prefix)
        for key, doc, rev, _created in items:
            plan = load(SwapPlan.from_json, key, doc, rev)
            if plan is not None:
                await self._on_plan(plan)
        # from the revision read on, not from whenever the plans read were carried out: a phase the leader wrote
        # meanwhile is seen (_done drops what was seen twice)
        async for ev in self._store.watch_prefix(prefix, header + 1):
            if ev.kind != "put":
                continue
            plan = load(SwapPlan.from_json, ev.key, ev.value, ev.mod_revision)
            if plan is not None:
                await self._on_plan(plan)

    async def _on_plan(self, plan: SwapPlan) -> None:
        gen = self.port.generation()
        if gen is None or plan.generation < gen.number - 1 and plan.phase not in (Phase.DONE, Phase.ABORTED):
            return
        if plan.generation < self.port.spawned_generation():
            # Planned before the last whole-group restart: its workers are gone. Nothing to carry out, and
            # nothing to undo either (undoing an aborted recovery means a fallback restart: not again).
            return
        seq = len(plan.history)
        if (plan.id, seq) in self._done:
            return
        self._done.add((plan.id, seq))
        if plan.store is not None and plan.phase in (Phase.REFORM, Phase.DONE):
            # the workers' store moved with this swap: every agent follows, not only those re-forming, so that
            # whichever agent writes the next plan names the live store, never the lost node's
            self.port.set_master(plan.store, plan.store_host)
        if plan.kind == SwapKind.NODE and plan.terminal and seq == 1:
            return   # a lost node with no live recovery: the leader restarts the group, says why
        self._active = plan
        emit(self.port.events, SwapPlanSeen(swap_id=plan.id, kind=plan.kind, rank=plan.leaver.rank, leaver=plan.leaver,
                                            joiner=plan.joiner, boundary=plan.boundary, attempt=plan.attempt,
                                            ranks=list(plan.ranks), lost_node=plan.lost_node, phase=plan.phase))
        try:
            report = await self._participate(plan)
        except Exception as exc:  # a failed phase is reported, never fatal for the agent
            log.exception("swap %s phase %s failed", plan.id, plan.phase.value)
            report = Report(node=self.port.node_id, phase=plan.phase, ok=False, error=f"{type(exc).__name__}: {exc}")
        if plan.phase == Phase.ABORTED and plan.superseded and len(plan.history) >= 2 \
                and plan.history[-2][0] == Phase.REFORM.value and me_in(plan, self.port.node_id):
            self._joining.append(plan)
        elif plan.phase == Phase.DONE or (plan.phase == Phase.ABORTED and not plan.superseded):
            joined, self._joining = self._joining, []     # (not superseded: the group restarts)
            for old in joined if plan.phase == Phase.DONE else ():
                emit(self.port.events, SwapResumed(swap_id=old.id, rank=old.leaver.rank, ranks=list(old.ranks),
                                                   seconds=round(plan.history[-1][1] - old.history[0][1], 4), with_swap=plan.id))
        if report is not None:
            key = self._keys.report(plan.id, seq, self.port.node_id)
            await self._store.put_json(key, seal(key, report.to_json()))   # with the run key's MAC
                                                                           # (tpassrun/records/provenance.py)
        await self.port.publish_status()
        self.coordinator.kick()

    # ------------------------------------------------------------------ participant
    async def _participate(self, plan: SwapPlan) -> Report | None:
        me = self.port.node_id
        phase = plan.phase
        if plan.kind == SwapKind.NODE:
            report = await self.node_plans.participate(plan)
            if phase in (Phase.DONE, Phase.ABORTED):
                self._active = None
            return report
        if phase == Phase.PAUSE:
            return await self.phases.pause(plan) if me in plan.nodes else None
        if phase == Phase.BOUNDARY:
            return await self.phases.boundary(plan) if me in plan.nodes else None
        if phase == Phase.TRANSFER:
            return await self.phases.transfer(plan)
        if phase == Phase.SEND:
            return await self.phases.send(plan)
        if phase == Phase.REFORM:
            return await self.phases.reform(plan) if me in plan.nodes else None
        if phase == Phase.DONE:
            emit(self.port.events, SwapResumed(swap_id=plan.id, rank=plan.leaver.rank,
                                               seconds=round(plan.history[-1][1] - plan.history[0][1], 4)))
            self._active = None
            await self.readmit_dead_slots()
            return None
        if phase == Phase.ABORTED:
            self.phases.cancel_early()
            await self.phases.abort(plan)
            self._active = None
            return None
        return None


    async def _follow_fallbacks(self) -> None:
        """The leader found no way to recover a rank of this node (no spare left): restart the group, as
        torchrun would. Without this, the dead rank's agent waited for a recovery that never came."""
        key = self._keys.fallback(self.port.node_id)
        async for ev in self._store.watch_key(key):
            fallback = load(Fallback.from_json, key, ev.value, ev.mod_revision) if ev.kind == "put" else None
            if fallback is None or fallback.generation < self.port.spawned_generation():
                continue   # malformed (logged once), or from before the last whole-group restart
            index = fallback.slot
            dead = self._slots.slots[index] if index is not None and index < len(self._slots.slots) else None
            self.port.post(FallbackRequested(fallback.reason, dead))

    async def _follow_handback(self) -> None:
        """The leader's scheduler watcher hands this node back to the scheduler (``handbacks/<node>``): the agent
        leaves the job (see :class:`~tpassrun.swapper.agentport.HandedBack`)."""
        key = self._keys.handback(self.port.node_id)
        doc, rev, header = await self._store.read_json(key)     # written before this generation's watch began
        if doc is not None and (handback := load(HandBack.from_json, key, doc, rev)) is not None:
            self.port.post(HandedBack(handback.reason))
        async for ev in self._store.watch_key(key, header + 1):
            handback = load(HandBack.from_json, key, ev.value, ev.mod_revision) if ev.kind == "put" else None
            if handback is not None:
                self.port.post(HandedBack(handback.reason))

    async def _follow_taint_removals(self) -> None:
        """``tpassctl untaint``: a quarantined slot of this node goes back to the spare pool."""
        async for ev in self._store.watch_prefix(self._keys.family("taints")):
            if ev.value is not None:
                continue
            await self._requarantine_check()

    async def _requarantine_check(self) -> None:
        held = {(t.node_id, t.slot) for t in await self.coordinator.taints()}
        gen = self.port.generation()
        if gen is None or not self.port.master()[1]:
            return
        for s in self._slots.slots:
            if s.state == SlotState.QUARANTINED and (self.port.node_id, s.index) not in held:
                s.quarantine_reason = None
                await self.port.spawn_spare(s)
                emit(self.port.events, SpareReturned(slot=s.index))
                home, s.home_rank = s.home_rank, None
                if self.port.settings.migrate_back and home is not None:
                    await self._request_migrate_back(home, s)

    async def _request_migrate_back(self, rank: int, home: Slot) -> None:
        """--migrate-back: the slot a rank was moved off is healthy again; move the rank home once the new
        spare there is ready (the planner waits for it), and free the slot it leaves."""
        tid = f"mb-{self.port.node_id}-{home.index}-{int(time.time() * 1000)}"
        taint = Taint(id=tid, effect=TaintEffect.MIGRATE, rank=rank, source=TaintSource.MIGRATE_BACK.value,
                      reason=f"migrate back to healthy slot {self.port.node_id}/{home.index}",
                      home_node=self.port.node_id, home_slot=home.index, time=time.time())
        await self._store.put_json(self._keys.taint(tid), taint.to_json())
        emit(self.port.events, MigrateBackRequested(rank=rank, slot=home.index, taint=tid))
        await self.port.publish_status()


__all__ = ["DEATHS_TO_QUARANTINE", "DEATH_WINDOW_S", "FAILED_STEP_GRACE_S", "Swapper", "me_in", "shardplane",
           # what the swapper sees of its agent, and what the agent tells it (tpassrun.swapper.agentport)
           "AgentEvent", "AgentPort", "EventSink", "FallbackRequested", "HandedBack", "HealthHost",
           "HealthRestartRequested", "LeaseLost",
           "RendezvousChanged", "SignalReceived", "SpawnFailed", "StatusHost", "SwapSettings", "WorkerExited",
           "WorkerSaid", "annotated",
           # the agent's mirror plane (tpassrun.swapper.mirrorplane)
           "MirrorPlane"]
