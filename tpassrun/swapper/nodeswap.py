"""The participant's part of a node plan: every rank of a lost node moved at once (see :mod:`tpassrun.plan.swap`).

Each agent follows the plan phase by phase, as for a single-rank swap (:class:`tpassrun.swapper.Swapper`), and
reports its part:

* PAUSE (surviving members): stop the workers (they fail in the collective the lost ranks never joined, or stop
  at their next step start) and say which light copies this node's mirror holds for the lost ranks;
* TRANSFER (joiner nodes): hand every joiner its rank at once, report where each listens; meanwhile fetch each
  lost rank's light frame for the resume step from the mirror the planner named (the buddy's);
* SEND (donor and joiner nodes): donors stream model/optimizer, several in parallel, each to its joiner (the
  address checked against the joiner node's registration); joiners get their light frame, verify both;
* REFORM (everyone): survivors roll back to the failed step's start and join the new world, the joiners take
  the lost ranks, all at the swap's store (a new one when the lost node ran it).

Nothing is retried: on a failure the leader aborts the plan and restarts the group.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from typing import TYPE_CHECKING

from tpassrun.channel import (
    INT64_MAX,
    Abort,
    Light,
    LightOk,
    MirrorSource,
    Received,
    Reform,
    SendState,
    SlotState,
    WorkerPhase,
    WorldSpec,
)
from tpassrun.plan import PHASE_TIMEOUT_S, transfer_key, world_prefix
from tpassrun.records import (
    CollectivesBroken,
    Move,
    NodeRecovered,
    Phase,
    RanksRecovered,
    Report,
    SwapAbortedHere,
    SwapPlan,
    SwapReformTimings,
    SwapSendRefused,
    SwapTransferEnd,
    SwapTransferFailed,
    SwapTransferStart,
    SwapWorldReformed,
    emit,
)
from tpassrun.swapper import shardplane

if TYPE_CHECKING:
    from tpassrun.channel import LocalSlots
    from tpassrun.swapper.agentport import AgentPort
    from tpassrun.swapper.phases import Phases
    from tpassrun.swapper.ranks import LocalRanks

log = logging.getLogger(__name__)


class NodePlans:
    """One per swapper; :meth:`participate` is its ``_participate`` for plans of kind ``node``: this node's part of
    the plan's phase, and its report. Given the agent (``port``), this node's ranks (``ranks``) and the single-rank
    phases whose steps it reuses (``phases``: pausing, assigning a joiner, the checks before sending, the re-form)."""

    def __init__(self, port: AgentPort, ranks: LocalRanks, phases: Phases) -> None:
        self.port = port
        self.ranks = ranks
        self.phases = phases
        self._lights: dict[tuple[str, int], bytes | None] = {}   # (plan id, rank) -> light frame for the joiner

    @property
    def me(self) -> str:
        return self.port.node_id

    @property
    def _slots(self) -> LocalSlots:
        return self.port.slots

    def _mine(self, plan: SwapPlan) -> list[Move]:
        return [m for m in plan.moves if m.joiner.node == self.me]

    async def participate(self, plan: SwapPlan) -> Report | None:
        phase, me = plan.phase, self.me
        if phase == Phase.PAUSE:
            return await self._pause(plan) if me in plan.nodes else None
        if phase == Phase.TRANSFER:
            return await self._transfer(plan)
        if phase == Phase.SEND:
            return await self._send(plan)
        if phase == Phase.REFORM:
            return await self._reform(plan) if me in plan.nodes else None
        if phase == Phase.DONE:
            if me in plan.nodes and plan.lost_node is None:     # several dead ranks (a second fault)
                emit(self.port.events, RanksRecovered(swap_id=plan.id, ranks=list(plan.ranks),
                                                      to=sorted({m.joiner.node for m in plan.moves}), boundary=plan.boundary,
                                                      seconds=round(plan.history[-1][1] - plan.history[0][1], 4)))
            elif me in plan.nodes:
                emit(self.port.events, NodeRecovered(swap_id=plan.id, lost_node=plan.lost_node, also=list(plan.lost_also),
                                                     ranks=list(plan.ranks), to=sorted({m.joiner.node for m in plan.moves}),
                                                     boundary=plan.boundary,
                                                     seconds=round(plan.history[-1][1] - plan.history[0][1], 4)))
            self._forget(plan)
            return None
        if phase == Phase.ABORTED:
            if len(plan.history) > 1:     # born aborted (no live recovery was possible): nothing was started
                self._abort(plan)
            self._forget(plan)
        return None

    def _forget(self, plan: SwapPlan) -> None:
        for key in [k for k in self._lights if k[0] == plan.id]:
            del self._lights[key]

    # ------------------------------------------------------------------ phases
    async def _pause(self, plan: SwapPlan) -> Report:
        self._break_collectives(plan)
        report: Report = await self.phases.pause(plan)
        if not report.ok:
            return report
        mirror, gen = self.port.mirror(), self.port.epoch()
        held = mirror.held(plan.ranks) if mirror is not None else {}
        # sharded state (tpassrun/plan/node_shards.py): the steps every local survivor can be put back to, and what this node's
        # mirror holds of the lost ranks' shards
        shards = mirror.held(plan.ranks, shardplane.MIRROR_KIND, gen) if mirror is not None else {}
        survivors = [s for s in self.ranks.survivors(plan) if s.alive]
        rings = shardplane.survivors_rings(self._slots.channel, survivors) if survivors else None
        return dataclasses.replace(report, held=held, stops=self.ranks.stops(plan), backs=self.ranks.backs(plan),
                                   shard_held=shards, rings=rings)

    def _break_collectives(self, plan: SwapPlan) -> None:
        """Every local survivor inside a step is told to shut its process-group sockets down now: a collective
        it is blocked in with the lost node's ranks may never fail by itself (a partition, a host that lost
        power: no connection reset reaches it) and would hold the recovery until the group's timeout. Its step
        then fails like any step a peer died in (tpassrun/worker/watch.py); one paused or failed already is left alone."""
        slots, broken = self._slots, []
        for s in self.ranks.survivors(plan):
            if slots.phase(s) == WorkerPhase.RUNNING and slots.break_collectives(
                    s, f"node {plan.lost_node} was declared lost"):
                broken.append(s.rank)
        if broken:
            emit(self.port.events, CollectivesBroken(swap_id=plan.id, lost_node=plan.lost_node, ranks=broken))

    async def _transfer(self, plan: SwapPlan) -> Report | None:
        self.phases.saw_transfer(plan)
        mine, behind = self._mine(plan), self.ranks.catching_up(plan)
        survivors = [s for s in self.ranks.survivors(plan) if s.alive]
        if plan.restore and self.me in plan.nodes and survivors:
            why = await self.phases.roll_back_once(plan, survivors)
            if why is not None:
                return Report(node=self.me, phase=plan.phase, ok=False, final=True, error=why)
        if not mine and not behind:
            return Report(node=self.me, phase=plan.phase) if plan.restore and self.me in plan.nodes else None
        sources = await asyncio.gather(*(self._shard_source(plan, m) for m in mine))
        assigned, fetched = await asyncio.gather(
            asyncio.gather(*(self.phases.assign_joiner(plan, m, mirror_from=src) for m, src in zip(mine, sources)),
                           *(self.ranks.listen_catch_up(plan, m) for m in behind)),
            asyncio.gather(*(self._fetch_light(plan, m) for m in mine)))
        addrs: dict[int, tuple[str, int]] = {}
        for move, result in zip([*mine, *behind], assigned):
            if isinstance(result, str):
                emit(self.port.events, SwapTransferFailed(swap_id=plan.id, error=result, rank=move.rank))
                return Report(node=self.me, phase=plan.phase, ok=False, final=True, error=result)
            addrs[move.rank] = result
        for _move, err in zip(mine, fetched):
            if err is not None:
                return Report(node=self.me, phase=plan.phase, ok=False, final=True, error=err)
        emit(self.port.events, SwapTransferStart(swap_id=plan.id, ranks=sorted(addrs)))
        return Report(node=self.me, phase=plan.phase, joiner_addrs=addrs)

    async def _shard_source(self, plan: SwapPlan, move: Move) -> MirrorSource | None:
        """Where the joiner of a lost rank with sharded state fetches its shard of the resume step (with the
        rank's light snapshot): the mirror the planner named, with the run's key."""
        node = plan.shards_from.get(move.rank)
        mirror = self.port.mirror()
        if node is None or mirror is None:
            return None
        target = await mirror.target_of(node)
        if target is None:
            return None     # the joiner then receives no shard: its Received says so, the plan aborts
        return MirrorSource(target=target.to_json(), owner=move.rank, step=int(plan.boundary or 0))

    async def _fetch_light(self, plan: SwapPlan, move: Move) -> str | None:
        """Keep the lost rank's light frame for the resume step (from the mirror the planner named); the error
        if it is gone. A rank with no copy at all resumes at step 0 from what its script builds; one with sharded
        state gets it with its shard (the shard mirror keeps the two together)."""
        if move.rank in plan.shards_from and move.rank not in plan.light_from:
            self._lights[(plan.id, move.rank)] = None
            return None
        source = plan.light_from.get(move.rank)
        if source is None:
            self._lights[(plan.id, move.rank)] = None
            return None if not plan.boundary else f"no mirror holds rank {move.rank}'s state for step {plan.boundary}"
        mirror = self.port.mirror()
        data = await mirror.fetch_light(source, move.rank, int(plan.boundary or 0)) if mirror is not None else None
        if data is None:
            return f"rank {move.rank}'s state for step {plan.boundary} is no longer in {source}'s mirror"
        self._lights[(plan.id, move.rank)] = data
        return None

    async def _send(self, plan: SwapPlan) -> Report | None:
        me = self.me
        catching_up = {id(m) for m in plan.catch_up}
        for move in (*plan.catch_up, *plan.moves):
            if move.donor is None or move.donor.node != me:
                continue
            refused = await self.phases.refuse_destination(plan, move, catch_up=id(move) in catching_up)
            if refused is not None:
                log.error("swap %s: refusing to send rank %s's state: %s", plan.id, move.rank, refused)
                emit(self.port.events, SwapSendRefused(swap_id=plan.id, reason=refused))
                return Report(node=me, phase=plan.phase, ok=False, final=True, error=f"send refused: {refused}")
            assert move.joiner_addr is not None
            donor = self._slots.slots[move.donor.slot]
            # a donor serving several joiners streams to them one after the other (it reads its commands in turn)
            key = transfer_key(plan)
            assert key is not None   # _refuse_destination checked it
            self._slots.send(donor, SendState(addr=move.joiner_addr[0], port=move.joiner_addr[1], swap_id=plan.id,
                                              key=key, rank=move.rank, replicated_only=True, rng=False,
                                              without_sharded=move.rank in plan.shards_from,
                                              timeout=PHASE_TIMEOUT_S))
        mine, behind = self._mine(plan), self.ranks.catching_up(plan)
        if not mine and not behind:
            return None
        results = await asyncio.gather(*(self._receive(plan, m) for m in mine),
                                       *(self.ranks.caught_up(plan, m) for m in behind))
        errors = [r for r in results if isinstance(r, str)]
        if errors:
            return Report(node=me, phase=plan.phase, ok=False, final=True, error=errors[0])
        return Report(node=me, phase=plan.phase, extra={"nbytes": sum(int(r or 0) for r in results)})

    async def _receive(self, plan: SwapPlan, move: Move) -> int | str:
        """One joiner here: its light frame in, its state received and verified: the bytes, or why not."""
        joiner = self._slots.slots[move.joiner.slot]
        light = self._lights.get((plan.id, move.rank))
        if light is not None:
            self._slots.send(joiner, Light(data=base64.b64encode(light).decode(), step=plan.boundary))
        msg = await self.ranks.await_received(plan, joiner)
        if msg == "aborted":
            self._slots.send(joiner, Abort())
            return "the plan was aborted"
        if not isinstance(msg, Received) or not msg.ok:
            err = msg.error if isinstance(msg, Received) else None
            err = f"rank {move.rank}: {err or 'the joiner died or timed out during the transfer'}"
            emit(self.port.events, SwapTransferFailed(swap_id=plan.id, error=err, rank=move.rank))
            return err
        emit(self.port.events, SwapTransferEnd(swap_id=plan.id, rank=move.rank, nbytes=msg.nbytes, seconds=msg.seconds,
                                               checksum=msg.checksum))
        if light is not None:
            ok = await self._slots.expect(joiner, (LightOk,), 5.0)
            if ok is None or ok.ok is False:
                return (f"the joiner of rank {move.rank} rejected its mirrored snapshot (step "
                        f"{ok.step if ok else None}, resume step {plan.boundary})")
        return int(msg.nbytes or 0)

    async def _reform(self, plan: SwapPlan) -> Report | None:
        me, slots = self.me, self._slots
        gen = self.port.generation()
        assert gen is not None
        addr, port = plan.store or self.port.master()
        silent = await self.phases.store_silent(addr, port)
        if silent:
            return Report(node=me, phase=plan.phase, ok=False, error=silent)
        store = (addr, port, world_prefix(plan), gen.number + 1)
        waiting = []
        for s in self.ranks.survivors(plan):
            slots.set_run_until(s, INT64_MAX)
            assert s.rank is not None
            slots.send(s, Reform(world=WorldSpec(rank=s.rank, world_size=gen.world_size).with_store(*store),
                                 rollback=True, resume=plan.boundary))
            waiting.append(s)
        for move in self._mine(plan):
            joiner = slots.slots[move.joiner.slot]
            slots.set_run_until(joiner, INT64_MAX)
            slots.send(joiner, Reform(world=self.phases.joiner_world(plan, move).with_store(*store)))
            joiner.state, joiner.rank = SlotState.RUNNING, move.rank
            waiting.append(joiner)
        for move in plan.moves:
            if move.leaver.node == me:                              # a dead rank of this live node: its slot
                dead = slots.slots[move.leaver.slot]                # is quarantined, as a single recovery's is
                if dead.rank == move.rank and dead.state != SlotState.RUNNING:
                    dead.state, dead.quarantine_reason, dead.home_rank = (SlotState.QUARANTINED,
                                                                          f"rank died: {plan.reason}", move.rank)
                    dead.rank = None
        if plan.store is not None:
            self.port.set_master(plan.store, plan.store_host)
        answers = await self.phases.await_reformed(plan, waiting)
        if answers is None:
            return None
        if isinstance(answers, str):
            return Report(node=me, phase=plan.phase, ok=False, error=answers)
        emit(self.port.events, SwapReformTimings(swap_id=plan.id,
                                                 ranks={str(s.rank): msg.timings() for s, msg in zip(waiting, answers)}))
        emit(self.port.events, SwapWorldReformed(swap_id=plan.id, generation=gen.number + 1))
        return Report(node=me, phase=plan.phase)

    def _abort(self, plan: SwapPlan) -> None:
        """Give back the spares this node had assigned; the survivors wait for the group restart the leader
        asked for (a failed collective cannot be resumed)."""
        slots = self._slots
        for s in slots.slots:
            slots.set_run_until(s, INT64_MAX)
        for move in self._mine(plan):
            joiner = slots.slots[move.joiner.slot]
            if joiner.state == SlotState.SPARE:
                slots.send(joiner, Abort())
        emit(self.port.events, SwapAbortedHere(swap_id=plan.id, reason=plan.outcome or "aborted"))


__all__ = ["NodePlans"]
