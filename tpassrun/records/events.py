"""The event log's events as types: each one declared once, written and read by the one codec (:mod:`tpassrun.schema`).

An event-log line is ``{"event": NAME, "time": ..., "mono": ..., "node": ..., FIELDS...}``: the envelope is the
event log's (:class:`tpassrun.ops.events.EventLog`); the name and the fields are the event's. A type's fields are
its keys, in the order they are written; a field that only some writers give is left out while it holds its
default (``omit_default``), as the writers left it out before there were types. ``tests/test_event_types.py`` reads
the event logs of real runs (``tests/golden/events``) back through these types and writes them again, key for key.

Declared so far: the live swap's events (every event ``tpassrun.swapper`` writes). The other writers still pass a
name and keyword fields (``events.write("restart", reason=...)``; issue 40).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Protocol

from tpassrun import schema
from tpassrun.records.swaps import Phase, SlotRef, SwapKind


class Sink(Protocol):
    """Where events go: the event log, or whatever stands in for it."""

    def write(self, event: str, **fields: Any) -> object: ...


def _optional() -> Any:
    """A field only some writers give: None, and then not written."""
    return field(default=None, metadata=schema.wire(omit_default=True))


@dataclass(frozen=True)
class Event(schema.Record):
    """One kind of event: ``NAME`` is its ``"event"``; its fields are the rest of the line."""

    NAME: ClassVar[str] = ""

    @property
    def name(self) -> str:
        return self.NAME

    def fields(self) -> dict[str, Any]:
        return self.to_json()


def emit(sink: Sink, event: Event) -> object:
    """Write ``event`` to ``sink`` (what the sink returns: an event log returns the line it wrote)."""
    return sink.write(event.name, **event.fields())


# --------------------------------------------------------------------------------------------- the swap's events
@dataclass(frozen=True)
class SwapPlanSeen(Event):
    """``swap_<phase>``: this agent takes part in a swap plan's phase (``phase`` names the event, not a field)."""

    swap_id: str
    kind: SwapKind
    rank: int | None
    leaver: SlotRef
    joiner: SlotRef
    boundary: int | None
    attempt: int
    ranks: list[int]
    lost_node: str | None
    phase: Phase = field(default=Phase.PAUSE, metadata=schema.wire(skip=True))

    @property
    def name(self) -> str:
        return f"swap_{self.phase.value}"


@dataclass(frozen=True)
class SwapDecided(Event):
    NAME: ClassVar[str] = "swap_decided"
    swap_id: str
    reason: str
    taint: str


@dataclass(frozen=True)
class SwapPhaseChanged(Event):
    """The leader moved a plan to its next phase."""

    NAME: ClassVar[str] = "swap_phase"
    swap_id: str
    phase: Phase
    reason: str


@dataclass(frozen=True)
class SwapBoundaryReached(Event):
    NAME: ClassVar[str] = "swap_boundary_reached"
    swap_id: str
    step: int


@dataclass(frozen=True)
class SwapShardsRolledBack(Event):
    NAME: ClassVar[str] = "swap_shards_rolled_back"
    swap_id: str
    step: int | None


@dataclass(frozen=True)
class SwapTransferStart(Event):
    """A transfer began: to one joiner (a rank's swap) or to the ranks of a lost node (``ranks``)."""

    NAME: ClassVar[str] = "swap_transfer_start"
    swap_id: str
    ranks: list[int] | None = _optional()
    joiner: SlotRef | None = _optional()


@dataclass(frozen=True)
class SwapTransferEnd(Event):
    NAME: ClassVar[str] = "swap_transfer_end"
    swap_id: str
    rank: int | None = _optional()      # a lost node's recovery: the rank received
    nbytes: int = 0
    seconds: float = 0.0
    checksum: str = ""


@dataclass(frozen=True)
class SwapTransferFailed(Event):
    NAME: ClassVar[str] = "swap_transfer_failed"
    swap_id: str
    error: str
    rank: int | None = _optional()      # a lost node's recovery: the rank that was not received
    attempt: int | None = _optional()   # a rank's swap: the attempt that failed


