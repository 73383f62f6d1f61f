"""Live swaps: the effects around the pure planner in :mod:`tpassrun.swap`.

Two roles run in every agent:

* **participant** (every agent): follows ``swaps/<id>`` in etcd and carries out its node's part of the
  current phase (pause its workers, let them run to the boundary, hand a spare its rank, tell the leaver to
  stream, re-form the world), then writes ``reports/<id>/<seq>/<node>``.
* **coordinator** (the rendezvous leader only): turns taints and worker deaths into plans, and advances a
  plan when every report for its phase is in. Decisions come from :func:`tpassrun.swap.next_step`; this
  class only reads etcd, calls it, and writes what it returns (compare-and-swap, so a leader change mid-swap
  cannot fork a plan).

All of it happens while workers are stopped between two steps; healthy ranks never wait on etcd otherwise.
A planned swap's joiner is handed its rank as BOUNDARY starts, so it already listens when the survivors reach
the boundary and TRANSFER costs no handshake with it (it stays able to take an abort or a new assignment).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from .channel import INT64_MAX, Field, WorkerPhase
from .records import (HANDLED_RESTART, Failure, Fallback, Keys, NodeStatus, RecordError, Report, SwapPlan, Taint,
                      TaintEffect, TaintSource, load, node_info)
from .swap import (ClusterView, Decision, Phase, SlotRef, SlotView, SwapKind, choose_spare,
                   next_step, plan_for_failure, plan_for_taint)
from .failkind import classify_death, recoverable
from .slots import Slot, SlotState

if TYPE_CHECKING:
    from .agent import Agent
    from .rendezvous import Generation

log = logging.getLogger("tpassrun.swap")

PAUSE_SETTLE_S = 0.03         # how long a RUNNING step must stay unchanged before we call it "stuck in a collective"
PHASE_TIMEOUT_S = 120.0
FAILED_STEP_GRACE_S = 30.0    # a worker that failed in a collective with no recovery planned by then re-raises


class Swapper:
    def __init__(self, agent: "Agent") -> None:
        self.agent = agent
        self._done: set[tuple[str, int]] = set()     # (swap id, seq) this node already handled
        self._active: SwapPlan | None = None
        self._kick = asyncio.Event()
        self._waiting_said: set[str] = set()
        self._taints_said: set[str] = set()
        self._failed_timers: dict[int, asyncio.TimerHandle] = {}
        # planned swaps: the joiner is assigned during BOUNDARY; (swap id, attempt, slot) -> its address or error
        self._early: tuple[tuple[str, int, int], asyncio.Task] | None = None
        self._transfers_seen: set[tuple[str, int]] = set()   # (swap id, attempt) this node followed into TRANSFER

    # ------------------------------------------------------------------ agent hooks
    @property
    def busy(self) -> bool:
        return self._active is not None and self._active.phase not in (Phase.DONE, Phase.ABORTED)

    @property
    def _slots(self):  # noqa: ANN202
        assert self.agent.slots is not None
        return self.agent.slots

    @property
    def _keys(self) -> Keys:
        assert self.agent.rdzv is not None
        return Keys(self.agent.rdzv.key(""))

    @property
    def _store(self):  # noqa: ANN202
        assert self.agent.rdzv is not None
        return self.agent.rdzv.store

    def on_spare_lost(self, slot: Slot) -> None:
        self._kick.set()
        asyncio.ensure_future(self.agent.publish_status())

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
                self._slots.send(s, "reserve", nbytes=want)

    def on_generation_committed(self, gen: "Generation") -> None:
        pass

    async def on_node_lost(self, node_id: str) -> bool:
        return False  # whole-node replacement by a spare node: not implemented, restart the group instead

    def on_worker_failed_step(self, slot: Slot, msg: dict[str, Any]) -> None:
        """A survivor's collective failed. Normally a death elsewhere is being recovered; if nothing claims
        this worker within the grace period, it re-raises and the ordinary failure path takes over."""
        loop = asyncio.get_running_loop()
        old = self._failed_timers.pop(slot.index, None)
        if old is not None:
            old.cancel()

        def expire() -> None:
            if not self.busy and self._slots.phase(slot) == WorkerPhase.FAILED:
                self._slots.send(slot, "raise", reason="no recovery was planned for this failure")

        self._failed_timers[slot.index] = loop.call_later(FAILED_STEP_GRACE_S, expire)

    async def on_worker_death(self, slot: Slot, code: int) -> bool:
        """Return True when an unplanned swap will take care of this death."""
        cfg = self.agent.cfg
        if not slot.managed or slot.rank is None:
            return False
        gen = self.agent.generation
        if gen is None or (cfg.spares_per_node == 0 and not gen.spare_nodes):
            return False
        step = self._slots.field(slot, Field.STEP)
        kind, why = classify_death(code, self._slots.phase(slot))
        if not recoverable(kind):   # a spare would only raise again: torchrun's path, at once
            self.agent.events.write("user_error", slot=slot.index, rank=slot.rank, code=code, step=step, why=why)
            return False
        light = self._slots.channel.read_light(slot.index) if self._slots.channel else None
        failure = Failure(node=self.agent.node_id, slot=slot.index, rank=slot.rank, code=code, step=step,
                          light=light is not None, generation=gen.number, time=time.time())
        self.agent.events.write("worker_died", slot=slot.index, rank=slot.rank, code=code, step=step,
                                kind=kind.value, why=why)
        # Stop the other local ranks at their next step start (the ones blocked in a collective will fail).
        for s in self._slots.active():
            if s is not slot:
                self._slots.set_run_until(s, 0)
        await self._store.put_json(self._keys.failure(self.agent.node_id, slot.index), failure.to_json())
        await self.agent.publish_status()
        return True

    # ------------------------------------------------------------------ main loop
    async def run(self, gen: "Generation") -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._follow_plans())
            tg.create_task(self._coordinate())
            tg.create_task(self._follow_taint_removals())
            tg.create_task(self._follow_fallbacks())

    async def _follow_plans(self) -> None:
        prefix = self._keys.family("swaps")
        for key, doc, rev in await self._store.get_prefix_json(prefix):
            plan = load(SwapPlan.from_json, key, doc, rev)
            if plan is not None:
                await self._on_plan(plan)
        async for ev in self._store.watch_prefix(prefix):
            if ev.kind != "put":
                continue
            plan = load(SwapPlan.from_json, ev.key, ev.value, ev.mod_revision)
            if plan is not None:
                await self._on_plan(plan)

    async def _on_plan(self, plan: SwapPlan) -> None:
        gen = self.agent.generation
        if gen is None or plan.generation < gen.number - 1 and plan.phase not in (Phase.DONE, Phase.ABORTED):
            return
        if plan.generation < self.agent.spawned_generation:
            # Planned before the last whole-group restart: its workers are gone. Nothing to carry out, and
            # nothing to undo either (undoing an aborted recovery means a fallback restart: not again).
            return
        seq = len(plan.history)
        if (plan.id, seq) in self._done:
            return
        self._done.add((plan.id, seq))
        self._active = plan
        self.agent.events.write(f"swap_{plan.phase.value}", swap_id=plan.id, kind=plan.kind.value,
                                rank=plan.leaver.rank, leaver=plan.leaver.to_json(), joiner=plan.joiner.to_json(),
                                boundary=plan.boundary, attempt=plan.attempt)
        try:
            report = await self._participate(plan)
        except Exception as exc:  # noqa: BLE001 - a failed phase is reported, never fatal for the agent
            log.exception("swap %s phase %s failed", plan.id, plan.phase.value)
            report = Report(node=self.agent.node_id, phase=plan.phase, ok=False, error=f"{type(exc).__name__}: {exc}")
        if report is not None:
            await self._store.put_json(self._keys.report(plan.id, seq, self.agent.node_id), report.to_json())
        await self.agent.publish_status()
        self._kick.set()

    # ------------------------------------------------------------------ participant
    async def _participate(self, plan: SwapPlan) -> Report | None:
        me = self.agent.node_id
        phase = plan.phase
        if phase == Phase.PAUSE:
            return await self._pause(plan) if me in plan.nodes else None
        if phase == Phase.BOUNDARY:
            return await self._boundary(plan) if me in plan.nodes else None
        if phase == Phase.TRANSFER:
            return await self._transfer(plan)
        if phase == Phase.SEND:
            return await self._send(plan)
        if phase == Phase.REFORM:
            return await self._reform(plan) if me in plan.nodes else None
        if phase == Phase.DONE:
            self.agent.events.write("swap_resumed", swap_id=plan.id, rank=plan.leaver.rank,
                                    seconds=round(plan.history[-1][1] - plan.history[0][1], 4))
            self._active = None
            return None
        if phase == Phase.ABORTED:
            self._cancel_early()
            await self._abort(plan)
            self._active = None
            return None
        return None

    def _survivors(self, plan: SwapPlan) -> list[Slot]:
        me = self.agent.node_id
        return [s for s in self._slots.active() if s.alive and s.managed
                and not (plan.leaver.node == me and s.index == plan.leaver.slot and plan.kind == SwapKind.UNPLANNED)]

    async def _pause(self, plan: SwapPlan) -> Report:
        survivors = self._survivors(plan)
        for s in survivors:
            self._slots.set_run_until(s, 0)
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        last: dict[int, tuple[int, int, float]] = {}
        dead_steps = self._dead_light_steps(plan)
        while True:
            now = time.monotonic()
            stationary, cand, paused, failed, post = True, 0, [], [], []
            for s in survivors:
                ph, step = self._slots.phase(s), self._slots.field(s, Field.STEP)
                if ph == WorkerPhase.PAUSED:
                    paused.append(step)
                    cand = max(cand, step)
                    continue
                if ph == WorkerPhase.FAILED:
                    # failed after its commit point: its model already holds the step's update
                    (post if self._slots.field(s, Field.COMMITTED) == step + 1 else failed).append(step)
                    cand = max(cand, step)
                    continue
                if not s.alive:
                    continue
                prev = last.get(s.index)
                if prev is None or prev[:2] != (int(ph), step):
                    last[s.index] = (int(ph), step, now)
                    stationary = False
                elif plan.kind == SwapKind.UNPLANNED or now - prev[2] < PAUSE_SETTLE_S:
                    stationary = False
                cand = max(cand, step + 1)
            if stationary:
                return Report(node=self.agent.node_id, phase=plan.phase, candidate=cand, steps=tuple(paused),
                              failed_steps=tuple(failed), post_commit=tuple(post), dead_steps=dead_steps)
            if now > deadline:
                return Report(node=self.agent.node_id, phase=plan.phase, ok=False,
                              error="workers did not stop within the phase timeout")
            await asyncio.sleep(0.002)

    def _dead_lights(self, plan: SwapPlan) -> list[tuple[int, bytes]]:
        """The dead rank's saved light snapshots as (step, bytes), newest first (unplanned, its node only).

        A worker keeps its last two in shared memory: the current step's start, and the commit-point one
        (labelled with the next step) or the previous step's start. One killed mid-write has no step (the
        channel says which step each buffer holds: the agent never decodes a snapshot, nor imports torch).
        """
        ch = self._slots.channel
        if plan.kind != SwapKind.UNPLANNED or plan.leaver.node != self.agent.node_id or not ch:
            return []
        found = []
        for previous in (False, True):
            step, data = ch.light_step(plan.leaver.slot, previous), ch.read_light(plan.leaver.slot, previous)
            if step is not None and data is not None:
                found.append((step, data))
        return found

    def _dead_light_steps(self, plan: SwapPlan) -> tuple[int, ...] | None:
        if plan.kind != SwapKind.UNPLANNED or plan.leaver.node != self.agent.node_id:
            return None
        return tuple(step for step, _ in self._dead_lights(plan))

    async def _boundary(self, plan: SwapPlan) -> Report:
        boundary = int(plan.boundary or 0)
        survivors = self._survivors(plan)
        if plan.kind == SwapKind.PLANNED and plan.joiner.node == self.agent.node_id:
            key = (plan.id, plan.attempt, plan.joiner.slot)
            if self._early is None or self._early[0] != key:
                self._cancel_early()
                self._early = (key, asyncio.ensure_future(self._assign_joiner(plan)))
        for s in survivors:
            self._slots.set_run_until(s, boundary)
        for s in survivors:
            if self._slots.phase(s) == WorkerPhase.PAUSED and self._slots.field(s, Field.STEP) < boundary:
                self._slots.send(s, "resume")
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while True:
            over = 0
            ready = True
            for s in survivors:
                ph, step = self._slots.phase(s), self._slots.field(s, Field.STEP)
                if step > boundary or (step == boundary and ph == WorkerPhase.RUNNING):
                    over = max(over, step + (1 if ph == WorkerPhase.RUNNING else 0))
                if not (ph == WorkerPhase.PAUSED and step == boundary):
                    ready = False
                if not s.alive:
                    return Report(node=self.agent.node_id, phase=plan.phase, ok=False,
                                  error=f"rank {s.rank} died before the boundary")
            if over > boundary:
                return Report(node=self.agent.node_id, phase=plan.phase, candidate=over)
            if ready:
                self.agent.events.write("swap_boundary_reached", swap_id=plan.id, step=boundary)
                return Report(node=self.agent.node_id, phase=plan.phase, candidate=boundary)
            if time.monotonic() > deadline:
                return Report(node=self.agent.node_id, phase=plan.phase, ok=False,
                              error=f"workers did not reach step {boundary}")
            await asyncio.sleep(0.002)

    def _assign_fields(self, plan: SwapPlan) -> dict[str, Any]:
        gen = self.agent.generation
        assert gen is not None
        member = gen.member(self.agent.node_id)
        return {"rank": plan.leaver.rank, "world_size": gen.world_size, "role_rank": plan.leaver.rank,
                "role_world_size": gen.world_size, "group_rank": member.group_rank if member else None,
                "local_world_size": self.agent.cfg.nproc_per_node, "group_world_size": len(gen.members),
                "swap_id": plan.id}

    async def _transfer(self, plan: SwapPlan) -> Report | None:
        me = self.agent.node_id
        addr = None
        light_b64 = None
        dead_here = plan.kind == SwapKind.UNPLANNED and plan.leaver.node == me
        if dead_here:
            # the snapshot for the step the planner chose (the newest if two carry it); none at step 0 is fine
            data = next((d for step, d in self._dead_lights(plan) if step == plan.boundary), None)
            if data is not None:
                light_b64 = base64.b64encode(data).decode()
        self._transfers_seen.add((plan.id, plan.attempt))
        if plan.joiner.node == me:
            key = (plan.id, plan.attempt, plan.joiner.slot)
            early, self._early = self._early, None
            if early is not None and early[0] == key:
                result = await early[1]     # assigned during BOUNDARY: normally listening already
                if not isinstance(result, str) and not self._slots.slots[plan.joiner.slot].alive:
                    result = f"spare {me}/{plan.joiner.slot} is gone"
            else:
                if early is not None:
                    early[1].cancel()
                result = await self._assign_joiner(plan)
            if isinstance(result, str):
                # (assigned early, a joiner that dies is now seen here, before any byte was sent)
                self.agent.events.write("swap_transfer_failed", swap_id=plan.id, error=result, attempt=plan.attempt)
                return Report(node=me, phase=plan.phase, ok=False, error=result)
            addr = result
            self.agent.events.write("swap_transfer_start", swap_id=plan.id, joiner=plan.joiner.to_json())
        if addr is None and light_b64 is None and not dead_here:
            return None
        return Report(node=me, phase=plan.phase, joiner_addr=addr, light_b64=light_b64)

    async def _assign_joiner(self, plan: SwapPlan) -> tuple[str, int] | str:
        """Hand the spare its rank and wait until it listens: its address, or why not (a string)."""
        me = self.agent.node_id
        joiner = self._slots.slots[plan.joiner.slot]
        if not joiner.alive or joiner.state != SlotState.SPARE:
            return f"spare {me}/{joiner.index} is gone"
        if not await self._slots.wait_ready(joiner, PHASE_TIMEOUT_S):
            return f"spare {me}/{joiner.index} never got ready"
        key = _transfer_key(plan)
        if key is None:
            return f"swap {plan.id} carries no transfer secret: refusing an unauthenticated transfer"
        self._slots.drain(joiner)
        fields = self._assign_fields(plan)
        # Assigned during BOUNDARY, the spare may wait for the survivors' step and then the TRANSFER phase.
        # It listens on this node's advertised address only, and accepts only a sender that proves the key
        # (which reaches it over its private agent socket, never the network).
        self._slots.send(joiner, "assign", **fields, timeout=PHASE_TIMEOUT_S, accept_timeout=3 * PHASE_TIMEOUT_S,
                         key=key, listen_host=self.agent.addr, max_bytes=joiner.reserved or None)
        msg = await self._slots.expect(joiner, {"listening"}, PHASE_TIMEOUT_S)
        if msg is None:
            return "the spare did not start listening"
        return (self.agent.addr, int(msg["port"]))

    def _cancel_early(self) -> None:
        early, self._early = self._early, None
        if early is not None:
            early[1].cancel()

    async def _send(self, plan: SwapPlan) -> Report | None:
        me = self.agent.node_id
        assert plan.joiner_addr is not None
        sender: SlotRef | None = plan.leaver if plan.kind == SwapKind.PLANNED else plan.donor
        if sender is not None and sender.node == me:
            refused = await self._refuse_destination(plan)
            if refused is not None:
                log.error("swap %s: refusing to send rank %s's state: %s", plan.id, plan.leaver.rank, refused)
                self.agent.events.write("swap_send_refused", swap_id=plan.id, reason=refused)
                return Report(node=me, phase=plan.phase, ok=False, error=f"send refused: {refused}")
            slot = self._slots.slots[sender.slot]
            self._slots.send(slot, "send_state", addr=plan.joiner_addr[0], port=plan.joiner_addr[1],
                             swap_id=plan.id, replicated_only=plan.kind == SwapKind.UNPLANNED,
                             rng=plan.kind == SwapKind.PLANNED, timeout=PHASE_TIMEOUT_S,
                             key=_transfer_key(plan), rank=plan.leaver.rank)
        if plan.joiner.node != me:
            return None
        joiner = self._slots.slots[plan.joiner.slot]
        light = plan.kind == SwapKind.UNPLANNED and plan.light_b64 is not None
        if light:
            self._slots.send(joiner, "light", data=plan.light_b64, step=plan.boundary)
        msg = await self._await_received(plan, joiner)
        if msg == "aborted":
            self._slots.send(joiner, "abort")
            return None
        if msg is None or not msg.get("ok"):
            err = (msg or {}).get("error", "the joiner died or timed out during the transfer")
            self.agent.events.write("swap_transfer_failed", swap_id=plan.id, error=err, attempt=plan.attempt)
            return Report(node=me, phase=plan.phase, ok=False, error=err)
        if plan.kind == SwapKind.PLANNED and plan.boundary is not None and msg.get("step") is not None \
                and int(msg["step"]) != int(plan.boundary):
            err = f"the joiner received the state of step {msg['step']}, the swap is at step {plan.boundary}"
            self.agent.events.write("swap_transfer_failed", swap_id=plan.id, error=err, attempt=plan.attempt)
            return Report(node=me, phase=plan.phase, ok=False, error=err)
        self.agent.events.write("swap_transfer_end", swap_id=plan.id, nbytes=msg.get("nbytes"),
                                seconds=msg.get("seconds"), checksum=msg.get("checksum"))
        if light:
            ok = await self._slots.expect(joiner, {"light_ok"}, 5.0)
            if ok is None or ok.get("ok") is False:
                # the same bytes would be rejected again: do not retry
                return Report(node=me, phase=plan.phase, ok=False, final=ok is not None,
                              error=f"the joiner rejected the dead rank's snapshot (step {(ok or {}).get('step')}, "
                                    f"resume step {plan.boundary})")
        return Report(node=me, phase=plan.phase, extra={"nbytes": msg.get("nbytes"), "seconds": msg.get("seconds")})

    async def _await_received(self, plan: SwapPlan, joiner: Slot) -> dict[str, Any] | str | None:
        """The joiner's "received", or "aborted" once the leader gave the plan up (a sender that died before
        connecting leaves the joiner listening; plans are followed one at a time, so this wait must look)."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        key = self._keys.swap(plan.id)
        while time.monotonic() < deadline:
            msg = await self._slots.expect(joiner, {"received", "stranger"}, 0.5)
            if msg is not None and msg["kind"] == "stranger":
                self.agent.events.write("swap_transfer_stranger", swap_id=plan.id, error=msg.get("error"))
                continue
            if msg is not None or not joiner.alive:
                return msg
            doc, rev = await self._store.get_json(key)
            now = load(SwapPlan.from_json, key, doc, rev) if doc is not None else None
            if now is not None and now.phase == Phase.ABORTED:
                return "aborted"
        return None

    async def _refuse_destination(self, plan: SwapPlan) -> str | None:
        """Why this node must not stream a rank's state to ``plan.joiner_addr`` (None: it may). The state goes
        only to a spare slot of a node of the current generation, at that node's registered address, in a
        swap this node followed into its TRANSFER phase: a plan written straight into SEND, or naming any
        other address, is forged or stale."""
        gen = self.agent.generation
        assert plan.joiner_addr is not None
        host = plan.joiner_addr[0]
        if (plan.id, plan.attempt) not in self._transfers_seen:
            return f"this node never took part in the transfer phase of attempt {plan.attempt}"
        if plan.secret is None:
            return "the plan carries no transfer secret"
        if gen is None or not gen.includes(plan.joiner.node):
            return f"the joiner's node {plan.joiner.node!r} is not part of the current generation"
        member = gen.member(plan.joiner.node)
        registered = member.addr if member is not None else None
        if registered is None:
            key = self._keys.node(plan.joiner.node)
            doc, rev = await self._store.get_json(key)
            info = load(node_info, key, doc, rev) if doc is not None else None
            registered = info.addr if info is not None else None
        if host != registered:
            return f"{host}:{plan.joiner_addr[1]} is not the address of node {plan.joiner.node!r} ({registered})"
        view = await self._view()
        held = view.slot_at(plan.joiner.node, plan.joiner.slot)
        if held is None or held.state not in ("spare", "transferring"):
            return f"{plan.joiner.node}/{plan.joiner.slot} is not a spare ({held.state if held else 'unknown'})"
        return None

    async def _reform(self, plan: SwapPlan) -> Report:
        me = self.agent.node_id
        gen = self.agent.generation
        assert gen is not None
        addr, port = self.agent.master
        world = {"addr": addr, "port": port, "prefix": f"/tpassrun/{plan.id}/{plan.attempt}/",
                 "world_size": gen.world_size, "generation": gen.number + 1}
        waiting: list[Slot] = []
        for s in self._survivors(plan):
            if plan.kind == SwapKind.PLANNED and plan.leaver.node == me and s.index == plan.leaver.slot:
                continue
            self._slots.set_run_until(s, INT64_MAX)
            self._slots.send(s, "reform", rank=s.rank, rollback=plan.kind == SwapKind.UNPLANNED, **world)
            waiting.append(s)
        if plan.joiner.node == me:
            joiner = self._slots.slots[plan.joiner.slot]
            fields = self._assign_fields(plan)
            self._slots.set_run_until(joiner, INT64_MAX)
            self._slots.send(joiner, "reform", **{**fields, **world})
            joiner.state, joiner.rank = SlotState.RUNNING, plan.leaver.rank
            waiting.append(joiner)
        if plan.leaver.node == me:
            leaver = self._slots.slots[plan.leaver.slot]
            reason = plan.reason if plan.kind == SwapKind.PLANNED else f"rank died: {plan.reason}"
            leaver.quarantine_reason = None if plan.release else reason
            leaver.home_rank = None if plan.release else plan.leaver.rank
            if plan.kind == SwapKind.PLANNED:
                leaver.state = SlotState.LEAVING
                leaver.release_after_exit = plan.release
                self._slots.send(leaver, "exit", code=0)
            else:
                leaver.state = SlotState.QUARANTINED
            leaver.rank = None
        timings = {}
        for s in waiting:
            msg = await self._slots.expect(s, {"reformed"}, PHASE_TIMEOUT_S)
            if msg is None or msg.get("ok") is False:
                return Report(node=me, phase=plan.phase, ok=False,
                              error=f"rank {s.rank} did not join the new world: {(msg or {}).get('error')}")
            timings[str(s.rank)] = {k: msg[k] for k in ("leave_s", "join_s", "callbacks_s") if k in msg}
        self.agent.events.write("swap_reform_timings", swap_id=plan.id, ranks=timings)
        self.agent.events.write("swap_world_reformed", swap_id=plan.id, generation=gen.number + 1)
        return Report(node=me, phase=plan.phase)

    async def _abort(self, plan: SwapPlan) -> None:
        me = self.agent.node_id
        for s in self._slots.slots:
            self._slots.set_run_until(s, INT64_MAX)
            # A leaver whose sending failed is still TRANSFERRING (waiting for its next command): resume it
            # too, or the whole job waits for it forever.
            if s.state == SlotState.RUNNING and self._slots.phase(s) in (WorkerPhase.PAUSED,
                                                                         WorkerPhase.TRANSFERRING):
                self._slots.send(s, "resume")
        if plan.joiner.node == me:
            joiner = self._slots.slots[plan.joiner.slot]
            if joiner.state == SlotState.SPARE:
                self._slots.send(joiner, "abort")
        reason = plan.history[-1][0] if plan.history else ""
        self.agent.events.write("swap_aborted_here", swap_id=plan.id, reason=reason)
        if plan.kind == SwapKind.UNPLANNED and plan.leaver.node == me:
            dead = self._slots.slots[plan.leaver.slot]
            # free of --max-restarts only when the planner found the live recovery impossible (it says why);
            # a second fault during the recovery or no spare at all spends a restart, as under torchrun
            why = plan.outcome or "its recovery was aborted"
            self.agent._queue.put_nowait(("fallback", f"rank {plan.leaver.rank} cannot be recovered live: {why}",
                                          dead, plan.outcome is not None))

    # ------------------------------------------------------------------ coordinator (leader)
    async def _coordinate(self) -> None:
        """Re-evaluate on every relevant change; only the leader acts."""
        prefix = self._keys.prefix
        watcher = asyncio.ensure_future(self._watch_kicks(prefix))
        backoff, said = 0.2, ""
        try:
            while True:
                await self._kick.wait()
                self._kick.clear()
                if self.agent.rdzv is not None and self.agent.rdzv.is_leader:
                    try:
                        await self._leader_tick()
                        backoff, said = 0.2, ""
                    except Exception as exc:  # noqa: BLE001 - the next kick re-reads everything
                        # Once per distinct error, then retry with a growing pause: never a traceback per tick.
                        if repr(exc) != said:
                            said = repr(exc)
                            log.exception("swap coordinator tick failed; retrying")
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                        self._kick.set()
        finally:
            watcher.cancel()

    async def _watch_kicks(self, prefix: str) -> None:
        self._kick.set()
        interesting = ("taints/", "failures/", "reports/", "status/", "swaps/")
        async for ev in self._store.watch_prefix(prefix):
            rel = ev.key[len(prefix):]
            if rel.startswith(interesting):
                self._kick.set()

    async def _view(self) -> ClusterView:
        gen = self.agent.generation
        assert gen is not None
        slots: list[SlotView] = []
        # A taint naming a slot but no rank (health: a bad spare), or any "exclude" taint, keeps that slot out
        # of the spare pool.
        barred = {(t.node_id, t.slot) for t in await self._taints()
                  if t.rank is None or t.effect is TaintEffect.EXCLUDE}
        for key, doc, rev in await self._store.get_prefix_json(self._keys.family("status")):
            status = load(NodeStatus.from_json, key, doc, rev)
            if status is None:
                continue
            for w in status.workers:
                state = w.state
                if state == "spare" and (status.node_id, w.slot) in barred:
                    state = "tainted"
                slots.append(SlotView(node=status.node_id, slot=w.slot, rank=w.rank, state=state,
                                      managed=w.managed, step=w.step))
        return ClusterView(generation=gen.number, members=tuple(m.node_id for m in gen.members),
                           spare_nodes=tuple(gen.spare_nodes), slots=tuple(slots))

    async def _taints(self) -> list[Taint]:
        out = []
        for key, doc, rev in await self._store.get_prefix_json(self._keys.family("taints")):
            taint = load(Taint.from_json, key, doc, rev)
            if taint is not None and taint.id == self._keys.last(key):
                out.append(taint)
            elif taint is not None:
                load(_mismatched_id, key, taint, rev)
        return out

    async def _plans(self) -> list[tuple[SwapPlan, int]]:
        plans = []
        for key, doc, rev in await self._store.get_prefix_json(self._keys.family("swaps")):
            plan = load(SwapPlan.from_json, key, doc, rev)
            if plan is not None:
                plans.append((plan, rev))
        return plans

    async def _leader_tick(self) -> None:
        now = time.time()
        keys = self._keys
        plans = await self._plans()
        active = [(p, rev) for p, rev in plans if not p.terminal]
        for p, rev in [(p, rev) for p, rev in active if p.generation < self.agent.spawned_generation]:
            # planned before the last whole-group restart: its workers are gone
            await self._store.cas_json(keys.swap(p.id), p.advance(Phase.ABORTED, now).to_json(), rev)
            active.remove((p, rev))
        if active:
            plan, rev = active[0]
            seq = len(plan.history)
            reports = [r for k, d, rv in await self._store.get_prefix_json(keys.reports(plan.id, seq))
                       if (r := load(Report.from_json, k, d, rv)) is not None]
            spare = None
            sender_dead = False
            if plan.phase in (Phase.TRANSFER, Phase.SEND):
                view = await self._view()
                sender = plan.leaver if plan.kind == SwapKind.PLANNED else plan.donor
                held = view.slot_at(sender.node, sender.slot) if sender is not None else None
                sender_dead = held is not None and held.state in ("dead", "idle")
                joiner = view.slot_at(plan.joiner.node, plan.joiner.slot)
                if any(not r.ok for r in reports) and (joiner is None or joiner.state != "spare"):
                    spare = choose_spare(view, plan.joiner.node,
                                         plan.excluded_spares + ((plan.joiner.node, plan.joiner.slot),))
            decision = next_step(plan, reports, now, spare_after_failure=spare, sender_dead=sender_dead)
            await self._apply(decision, plan, rev)
            return
        handled = {p.taint_id for p, _ in plans if p.taint_id and p.phase == Phase.DONE}
        handled_fail = {p.id for p, _ in plans}
        view = None
        for key, doc, rev in await self._store.get_prefix_json(keys.family("failures")):
            failure = load(Failure.from_json, key, doc, rev)
            if failure is None or failure.handled:
                continue
            fid = keys.last(key)
            if failure.generation < self.agent.spawned_generation:
                # A death from before the last whole-group restart (e.g. a second failure that ended a
                # recovery): those workers are gone, and the rank runs anew. Never plan a swap for it.
                await self._store.put_json(key, failure.mark("stale", "before the restart").to_json())
                continue
            view = view or await self._view()
            decision = plan_for_failure(view, node=failure.node, slot=failure.slot, rank=failure.rank,
                                        reason=f"exit code {failure.code}", now_wall=now,
                                        light_available=failure.light, swap_id=f"u-{fid}-{failure.generation}")
            await self._store.put_json(key, failure.mark(decision.action, decision.reason).to_json())
            self.agent.events.write("recovery_decided", action=decision.action, reason=decision.reason)
            if decision.plan is not None and decision.plan.id not in handled_fail:
                await self._store.create_json(keys.swap(decision.plan.id), _with_secret(decision.plan).to_json())
            elif decision.action == "fallback":
                fake = plan_for_failure(view, node=failure.node, slot=failure.slot, rank=failure.rank,
                                        reason="", now_wall=now, light_available=True)
                # Tell the dead rank's agent through an aborted plan: it turns that into a group restart.
                if fake.plan is not None:
                    await self._store.create_json(keys.swap(fake.plan.id),
                                                  fake.plan.advance(Phase.ABORTED, now).to_json())
                else:   # no plan to abort (no spare at all): tell the dead rank's agent directly
                    await self._store.put_json(keys.fallback(failure.node),
                                               Fallback(decision.reason, failure.generation, failure.slot).to_json())
            return
        for taint in await self._taints():
            tid = taint.id
            key = keys.taint(tid)
            if tid not in self._taints_said and taint.source != TaintSource.HEALTH.value:   # health's own: health_taint
                self._taints_said.add(tid)
                self.agent.events.write("taint_received", id=tid, rank=taint.rank, slot=taint.slot,
                                        target_node=taint.node_id, effect=taint.effect.value,
                                        source=taint.source or "tpassctl", reason=taint.reason)
            if tid in handled or taint.handled_by or taint.effect is TaintEffect.EXCLUDE:
                continue  # exclude: keep the rank where it is, only never hand the slot out as a spare
            view = view or await self._view()
            rank = taint.rank
            if rank is None:
                target = [s for s in view.slots if s.node == taint.node_id and s.rank is not None
                          and (taint.slot is None or s.slot == taint.slot) and s.state == "running"]
                if not target:
                    continue
                rank = target[0].rank
            assert rank is not None
            decision = plan_for_taint(view, node=taint.node_id or "", rank=rank, reason=taint.reason,
                                      taint_id=tid, now_wall=now, home=taint.home)
            if decision.action == "plan" and decision.plan is not None:
                if await self._store.create_json(keys.swap(decision.plan.id), _with_secret(decision.plan).to_json()):
                    await self._store.put_json(key, taint.handled(decision.plan.id, "migrating").to_json())
                    self.agent.events.write("swap_decided", swap_id=decision.plan.id, reason=decision.reason,
                                            taint=tid)
                return
            if tid not in self._waiting_said:
                self._waiting_said.add(tid)
                self.agent.events.write("swap_waiting", taint=tid, action=decision.action, reason=decision.reason)
                await self._store.put_json(key, taint.handled(None, f"{decision.action}: {decision.reason}").to_json())
            if decision.action == "fallback":
                # A rank that cannot swap live (its script never called tpassrun.init()): restart the group
                # with the tainted slot quarantined on its node, so the rank starts in a spare slot instead.
                # Like a membership change, this costs no --max-restarts: nothing failed.
                held = view.slot_of_rank(rank)
                where = {"node_id": held.node, "slot": held.slot} if held is not None else {}
                await self._store.put_json(key, taint.handled(HANDLED_RESTART, decision.reason, **where).to_json())
                self.agent._queue.put_nowait(("health_restart", f"health-aware restart: {decision.reason}"))
                return

    async def _apply(self, decision: Decision, plan: SwapPlan, rev: int) -> None:
        if decision.plan is None:
            return
        new = decision.plan
        if new.phase == Phase.REFORM:
            await self._commit_generation(new)
        ok = await self._store.cas_json(self._keys.swap(plan.id), new.to_json(), rev)
        if ok:
            self.agent.events.write("swap_phase", swap_id=new.id, phase=new.phase.value, reason=decision.reason)
            if new.phase == Phase.DONE and new.taint_id and new.release:
                await self._store.delete(self._keys.taint(new.taint_id))   # migrate-back done: nothing sick
            elif new.phase == Phase.DONE and new.taint_id:
                key = self._keys.taint(new.taint_id)
                doc, trev = await self._store.get_json(key)
                taint = load(Taint.from_json, key, doc, trev) if doc is not None else None
                if taint is not None:
                    await self._store.put_json(key, taint.handled(new.id, "quarantined", slot=new.leaver.slot,
                                                                  node_id=new.leaver.node).to_json())

    async def _commit_generation(self, plan: SwapPlan) -> None:
        """One swap = one generation transition (compare-and-swap), carrying the swap id."""
        import dataclasses

        assert self.agent.rdzv is not None
        old = await self.agent.rdzv.current()
        if old is None:
            return
        assignments = dict(old.assignments or {})
        assignments[str(plan.leaver.rank)] = {"node": plan.joiner.node, "slot": plan.joiner.slot}
        new = dataclasses.replace(old, number=old.number + 1, swap_id=plan.id, reason=plan.reason,
                                  assignments=assignments)
        if await self.agent.rdzv.commit(old, new):
            self.agent.generation = new
            self.agent.events.write("generation_committed", generation=new.number, swap_id=plan.id)

    async def _follow_fallbacks(self) -> None:
        """The leader found no way to recover a rank of this node (no spare left): restart the group, as
        torchrun would. Without this, the dead rank's agent waited for a recovery that never came."""
        key = self._keys.fallback(self.agent.node_id)
        async for ev in self._store.watch_key(key):
            fallback = load(Fallback.from_json, key, ev.value, ev.mod_revision) if ev.kind == "put" else None
            if fallback is None or fallback.generation < self.agent.spawned_generation:
                continue   # malformed (logged once), or from before the last whole-group restart
            index = fallback.slot
            dead = self._slots.slots[index] if index is not None and index < len(self._slots.slots) else None
            self.agent._queue.put_nowait(("fallback", fallback.reason, dead))

    async def _follow_taint_removals(self) -> None:
        """``tpassctl untaint``: a quarantined slot of this node goes back to the spare pool."""
        async for ev in self._store.watch_prefix(self._keys.family("taints")):
            if ev.value is not None:
                continue
            await self._requarantine_check()

    async def _requarantine_check(self) -> None:
        held = {(t.node_id, t.slot) for t in await self._taints()}
        gen = self.agent.generation
        if gen is None or not self.agent.master[1]:
            return
        for s in self._slots.slots:
            if s.state == SlotState.QUARANTINED and (self.agent.node_id, s.index) not in held:
                s.quarantine_reason = None
                await self.agent.spawn(gen, s, local_rank=s.index, rank=-1, master=self.agent.master, spare=True)
                self.agent.events.write("spare_returned", slot=s.index)
                home, s.home_rank = s.home_rank, None
                if self.agent.cfg.migrate_back and home is not None:
                    await self._request_migrate_back(home, s)

    async def _request_migrate_back(self, rank: int, home: Slot) -> None:
        """--migrate-back: the slot a rank was moved off is healthy again; move the rank home once the new
        spare there is ready (the planner waits for it), and free the slot it leaves."""
        tid = f"mb-{self.agent.node_id}-{home.index}-{int(time.time() * 1000)}"
        taint = Taint(id=tid, effect=TaintEffect.MIGRATE, rank=rank, source=TaintSource.MIGRATE_BACK.value,
                      reason=f"migrate back to healthy slot {self.agent.node_id}/{home.index}",
                      home_node=self.agent.node_id, home_slot=home.index, time=time.time())
        await self._store.put_json(self._keys.taint(tid), taint.to_json())
        self.agent.events.write("migrate_back_requested", rank=rank, slot=home.index, taint=tid)
        await self.agent.publish_status()


def _with_secret(plan: SwapPlan) -> SwapPlan:
    """The plan as the leader writes it: with a fresh secret that only the job's control plane ever sees."""
    return dataclasses.replace(plan, secret=secrets.token_hex(32))


def _transfer_key(plan: SwapPlan) -> str | None:
    """This attempt's transfer key (hex): a fresh key per attempt, derived from the plan's secret."""
    if not plan.secret:
        return None
    try:
        secret = bytes.fromhex(plan.secret)
    except ValueError:
        return None
    return hmac.new(secret, f"tpassrun-transfer/{plan.id}/{plan.attempt}".encode(), hashlib.sha256).hexdigest()


def _mismatched_id(taint: Taint) -> Taint:
    raise RecordError(f"taint id {taint.id!r} differs from its key")
