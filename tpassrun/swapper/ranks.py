"""This node's ranks in a swap of any kind (a single rank's, :mod:`tpassrun.swapper.phases`, or a node plan's,
:mod:`tpassrun.swapper.nodeswap`; both hold the swapper's one :class:`LocalRanks`): the local survivors, where each
stopped and where else it could stand (a mixed commit, :mod:`tpassrun.plan.catchup`), the survivors a plan moves to
the resume step (they catch up from a survivor standing there), a receiver's answer, and whether the leader gave a
plan up meanwhile. It reads the slots and etcd and keeps nothing.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tpassrun.channel import CatchUp, Field, Listening, Received, Stranger, WorkerPhase
from tpassrun.plan import PHASE_TIMEOUT_S, Phase, SwapKind, of_attempt, transfer_key
from tpassrun.records import Keys, Move, RankCaughtUp, SwapPlan, SwapTransferStranger, emit, load

if TYPE_CHECKING:
    from tpassrun.channel import LocalSlots, Slot
    from tpassrun.swapper.agentport import AgentPort

log = logging.getLogger(__name__)


class LocalRanks:
    """What this node's ranks are in a plan, read from the agent's slots (``port``)."""

    def __init__(self, port: AgentPort) -> None:
        self.port = port

    @property
    def slots(self) -> LocalSlots:
        return self.port.slots

    def survivors(self, plan: SwapPlan) -> list[Slot]:
        """The local ranks that go on through ``plan``: every live managed running slot but an unplanned swap's dead rank."""
        me = self.port.node_id
        return [s for s in self.slots.active() if s.alive and s.managed
                and not (plan.leaver.node == me and s.index == plan.leaver.slot and plan.kind == SwapKind.UNPLANNED)]

    def stops(self, plan: SwapPlan) -> dict[int, tuple[int, int, bool]]:
        """rank -> (slot, the step it can resume at exactly or -1, whether it can catch up to the next one) for
        every stopped local survivor (a mixed commit, tpassrun/plan/catchup.py): one that failed inside a step before
        its commit point, outside an accumulation window, with a seal of the next step in its slot."""
        slots, ch, out = self.slots, self.slots.channel, {}
        for s in self.survivors(plan):
            ph, step = slots.position(s)
            if s.rank is None or ph not in (WorkerPhase.PAUSED, WorkerPhase.FAILED):
                continue
            offer = slots.field(s, Field.OFFER) - 1
            sealed = ch is not None and step + 1 in (ch.light_step(s.index), ch.light_step(s.index, previous=True))
            can = (ph == WorkerPhase.FAILED and offer == step and sealed
                   and slots.field(s, Field.COMMITTED) != step + 1)
            out[s.rank] = (s.index, offer if offer >= 0 or ph == WorkerPhase.FAILED else step, can)
        return out

    def backs(self, plan: SwapPlan) -> dict[int, int]:
        """rank -> the start of the transaction before the one each stopped local survivor offers: it can go back
        there given a survivor's replicated state of that step (a mixed commit the other way, catchup.mixed_commit)."""
        slots, out = self.slots, {}
        for s in self.survivors(plan):
            back = slots.field(s, Field.ALT_BACK) - 1
            if s.rank is not None and back >= 0 and slots.phase(s) in (WorkerPhase.PAUSED, WorkerPhase.FAILED):
                out[s.rank] = back
        return out

    def catching_up(self, plan: SwapPlan) -> list[Move]:
        """The moves of ``plan`` that bring a survivor of this node to the resume step (a mixed commit)."""
        return [m for m in plan.catch_up if m.joiner.node == self.port.node_id]

    async def listen_catch_up(self, plan: SwapPlan, move: Move) -> tuple[str, int] | str:
        """A survivor of this node that catches up: it listens for a leader's replicated state; its address, or why
        not."""
        me, slot = self.port.node_id, self.slots.slots[move.joiner.slot]
        key = transfer_key(plan)
        if key is None:
            return f"swap {plan.id} carries no transfer secret: refusing an unauthenticated transfer"
        if slot.rank != move.rank or not slot.alive:
            return f"rank {move.rank} is no longer running on {me}/{move.joiner.slot}"
        self.slots.send(slot, CatchUp(swap_id=plan.id, key=key, rank=move.rank, listen_host=self.port.addr,
                                      step=int(plan.boundary or 0), timeout=PHASE_TIMEOUT_S,
                                      accept_timeout=PHASE_TIMEOUT_S, attempt=plan.attempt))
        msg = await self.slots.expect(slot, (Listening, Received), PHASE_TIMEOUT_S, of_attempt(plan))
        if isinstance(msg, Listening):
            return (self.port.addr, msg.port)
        return f"rank {move.rank} cannot catch up: {msg.error if isinstance(msg, Received) else 'no answer'}"

    async def caught_up(self, plan: SwapPlan, move: Move) -> int | str:
        """A survivor of this node catching up: the bytes it received and loaded, or why not."""
        msg = await self.await_received(plan, self.slots.slots[move.joiner.slot])
        if not isinstance(msg, Received) or not msg.ok:
            err = msg.error if isinstance(msg, Received) else msg
            return f"rank {move.rank} did not catch up: {err or 'no answer'}"
        emit(self.port.events, RankCaughtUp(swap_id=plan.id, rank=move.rank, step=plan.boundary,
                                            donor=move.donor.rank if move.donor else None, nbytes=msg.nbytes))
        return int(msg.nbytes or 0)

    async def await_received(self, plan: SwapPlan, joiner: Slot) -> Received | str | None:
        """The joiner's "received", or "aborted" once the leader gave the plan up (a sender that died before
        connecting leaves the joiner listening; plans are followed one at a time, so this wait must look)."""
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while time.monotonic() < deadline:
            msg: Received | Stranger | None = await self.slots.expect(joiner, (Received, Stranger), 0.5,
                                                                       of_attempt(plan))
            if isinstance(msg, Stranger):
                emit(self.port.events, SwapTransferStranger(swap_id=plan.id, error=msg.error))
                continue
            if msg is not None or not joiner.alive:
                return msg
            if await self.given_up(plan):
                return "aborted"
        return None

    async def given_up(self, plan: SwapPlan) -> bool:
        """The leader aborted ``plan`` since this phase began (read from etcd: a malformed or missing record is
        not taken for an abort)."""
        key = Keys(self.port.rdzv.key("")).swap(plan.id)
        try:
            doc, rev = await self.port.rdzv.store.get_json(key)
        except Exception as exc:  # noqa: BLE001 - etcd away: the phase goes on, the next look tries again
            log.debug("reading %s: %s", key, exc)
            return False
        now = load(SwapPlan.from_json, key, doc, rev) if doc is not None else None
        return now is not None and now.phase == Phase.ABORTED


__all__ = ["LocalRanks"]
