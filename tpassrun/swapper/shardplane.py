"""The agent's side of sharded-state recovery (``sess.track_sharded``; the worker side is :mod:`tpassrun.worker.shards`).

What an agent contributes to an unplanned recovery of a job with sharded state:

* **pause**: the steps every local survivor holds a local copy of (``rings``: read from their channel slots,
  no message), the dead rank's own (``dead_ring``: its slot outlives it), and, if this node is the dead rank's
  buddy, the steps of its shard this node's mirror store holds (``mirror_steps``, ``mirror_addr``). The leader
  then picks the step (:func:`tpassrun.plan.swap.resume_plan`);
* **transfer**: when the plan rolls every rank back (``plan.restore``), tells each local survivor to load its
  own copy of that step and waits until all did, before any donor sends;
* **the joiner's assignment**: where the dead rank's mirrored shard is (the holder's mirror target, with the
  run's key), so the joiner fetches it itself while the donor streams the replicated state.

The agent never decodes a shard (nor imports torch): it reads int64 fields and passes addresses along.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Iterable

from tpassrun.channel import Field, MirrorSource, ShardRollback, ShardRolledBack, WorkerPhase

if TYPE_CHECKING:
    from tpassrun.channel import ChannelFile, LocalSlots, Slot
    from tpassrun.records import SwapPlan
    from tpassrun.swapper.agentport import AgentPort

log = logging.getLogger(__name__)

MIRROR_KIND = "shard/state"        # == tpassrun.worker.shards.MIRROR_KIND (that module imports torch)
ROLLBACK_TIMEOUT_S = 120.0


_VERSIONS = (Field.SHARD_V0, Field.SHARD_V1, Field.SHARD_V2)


def tracks_sharded(ch: Any, slot: int) -> bool:
    """Whether a worker tracks sharded state (``sess.track_sharded``), from the call on: before its first copy
    too, so that a rank dying inside step 0 is planned as one whose shard is in a mirror (its step-0 copy)."""
    return ch is not None and bool(ch.get(slot, Field.SHARD_TRACKED) or ch.get(slot, Field.SHARD_HELD))


def ring_of(ch: Any, slot: int) -> tuple[int, ...] | None:
    """The steps whose local copy a worker holds complete (None: it tracks no sharded state)."""
    if not tracks_sharded(ch, slot):
        return None
    return tuple(sorted(v - 1 for v in (ch.get(slot, f) for f in _VERSIONS) if v > 0))


def live_step(ch: "ChannelFile", slot: int) -> int | None:
    """The step whose start a stopped survivor's live state is (paused before it, or failed in it before its
    commit point): it can resume there with no copy at all."""
    phase, step = ch.position(slot)
    if phase == WorkerPhase.PAUSED or (phase == WorkerPhase.FAILED and ch.get(slot, Field.COMMITTED) != step + 1):
        return step
    return None


def survivors_rings(ch: Any, slots: Iterable["Slot"]) -> tuple[int, ...] | None:
    """The steps *every* one of these survivors can be put back to (a local copy, or its live state); None when
    none tracks sharded state."""
    rings = []
    for s in slots:
        ring, live = ring_of(ch, s.index), live_step(ch, s.index)
        rings.append(None if ring is None else tuple(sorted(set(ring) | ({live} if live is not None else set()))))
    held = [set(r) for r in rings if r is not None]
    if not held:
        return None
    common = set.intersection(*held) if len(held) == len(rings) else set()
    return tuple(sorted(common))


def mirror_report(mirror: Any, rank: int, min_epoch: int) -> dict[str, Any]:
    """The Report fields of a node whose mirror store holds ``rank``'s shard (empty if it holds none)."""
    if mirror is None:
        return {}
    held = mirror.held([rank], MIRROR_KIND, min_epoch).get(rank)
    if not held:
        return {}
    target = mirror.own_target()
    return {"mirror_steps": tuple(held), "mirror_addr": (target.addr, target.port)}


def pause_fields(port: "AgentPort", plan: "SwapPlan", survivors: Iterable["Slot"]) -> dict[str, Any]:
    """An unplanned plan's PAUSE report fields for sharded state: the copies the local survivors hold, the dead
    rank's own, and what this node's mirror holds of the dead rank's shard."""
    from tpassrun.records import SwapKind

    if plan.kind != SwapKind.UNPLANNED:
        return {}
    ch = port.slots.channel
    fields: dict[str, Any] = {"rings": survivors_rings(ch, [s for s in survivors if s.alive])}
    if plan.leaver.node == port.node_id:
        fields["dead_ring"] = ring_of(ch, plan.leaver.slot)
    if plan.leaver.rank is not None:     # an unplanned plan names its dead rank
        fields.update(mirror_report(port.mirror(), plan.leaver.rank, port.epoch()))
    return fields


async def mirror_source(mirror: Any, plan: "SwapPlan") -> MirrorSource | None:
    """For the joiner's ``assign``: the dead rank's mirrored shard (the holder's target with the key, the owner
    rank and the step), None when the plan takes no shard from a mirror."""
    if plan.shard_from is None or mirror is None:
        return None
    target = await mirror.target_of(plan.shard_node) if plan.shard_node else None
    if target is None:
        raise RuntimeError(f"the mirror of node {plan.shard_node!r} holding rank {plan.leaver.rank}'s shard is gone")
    assert plan.leaver.rank is not None and plan.boundary is not None
    return MirrorSource(target=target.to_json(), owner=plan.leaver.rank, step=plan.boundary)


async def roll_back(slots: "LocalSlots", survivors: Iterable["Slot"], step: int) -> str | None:
    """Every local survivor loads its own copy of ``step``'s start; None when all did, else why not."""
    waiting = []
    for s in survivors:
        if slots.phase(s) not in (WorkerPhase.PAUSED, WorkerPhase.FAILED):
            return f"rank {s.rank} is not stopped (phase {slots.phase(s)!r}): cannot roll it back"
        slots.send(s, ShardRollback(step=step))
        waiting.append(s)
    answers = await asyncio.gather(*(slots.expect(s, (ShardRolledBack,), ROLLBACK_TIMEOUT_S) for s in waiting))
    for s, msg in zip(waiting, answers):
        if msg is None or not msg.ok:
            return (f"rank {s.rank} could not roll back to its copy of step {step}: "
                    f"{msg.error if msg is not None else 'no answer'}")
    return None


__all__ = ["MIRROR_KIND", "mirror_report", "mirror_source", "pause_fields", "ring_of", "roll_back", "survivors_rings"]