@dataclass(frozen=True)
class SwapTransferStranger(Event):
    NAME: ClassVar[str] = "swap_transfer_stranger"
    swap_id: str
    error: str


@dataclass(frozen=True)
class SwapSendRefused(Event):
    NAME: ClassVar[str] = "swap_send_refused"
    swap_id: str
    reason: str


@dataclass(frozen=True)
class SwapReformTimings(Event):
    """Per re-formed rank (its decimal string): the seconds of each part of its re-formation."""

    NAME: ClassVar[str] = "swap_reform_timings"
    swap_id: str
    ranks: Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class SwapWorldReformed(Event):
    NAME: ClassVar[str] = "swap_world_reformed"
    swap_id: str
    generation: int


@dataclass(frozen=True)
class SwapResumed(Event):
    """Training resumed after a swap (``with_swap``: a second swap that began while this one ran, and ended it)."""

    NAME: ClassVar[str] = "swap_resumed"
    swap_id: str
    rank: int | None
    ranks: list[int] | None = _optional()
    seconds: float = 0.0
    with_swap: str | None = _optional()


@dataclass(frozen=True)
class SwapAbortedHere(Event):
    NAME: ClassVar[str] = "swap_aborted_here"
    swap_id: str
    reason: str


@dataclass(frozen=True)
class SwapJoinAborted(Event):
    NAME: ClassVar[str] = "swap_join_aborted"
    ranks: list[int | None]


@dataclass(frozen=True)
class GenerationCommitted(Event):
    NAME: ClassVar[str] = "generation_committed"
    generation: int
    swap_id: str


@dataclass(frozen=True)
class RankCaughtUp(Event):
    NAME: ClassVar[str] = "rank_caught_up"
    swap_id: str
    rank: int | None
    step: int | None
    donor: int | None
    nbytes: int


@dataclass(frozen=True)
class RecordReplaced(Event):
    NAME: ClassVar[str] = "record_replaced"
    key: str
    swap_id: str
    reason: str


@dataclass(frozen=True)
class StoreMoved(Event):
    NAME: ClassVar[str] = "store_moved"
    addr: str
    port: int
    swap_id: str
    reason: str


# --------------------------------------------------------------------------------------------- a lost node
@dataclass(frozen=True)
class NodeLost(Event):
    NAME: ClassVar[str] = "node_lost"
    lost_node: str


@dataclass(frozen=True)
class AgentGone(Event):
    NAME: ClassVar[str] = "agent_gone"
    lost_node: str
    reason: str


@dataclass(frozen=True)
class PoolNodeLeft(Event):
    NAME: ClassVar[str] = "pool_node_left"
    lost_node: str
    pool: str
    pool_node: str


@dataclass(frozen=True)
class NodeHandedBack(Event):
    """The leader handed this node back to the scheduler (``handbacks/<node>``) and its agent left: no loss."""

    NAME: ClassVar[str] = "node_handed_back"
    lost_node: str
    sched_node: str
    reason: str


@dataclass(frozen=True)
class CollectivesBroken(Event):
    NAME: ClassVar[str] = "collectives_broken"
    swap_id: str
    lost_node: str | None
    ranks: list[int | None]


@dataclass(frozen=True)
class RanksRecovered(Event):
    NAME: ClassVar[str] = "ranks_recovered"
    swap_id: str
    ranks: list[int]
    to: list[str]
    boundary: int | None
    seconds: float


@dataclass(frozen=True)
class NodeRecovered(Event):
    NAME: ClassVar[str] = "node_recovered"
    swap_id: str
    lost_node: str | None
    also: list[str]
    ranks: list[int]
    to: list[str]
    boundary: int | None
    seconds: float


# --------------------------------------------------------------------------------------------- workers and slots
@dataclass(frozen=True)
class WorkerDied(Event):
    NAME: ClassVar[str] = "worker_died"
    slot: int
    rank: int | None
    code: int
    step: int
    kind: str
    why: str


