"""The participant's part of each phase of a single-rank swap, on this node (composed into
:class:`tpassrun.swapper.Swapper`, which follows the plans and calls here; a node plan's steps are
:mod:`tpassrun.swapper.nodeswap`'s and reuse these): PAUSE (stop the local ranks, report where they stopped), BOUNDARY
(run them to the boundary, hand a planned swap's joiner its rank early), TRANSFER (the joiner listens; an
unplanned swap's dead rank's light snapshot), SEND (the leaver or donor streams; the joiner's receipt
checked), REFORM (every rank its new world, the leaver away), and an abort. Every command to a worker is a
:mod:`tpassrun.channel.protocol` message.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from tpassrun.channel import (
    INT64_MAX,
    STOP_NOW,
    Abort,
    AbortJoin,
    Assign,
    Exit,
    Field,
    Light,
    LightOk,
    Listening,
    LocalSlots,
    MirrorSource,
    Received,
    Reform,
    Reformed,
    Resume,
    SendState,
    Slot,
    SlotState,
    WorkerPhase,
    WorldSpec,
)
from tpassrun.plan import PHASE_TIMEOUT_S, ClusterView, Phase, SlotRef, SwapKind, of_attempt, world_prefix
from tpassrun.plan import transfer_key as _transfer_key
from tpassrun.records import (
    Keys,
    Move,
    Report,
    SwapAbortedHere,
    SwapBoundaryReached,
    SwapJoinAborted,
    SwapPlan,
    SwapReformTimings,
    SwapSendRefused,
    SwapShardsRolledBack,
    SwapTransferEnd,
    SwapTransferFailed,
    SwapTransferStart,
    SwapWorldReformed,
    emit,
    load,
    node_info,
)
from tpassrun.swapper import shardplane
from tpassrun.swapper.agentport import AgentPort, FallbackRequested
from tpassrun.swapper.ranks import LocalRanks

if TYPE_CHECKING:
    from tpassrun.rendezvous import EtcdStore

log = logging.getLogger(__name__)

PAUSE_SETTLE_S = 0.03         # how long a RUNNING step must stay unchanged before we call it "stuck in a collective"
GIVEN_UP_POLL_S = 0.25        # how often a participant waiting for its workers looks whether the plan was given up
STORE_PROBE_S = 5.0           # how long the workers' store may take to accept a connection before a re-form


class Phases:
    """This node's part of each phase (see the module doc); the swapper follows the plans and calls here, and each
    phase returns its report. Given what it needs: the agent (``port``), this node's ranks (``ranks``, shared with
    the node plans), the cluster's view as the leader keeps it (``view``: a joiner's slot is checked in it before
    any state is sent) and the swapper's note of a worker's death (``died``). What only the phases keep (the early
    joiner, the transfers followed, the rollbacks done) lives here."""

    def __init__(self, port: AgentPort, ranks: LocalRanks, *, view: Callable[[], Awaitable[ClusterView]],
                 died: Callable[[Slot], None]) -> None:
        self.port = port
        self.ranks = ranks
        self._view = view
        self._died = died
        # planned swaps: the joiner is assigned during BOUNDARY; (swap id, attempt, slot) -> its address or error
        self.early: tuple[tuple[str, int, int], asyncio.Task[Any]] | None = None
        self.transfers_seen: set[tuple[str, int]] = set()   # (swap id, attempt) this node followed into TRANSFER
        self.rolled_back: set[str] = set()                  # swaps whose survivors here loaded their shard copies

    @property
    def _slots(self) -> LocalSlots:
        return self.port.slots

    @property
    def _keys(self) -> Keys:
        return Keys(self.port.rdzv.key(""))

    @property
    def _store(self) -> EtcdStore:
        return self.port.rdzv.store

    def survivors(self, plan: SwapPlan) -> list[Slot]:
        return self.ranks.survivors(plan)

    def saw_transfer(self, plan: SwapPlan) -> None:
        """This node followed ``plan``'s attempt into TRANSFER (a state is sent only in one it did: refuse_destination)."""
        self.transfers_seen.add((plan.id, plan.attempt))

    async def roll_back_once(self, plan: SwapPlan, survivors: list[Slot]) -> str | None:
        """A plan that restores sharded state: every local survivor back to its own copy of the resume step before
        any donor sends (tpassrun/swapper/shardplane.py), once per plan; why not, or None."""
        if plan.id in self.rolled_back:
            return None
        why = await shardplane.roll_back(self._slots, survivors, int(plan.boundary or 0))
        if why is not None:
            return why
        self.rolled_back.add(plan.id)
        emit(self.port.events, SwapShardsRolledBack(swap_id=plan.id, step=plan.boundary))
        return None

    async def pause(self, plan: SwapPlan) -> Report:
        survivors = self.survivors(plan)
        # planned: at the earliest step start outside a gradient-accumulation window; unplanned: at once
        for s in survivors:
            self._slots.set_run_until(s, 0 if plan.kind == SwapKind.PLANNED else STOP_NOW)
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        last: dict[int, tuple[int, int, float]] = {}
        dead_steps = self._dead_light_steps(plan)
        next_look = time.monotonic() + GIVEN_UP_POLL_S
        while True:
            now = time.monotonic()
            paused: list[int] = []     # the steps the survivors paused at (or can resume at exactly)
            failed: list[int] = []     # ... of survivors that failed past their commit point: the next step
            post: list[int] = []       # ... of survivors that failed before it: the step they failed in
            stationary, cand = True, 0
            for s in survivors:
                ph, step = self._slots.position(s)
                if ph in (WorkerPhase.PAUSED, WorkerPhase.FAILED):
                    # what the worker says it can resume at exactly (its accumulation window's start, the next
                    # step after a failure past its commit point), or nothing
                    offer = self._slots.field(s, Field.OFFER) - 1
                    if ph == WorkerPhase.PAUSED:
                        paused.append(offer if offer >= 0 else step)
                    else:
                        (failed if offer >= 0 else post).append(offer if offer >= 0 else step)
                    cand = max(cand, step)
                    continue
                if not s.alive:
                    continue
                prev = last.get(s.index)
                if prev is None or prev[:2] != (int(ph), step):
                    last[s.index] = (int(ph), step, now)
                    stationary = False
                elif plan.kind != SwapKind.PLANNED or now - prev[2] < PAUSE_SETTLE_S:
                    stationary = False
                cand = max(cand, step + 1)
            if stationary:
                return Report(node=self.port.node_id, phase=plan.phase, candidate=cand, steps=tuple(paused),
                              failed_steps=tuple(failed), post_commit=tuple(post), dead_steps=dead_steps,
                              **self._mixed_commit_fields(plan, survivors),
                              **shardplane.pause_fields(self.port, plan, survivors))
            if now > deadline:
                return Report(node=self.port.node_id, phase=plan.phase, ok=False,
                              error="workers did not stop within the phase timeout")
            if now >= next_look:
                # a survivor blocked in a collective with a node that is cut off stops only when that node is
                # declared lost and the next plan breaks it out; the leader gives this plan up then (superseded),
                # and plans are followed one at a time, so this wait must look or it holds that next plan back
                next_look = now + GIVEN_UP_POLL_S
                if await self.ranks.given_up(plan):
                    return Report(node=self.port.node_id, phase=plan.phase, ok=False, error="the plan was given up")
            await asyncio.sleep(0.002)

    async def store_silent(self, addr: str, port: int) -> str:
        """Why the workers' store at ``addr:port`` cannot host a re-formed world ("" if it answers). Looked at
        before any rank is told to join: a rank connecting to a dead store blocks inside torch (no AbortJoin
        reaches it) until its timeout, and the whole swap with it."""
        try:
            _r, w = await asyncio.wait_for(asyncio.open_connection(addr, port), STORE_PROBE_S)
        except (OSError, asyncio.TimeoutError) as exc:
            return f"the workers' store at {addr}:{port} does not answer ({type(exc).__name__})"
        w.close()
        return ""

    def _mixed_commit_fields(self, plan: SwapPlan, survivors: list[Slot]) -> dict[str, Any]:
        """An unplanned recovery's PAUSE: where each local survivor stopped and where else it could stand
        (catchup.mixed_commit), and the replica groups survivors declared (a survivor's replicated state comes
        only from its own group: TP x DP, HSDP)."""
        if plan.kind != SwapKind.UNPLANNED:
            return {}
        replicas = {s.rank: tuple(s.replicas) for s in survivors if s.rank is not None and s.replicas is not None}
        return {"stops": self.ranks.stops(plan), "backs": self.ranks.backs(plan), "replicas": replicas}

    def _dead_lights(self, plan: SwapPlan) -> list[tuple[int, bytes]]:
        """The dead rank's saved light snapshots as (step, bytes), newest first (unplanned, its node only).

        A worker keeps its last two in shared memory: the current step's start, and the commit-point one
        (labelled with the next step) or the previous step's start. One killed mid-write has no step (the
        channel says which step each buffer holds: the agent never decodes a snapshot, nor imports torch).
        """
        ch = self._slots.channel
        if plan.kind != SwapKind.UNPLANNED or plan.leaver.node != self.port.node_id or not ch:
            return []
        found = []
        for previous in (False, True):
            step, data = ch.light_step(plan.leaver.slot, previous), ch.read_light(plan.leaver.slot, previous)
            if step is not None and data is not None:
                found.append((step, data))
        return found

    def _dead_light_steps(self, plan: SwapPlan) -> tuple[int, ...] | None:
        if plan.kind != SwapKind.UNPLANNED or plan.leaver.node != self.port.node_id:
            return None
        return tuple(step for step, _ in self._dead_lights(plan))

    async def boundary(self, plan: SwapPlan) -> Report:
        boundary = int(plan.boundary or 0)
        survivors = self.survivors(plan)
        if plan.kind == SwapKind.PLANNED and plan.joiner.node == self.port.node_id:
            key = (plan.id, plan.attempt, plan.joiner.slot)
            if self.early is None or self.early[0] != key:
                self.cancel_early()
                self.early = (key, asyncio.ensure_future(self.assign_joiner(plan)))
        for s in survivors:
            self._slots.set_run_until(s, boundary)
        for s in survivors:
            if self._slots.phase(s) == WorkerPhase.PAUSED and self._slots.field(s, Field.STEP) < boundary:
                self._slots.send(s, Resume())
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while True:
            over = 0
            ready = True
            for s in survivors:
                ph, step = self._slots.position(s)
                if step > boundary or (step == boundary and ph == WorkerPhase.RUNNING):
                    over = max(over, step + (1 if ph == WorkerPhase.RUNNING else 0))
                if not (ph == WorkerPhase.PAUSED and step == boundary):
                    ready = False
                if not s.alive:
                    return Report(node=self.port.node_id, phase=plan.phase, ok=False,
                                  error=f"rank {s.rank} died before the boundary")
            if over > boundary:
                return Report(node=self.port.node_id, phase=plan.phase, candidate=over)
            if ready:
                emit(self.port.events, SwapBoundaryReached(swap_id=plan.id, step=boundary))
                return Report(node=self.port.node_id, phase=plan.phase, candidate=boundary)
            if time.monotonic() > deadline:
                return Report(node=self.port.node_id, phase=plan.phase, ok=False,
                              error=f"workers did not reach step {boundary}")
            await asyncio.sleep(0.002)

    def joiner_world(self, plan: SwapPlan, move: Move | None = None) -> WorldSpec:
        """A joiner's place: the rank it takes on this node (its store is added at REFORM)."""
        gen = self.port.generation()
        assert gen is not None
        rank = move.rank if move is not None else plan.leaver.rank
        assert rank is not None
        me = plan.lost_node if plan.lost_node and plan.replaces == self.port.node_id else self.port.node_id
        member = gen.member(me)   # a node taking a lost member's place takes its group rank too
        return WorldSpec(rank=rank, world_size=gen.world_size, role_rank=rank, role_world_size=gen.world_size,
                         group_rank=member.group_rank if member else None,
                         local_world_size=self.port.settings.nproc_per_node, group_world_size=len(gen.members))

    async def transfer(self, plan: SwapPlan) -> Report | None:
        me = self.port.node_id
        addr = None
        light_b64 = None
        dead_here = plan.kind == SwapKind.UNPLANNED and plan.leaver.node == me
        if dead_here:
            # the snapshot for the step the planner chose (the newest if two carry it); none at step 0 is fine
            data = next((d for step, d in self._dead_lights(plan) if step == plan.boundary), None)
            if data is not None:
                light_b64 = base64.b64encode(data).decode()
        self.saw_transfer(plan)
        restored = plan.restore and me in plan.nodes
        if restored:
            why = await self.roll_back_once(plan, self.survivors(plan))
            if why is not None:
                return Report(node=me, phase=plan.phase, ok=False, final=True, error=why)
        if plan.joiner.node == me:
            key = (plan.id, plan.attempt, plan.joiner.slot)
            early, self.early = self.early, None
            if early is not None and early[0] == key:
                result = await early[1]     # assigned during BOUNDARY: normally listening already
                if not isinstance(result, str) and not self._slots.slots[plan.joiner.slot].alive:
                    result = f"spare {me}/{plan.joiner.slot} is gone"
            else:
                if early is not None:
                    early[1].cancel()
                result = await self.assign_joiner(plan)
            if isinstance(result, str):
                # (assigned early, a joiner that dies is now seen here, before any byte was sent)
                emit(self.port.events, SwapTransferFailed(swap_id=plan.id, error=result, attempt=plan.attempt))
                return Report(node=me, phase=plan.phase, ok=False, error=result)
            addr = result
            emit(self.port.events, SwapTransferStart(swap_id=plan.id, joiner=plan.joiner))
        behind = self.ranks.catching_up(plan)
        listening: dict[int, tuple[str, int]] = {}
        if behind:
            # a mixed commit: the local survivors the plan moves to the resume step listen for a survivor standing
            # there (catchup.mixed_commit)
            for move, result in zip(behind, await asyncio.gather(*(self.ranks.listen_catch_up(plan, m)
                                                                   for m in behind))):
                if isinstance(result, str):
                    return Report(node=me, phase=plan.phase, ok=False, final=True, error=result)
                listening[move.rank] = result
        elif addr is None and light_b64 is None and not dead_here and not restored:
            return None
        return Report(node=me, phase=plan.phase, joiner_addr=addr, light_b64=light_b64, joiner_addrs=listening)

    async def assign_joiner(self, plan: SwapPlan, move: Move | None = None,
                             mirror_from: MirrorSource | None = None) -> tuple[str, int] | str:
        """Hand the spare its rank and wait until it listens: its address, or why not (a string)."""
        me = self.port.node_id
        joiner = self._slots.slots[(move.joiner if move is not None else plan.joiner).slot]
        if not joiner.alive or joiner.state != SlotState.SPARE:
            return f"spare {me}/{joiner.index} is gone"
        if not await self._slots.wait_ready(joiner, PHASE_TIMEOUT_S):
            return f"spare {me}/{joiner.index} never got ready"
        key = _transfer_key(plan)
        if key is None:
            return f"swap {plan.id} carries no transfer secret: refusing an unauthenticated transfer"
        self._slots.drain(joiner)
        # the dead rank's shard, when a mirror holds it: the joiner fetches it from there
        mirrored = mirror_from or await shardplane.mirror_source(self.port.mirror(), plan)
        # Assigned during BOUNDARY, the spare may wait for the survivors' step and then the TRANSFER phase.
        # It listens on this node's advertised address only, and accepts only a sender that proves the key
        # (which reaches it over its private agent socket, never the network).
        self._slots.send(joiner, Assign(world=self.joiner_world(plan, move), swap_id=plan.id, key=key,
                                        listen_host=self.port.addr, timeout=PHASE_TIMEOUT_S,
                                        accept_timeout=3 * PHASE_TIMEOUT_S, max_bytes=joiner.reserved or None,
                                        mirror_from=mirrored, attempt=plan.attempt))
        msg = await self._slots.expect(joiner, (Listening,), PHASE_TIMEOUT_S, of_attempt(plan))
        if msg is None:
            return "the spare did not start listening"
        return (self.port.addr, msg.port)

    def cancel_early(self) -> None:
        early, self.early = self.early, None
        if early is not None:
            early[1].cancel()

    async def send(self, plan: SwapPlan) -> Report | None:
        me = self.port.node_id
        assert plan.joiner_addr is not None
        sender: SlotRef | None = plan.leaver if plan.kind == SwapKind.PLANNED else plan.donor
        if sender is not None and sender.node == me:
            refused = await self.refuse_destination(plan)
            if refused is not None:
                log.error("swap %s: refusing to send rank %s's state: %s", plan.id, plan.leaver.rank, refused)
                emit(self.port.events, SwapSendRefused(swap_id=plan.id, reason=refused))
                return Report(node=me, phase=plan.phase, ok=False, error=f"send refused: {refused}")
            slot = self._slots.slots[sender.slot]
            key = _transfer_key(plan)
            assert key is not None and plan.leaver.rank is not None   # _refuse_destination checked both
            self._slots.send(slot, SendState(addr=plan.joiner_addr[0], port=plan.joiner_addr[1], swap_id=plan.id,
                                             key=key, rank=plan.leaver.rank,
                                             replicated_only=plan.kind == SwapKind.UNPLANNED,
                                             without_sharded=plan.shard_from is not None,
                                             rng=plan.kind == SwapKind.PLANNED, timeout=PHASE_TIMEOUT_S))
        refusal = await self._send_catch_up(plan)
        if refusal is not None:
            return refusal
        if plan.joiner.node != me:
            return await self._caught_up_here(plan, None)
        joiner = self._slots.slots[plan.joiner.slot]
        light = plan.light_b64 if plan.kind == SwapKind.UNPLANNED else None
        if light is not None:
            self._slots.send(joiner, Light(data=light, step=plan.boundary))
        msg = await self.ranks.await_received(plan, joiner)
        if msg == "aborted":
            self._slots.send(joiner, Abort())
            return None
        if not isinstance(msg, Received) or not msg.ok:
            err = msg.error if isinstance(msg, Received) else "the joiner died or timed out during the transfer"
            emit(self.port.events, SwapTransferFailed(swap_id=plan.id, error=err, attempt=plan.attempt))
            return Report(node=me, phase=plan.phase, ok=False, error=err)
        if plan.kind == SwapKind.PLANNED and plan.boundary is not None and msg.step is not None \
                and msg.step != int(plan.boundary):
            err = f"the joiner received the state of step {msg.step}, the swap is at step {plan.boundary}"
            emit(self.port.events, SwapTransferFailed(swap_id=plan.id, error=err, attempt=plan.attempt))
            return Report(node=me, phase=plan.phase, ok=False, error=err)
        emit(self.port.events, SwapTransferEnd(swap_id=plan.id, nbytes=msg.nbytes, seconds=msg.seconds, checksum=msg.checksum))
        if light is not None:
            ok = await self._slots.expect(joiner, (LightOk,), 5.0)
            if ok is None or ok.ok is False:
                # the same bytes would be rejected again: do not retry
                return Report(node=me, phase=plan.phase, ok=False, final=ok is not None,
                              error=f"the joiner rejected the dead rank's snapshot (step {ok.step if ok else None}, "
                                    f"resume step {plan.boundary})")
        return await self._caught_up_here(plan, Report(node=me, phase=plan.phase,
                                                       extra={"nbytes": msg.nbytes, "seconds": msg.seconds}))

    async def _send_catch_up(self, plan: SwapPlan) -> Report | None:
        """SEND, a mixed commit: this node's survivors standing at the resume step stream their replicated state to
        the survivors the plan moves there (after the joiner's, if they serve it too); a refusal, or None."""
        me = self.port.node_id
        for move in plan.catch_up:
            if move.donor is None or move.donor.node != me:
                continue
            refused = await self.refuse_destination(plan, move, catch_up=True)
            if refused is not None:
                emit(self.port.events, SwapSendRefused(swap_id=plan.id, reason=refused))
                return Report(node=me, phase=plan.phase, ok=False, final=True, error=f"send refused: {refused}")
            key = _transfer_key(plan)
            assert key is not None and move.joiner_addr is not None   # _refuse_destination checked both
            self._slots.send(self._slots.slots[move.donor.slot],
                             SendState(addr=move.joiner_addr[0], port=move.joiner_addr[1], swap_id=plan.id, key=key,
                                       rank=move.rank, replicated_only=True, rng=False, timeout=PHASE_TIMEOUT_S))
        return None

    async def _caught_up_here(self, plan: SwapPlan, report: Report | None) -> Report | None:
        """SEND: ``report`` once every local survivor the plan moves loaded what it received, else why not."""
        behind = self.ranks.catching_up(plan)
        if not behind:
            return report
        results = await asyncio.gather(*(self.ranks.caught_up(plan, m) for m in behind))
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            return Report(node=self.port.node_id, phase=plan.phase, ok=False, final=True, error=errors[0])
        return report or Report(node=self.port.node_id, phase=plan.phase)

    async def refuse_destination(self, plan: SwapPlan, move: Move | None = None,
                                  catch_up: bool = False) -> str | None:
        """Why this node must not stream a rank's state to the joiner's address (None: it may). The state goes
        only to a spare slot of a node of the current generation, at that node's registered address, in a
        swap this node followed into its TRANSFER phase: a plan written straight into SEND, or naming any
        other address, is forged or stale."""
        gen = self.port.annotated()     # spare nodes that joined since it formed count
        move = move or plan.all_moves[0]
        addr = move.joiner_addr
        assert addr is not None and gen is not None
        host = addr[0]
        if (plan.id, plan.attempt) not in self.transfers_seen:
            return f"this node never took part in the transfer phase of attempt {plan.attempt}"
        if plan.secret is None or _transfer_key(plan) is None:
            return "the plan carries no transfer secret"
        if move.rank is None:
            return "the plan names no rank to send"
        if gen is None or not gen.includes(move.joiner.node):
            return f"the joiner's node {move.joiner.node!r} is not part of the current generation"
        member = gen.member(move.joiner.node)
        registered = member.addr if member is not None else None
        if registered is None:
            key = self._keys.node(move.joiner.node)
            doc, rev = await self._store.get_json(key)
            info = load(node_info, key, doc, rev) if doc is not None else None
            registered = info.addr if info is not None else None
        if host != registered:
            return f"{host}:{addr[1]} is not the address of node {move.joiner.node!r} ({registered})"
        view = await self._view()
        held = view.slot_at(move.joiner.node, move.joiner.slot)
        if catch_up:      # a survivor catching up (a mixed commit): the slot runs that rank
            if held is None or held.state != "running" or held.rank != move.rank:
                return f"{move.joiner.node}/{move.joiner.slot} does not run rank {move.rank}"
            return None
        if held is None or held.state not in ("spare", "transferring"):
            return f"{move.joiner.node}/{move.joiner.slot} is not a spare ({held.state if held else 'unknown'})"
        return None

    async def reform(self, plan: SwapPlan) -> Report | None:
        me = self.port.node_id
        gen = self.port.generation()
        assert gen is not None
        addr, port = plan.store or self.port.master()
        if plan.store is not None:
            self.port.set_master(plan.store, plan.store_host)
        silent = await self.store_silent(addr, port)
        if silent:
            return Report(node=me, phase=plan.phase, ok=False, error=silent)
        store = (addr, port, world_prefix(plan), gen.number + 1)
        waiting: list[Slot] = []
        for s in self.survivors(plan):
            if plan.kind == SwapKind.PLANNED and plan.leaver.node == me and s.index == plan.leaver.slot:
                continue
            self._slots.set_run_until(s, INT64_MAX)
            assert s.rank is not None
            self._slots.send(s, Reform(world=WorldSpec(rank=s.rank, world_size=gen.world_size).with_store(*store),
                                       rollback=plan.kind == SwapKind.UNPLANNED,
                                       resume=plan.boundary if plan.kind == SwapKind.UNPLANNED else None))
            waiting.append(s)
        if plan.joiner.node == me:
            joiner = self._slots.slots[plan.joiner.slot]
            self._slots.set_run_until(joiner, INT64_MAX)
            self._slots.send(joiner, Reform(world=self.joiner_world(plan).with_store(*store)))
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
                self._slots.send(leaver, Exit(code=0))
            else:
                leaver.state = SlotState.QUARANTINED
                self._died(leaver)
            leaver.rank = None
        answers = await self.await_reformed(plan, waiting)
        if answers is None:
            return None
        if isinstance(answers, str):
            return Report(node=me, phase=plan.phase, ok=False, error=answers)
        timings = {str(s.rank): msg.timings() for s, msg in zip(waiting, answers)}
        emit(self.port.events, SwapReformTimings(swap_id=plan.id, ranks=timings))
        emit(self.port.events, SwapWorldReformed(swap_id=plan.id, generation=gen.number + 1))
        return Report(node=me, phase=plan.phase)

    async def await_reformed(self, plan: SwapPlan, waiting: list[Slot]) -> list[Reformed] | str | None:
        """Every rank's "reformed"; or why not as soon as one of them died or failed to join (a rank killed while
        the world re-forms is reported at once, not after the others' wait for it times out: the leader decides
        what the death means, tpassrun.plan.triage); or None once the leader gave the plan up meanwhile (plans are
        followed one at a time, so this wait must look): the local ranks still joining are told to stop."""
        async def one(s: Slot) -> tuple[Slot, Reformed | None]:
            return s, await self._slots.expect(s, (Reformed,), PHASE_TIMEOUT_S)

        tasks = {asyncio.ensure_future(one(s)): s for s in waiting}
        pending = set(tasks)
        joined: dict[asyncio.Future[tuple[Slot, Reformed | None]], Reformed] = {}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                for t in [t for t in tasks if t in done]:      # (in rank order when several failed at once)
                    s, msg = t.result()
                    if msg is None or msg.ok is False:
                        return f"rank {s.rank} did not join the new world: {msg.error if msg else None}"
                    joined[t] = msg
                if pending and await self.ranks.given_up(plan):
                    for t in pending:
                        t.cancel()
                    await self._abort_joins(plan, [tasks[t] for t in pending])
                    return None
            return [joined[t] for t in tasks]
        finally:
            for t in tasks:
                t.cancel()

    async def _abort_joins(self, plan: SwapPlan, joining: list[Slot]) -> None:
        """Tell the local ranks still waiting to enter ``plan``'s re-formed world that it was given up
        (protocol.AbortJoin), and take their answers, so that none is mistaken for the next re-form's."""
        joining = [s for s in joining if s.alive and self._slots.phase(s) == WorkerPhase.RECONFIGURING]
        for s in joining:
            self._slots.send(s, AbortJoin(prefix=world_prefix(plan)))
        await asyncio.gather(*(self._slots.expect(s, (Reformed,), 10.0) for s in joining))
        if joining:
            emit(self.port.events, SwapJoinAborted(ranks=[s.rank for s in joining]))

    async def abort(self, plan: SwapPlan) -> None:
        me = self.port.node_id
        if len(plan.history) >= 2 and plan.history[-2][0] == Phase.REFORM.value:
            # given up while the world re-formed (a rank died on its way into it): the ranks still joining stop
            # and wait where they are, without a process group, for the recovery that replaces the dead rank
            # (superseded), or for the group restart; nobody resumes training
            await self._abort_joins(plan, [s for s in self._slots.slots if s.state == SlotState.RUNNING])
            emit(self.port.events, SwapAbortedHere(swap_id=plan.id, reason=plan.outcome or "aborted"))
            if not plan.superseded and plan.leaver.node == me:
                # the old world is gone and the new one was not formed: only the group restart goes on from here
                what = (f"rank {plan.leaver.rank} cannot be recovered live" if plan.kind == SwapKind.UNPLANNED
                        else f"the world could not be re-formed for the swap of rank {plan.leaver.rank}")
                self.port.post(FallbackRequested(f"{what}: {plan.outcome or 'a rank did not join the new world'}",
                                                 self._slots.slots[plan.leaver.slot], free=plan.outcome is not None))
            return
        for s in self._slots.slots:
            self._slots.set_run_until(s, INT64_MAX)
            # A leaver whose sending failed is still TRANSFERRING (waiting for its next command): resume it
            # too, or the whole job waits for it forever.
            if s.state == SlotState.RUNNING and self._slots.phase(s) in (WorkerPhase.PAUSED,
                                                                         WorkerPhase.TRANSFERRING):
                self._slots.send(s, Resume())
        if plan.joiner.node == me:
            joiner = self._slots.slots[plan.joiner.slot]
            if joiner.state == SlotState.SPARE:
                self._slots.send(joiner, Abort())
        reason = plan.history[-1][0] if plan.history else ""
        emit(self.port.events, SwapAbortedHere(swap_id=plan.id, reason=reason))
        if plan.kind == SwapKind.UNPLANNED and plan.leaver.node == me and not plan.superseded:
            dead = self._slots.slots[plan.leaver.slot]
            # free of --max-restarts only when the planner found the live recovery impossible (it says why);
            # a second fault during the recovery or no spare at all spends a restart, as under torchrun
            why = plan.outcome or "its recovery was aborted"
            self.port.post(FallbackRequested(f"rank {plan.leaver.rank} cannot be recovered live: {why}", dead,
                                             free=plan.outcome is not None))