@dataclass(frozen=True)
class UserError(Event):
    NAME: ClassVar[str] = "user_error"
    slot: int
    rank: int | None
    code: int
    step: int
    why: str


@dataclass(frozen=True)
class FailureDropped(Event):
    NAME: ClassVar[str] = "failure_dropped"
    slot: int
    rank: int | None
    reason: str


@dataclass(frozen=True)
class SpareReturned(Event):
    NAME: ClassVar[str] = "spare_returned"
    slot: int
    reason: str | None = _optional()


@dataclass(frozen=True)
class MigrateBackRequested(Event):
    NAME: ClassVar[str] = "migrate_back_requested"
    rank: int
    slot: int
    taint: str


# --------------------------------------------------------------------------------------------- the mirror
@dataclass(frozen=True)
class MirrorBuddy(Event):
    NAME: ClassVar[str] = "mirror_buddy"
    buddy: str | None
    ring: list[str]


@dataclass(frozen=True)
class MirrorPushFailed(Event):
    NAME: ClassVar[str] = "mirror_push_failed"
    buddy: str | None
    error: str


@dataclass(frozen=True)
class MirrorPushRestored(Event):
    NAME: ClassVar[str] = "mirror_push_restored"
    buddy: str


# --------------------------------------------------------------------------------------------- the table
_NAMED: list[type[Event]] = [
    SwapDecided, SwapPhaseChanged, SwapBoundaryReached, SwapShardsRolledBack, SwapTransferStart, SwapTransferEnd,
    SwapTransferFailed, SwapTransferStranger, SwapSendRefused, SwapReformTimings, SwapWorldReformed, SwapResumed,
    SwapAbortedHere, SwapJoinAborted, GenerationCommitted, RankCaughtUp, RecordReplaced, StoreMoved, NodeLost,
    AgentGone, PoolNodeLeft, NodeHandedBack, CollectivesBroken, RanksRecovered, NodeRecovered, WorkerDied, UserError,
    FailureDropped,
    SpareReturned, MigrateBackRequested, MirrorBuddy, MirrorPushFailed, MirrorPushRestored]

#: event name -> its type (``swap_<phase>``: :class:`SwapPlanSeen`, one name per phase)
EVENTS: dict[str, type[Event]] = {**{cls.NAME: cls for cls in _NAMED},
                                  **{f"swap_{phase.value}": SwapPlanSeen for phase in Phase}}


def read_event(line: Mapping[str, Any]) -> Event | None:
    """The typed event of an event-log line (its envelope set aside), or None for a name not declared here;
    :class:`~tpassrun.schema.SchemaError` for a declared one whose fields do not fit."""
    name = line.get("event")
    cls = EVENTS.get(name) if isinstance(name, str) else None
    if cls is None:
        return None
    fields = {k: v for k, v in line.items() if k not in ENVELOPE}
    event = cls.from_json(fields)
    if isinstance(event, SwapPlanSeen):
        event = dataclasses.replace(event, phase=Phase(str(name)[len("swap_"):]))
    return event


#: the keys the event log adds to every event
ENVELOPE = ("event", "time", "mono", "node")


__all__ = ["ENVELOPE", "EVENTS", "AgentGone", "CollectivesBroken", "Event", "FailureDropped", "GenerationCommitted",
           "MigrateBackRequested", "MirrorBuddy", "MirrorPushFailed", "MirrorPushRestored", "NodeLost", "NodeRecovered",
           "NodeHandedBack", "PoolNodeLeft", "RankCaughtUp", "RanksRecovered", "RecordReplaced", "Sink", "SpareReturned",
           "StoreMoved",
           "SwapAbortedHere", "SwapBoundaryReached", "SwapDecided", "SwapJoinAborted", "SwapPhaseChanged",
           "SwapPlanSeen", "SwapReformTimings", "SwapResumed", "SwapSendRefused", "SwapShardsRolledBack",
           "SwapTransferEnd", "SwapTransferFailed", "SwapTransferStart", "SwapTransferStranger", "SwapWorldReformed",
           "UserError", "WorkerDied", "emit", "read_event"]
