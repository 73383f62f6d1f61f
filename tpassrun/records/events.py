"""The event log's events as types: each one declared once, written and read by the one codec (:mod:`tpassrun.schema`).

An event-log line is ``{"event": NAME, "time": ..., "mono": ..., "node": ..., FIELDS...}``: the envelope is the
event log's (:class:`tpassrun.ops.events.EventLog`); the name and the fields are the event's. A type's fields are
its keys, in the order they are written; a field that only some writers give is left out while it holds its
default (``omit_default``), as the writers left it out before there were types. ``tests/test_event_types.py`` reads
the event logs of real runs (``tests/golden/events``) back through these types and writes them again, key for key.

Declared so far: every event ``tpassrun.swapper`` and ``tpassrun.agent`` write. The other writers (the scheduler's
watcher, the pool, the leader's ``Say`` actions) still pass a name and keyword fields (issue 40).
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


# --------------------------------------------------------------------------------------------- the agent's events
@dataclass(frozen=True, kw_only=True)
class AddressLoopback(Event):
    NAME: ClassVar[str] = "address_loopback"
    addr: str
    line: str


@dataclass(frozen=True, kw_only=True)
class AgentExit(Event):
    NAME: ClassVar[str] = "agent_exit"
    code: int
    mirror: Any


@dataclass(frozen=True, kw_only=True)
class AgentStarted(Event):
    NAME: ClassVar[str] = "agent_started"
    endpoint: str
    run_id: str
    nproc: int
    spares: int
    event_log: str | None
    run_key: str | None


@dataclass(frozen=True, kw_only=True)
class EtcdConnectionLost(Event):
    NAME: ClassVar[str] = "etcd_connection_lost"
    reason: str


@dataclass(frozen=True, kw_only=True)
class EtcdConnectionOverdue(Event):
    NAME: ClassVar[str] = "etcd_connection_overdue"
    seconds: float
    reason: str


@dataclass(frozen=True, kw_only=True)
class EtcdConnectionRestored(Event):
    NAME: ClassVar[str] = "etcd_connection_restored"
    seconds: float


@dataclass(frozen=True, kw_only=True)
class EtcdHosted(Event):
    NAME: ClassVar[str] = "etcd_hosted"
    endpoint: str


@dataclass(frozen=True, kw_only=True)
class ExceptionCause(Event):
    NAME: ClassVar[str] = "exception_cause"
    slot: int
    rank: int | None
    step: int | None
    cause: str
    why: str
    error: str
    error_type: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class FallbackRestart(Event):
    NAME: ClassVar[str] = "fallback"
    reason: str
    spends_restart: bool | None = _optional()


@dataclass(frozen=True, kw_only=True)
class Fenced(Event):
    NAME: ClassVar[str] = "fenced"
    reason: str
    pids: list[int]


@dataclass(frozen=True, kw_only=True)
class GenerationEnded(Event):
    NAME: ClassVar[str] = "generation_ended"
    generation: int
    outcome: str
    reason: str
    step: int | None


@dataclass(frozen=True, kw_only=True)
class GenerationJoined(Event):
    NAME: ClassVar[str] = "generation_joined"
    generation: int
    world_size: int
    members: list[str]


@dataclass(frozen=True, kw_only=True)
class HangDetected(Event):
    NAME: ClassVar[str] = "hang_detected"
    slot: int
    rank: int | None
    pid: int | None
    proc_state: str
    seconds: float
    step: int | None
    role: str | None = _optional()
    phase: str | None = _optional()
    swap: bool | None = _optional()
    stale_ranks: list[Any] | None = _optional()
    what: str


@dataclass(frozen=True, kw_only=True)
class HangHeld(Event):
    NAME: ClassVar[str] = "hang_held"
    ranks: Any
    silent: Any
    seconds: float
    reason: str | None = _optional()
    lease_s: float | None = _optional()


@dataclass(frozen=True, kw_only=True)
class HealthKill(Event):
    NAME: ClassVar[str] = "health_kill"
    slot: int
    rank: int | None
    pid: int | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class HealthMessage(Event):
    NAME: ClassVar[str] = "health_message"
    message: str


@dataclass(frozen=True, kw_only=True)
class HealthTaint(Event):
    NAME: ClassVar[str] = "health_taint"
    id: str
    slot: int
    rank: int | None
    effect: str
    reason: str
    created: Any


@dataclass(frozen=True, kw_only=True)
class HealthUntaint(Event):
    NAME: ClassVar[str] = "health_untaint"
    id: str
    device: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class HealthVerdictNoted(Event):
    NAME: ClassVar[str] = "health_verdict"
    device: str
    status: str
    effect: str
    metric: Any
    reason: str
    slot: int | None
    rank: int | None
    action: str
    why: str


@dataclass(frozen=True, kw_only=True)
class LeaseLostNoted(Event):
    NAME: ClassVar[str] = "lease_lost"
    reason: str
    fenced: bool


@dataclass(frozen=True, kw_only=True)
class LeaseRegranted(Event):
    NAME: ClassVar[str] = "lease_regranted"
    reason: str


@dataclass(frozen=True, kw_only=True)
class LinkAmbiguous(Event):
    NAME: ClassVar[str] = "link_ambiguous"
    suspects: list[str]
    reason: str
    figures: Mapping[str, Any]
    peers: Mapping[str, Any]
    line: str


@dataclass(frozen=True, kw_only=True)
class LinkDegraded(Event):
    NAME: ClassVar[str] = "link_degraded"
    extra_ms: float
    reason: str
    figures: Mapping[str, Any]
    peers: Mapping[str, Any]
    action: str
    line: str


@dataclass(frozen=True, kw_only=True)
class LinkDown(Event):
    NAME: ClassVar[str] = "link_down"
    dev: str


@dataclass(frozen=True, kw_only=True)
class LinkHealthy(Event):
    NAME: ClassVar[str] = "link_healthy"
    reason: str
    line: str


@dataclass(frozen=True, kw_only=True)
class LinkSuspect(Event):
    NAME: ClassVar[str] = "link_suspect"
    reason: str
    figures: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class MembershipChange(Event):
    NAME: ClassVar[str] = "membership_change"
    reason: str


@dataclass(frozen=True, kw_only=True)
class MetricsServing(Event):
    NAME: ClassVar[str] = "metrics_serving"
    addr: str
    port: int


@dataclass(frozen=True, kw_only=True)
class PlansUnauthenticated(Event):
    NAME: ClassVar[str] = "plans_unauthenticated"
    reason: str


@dataclass(frozen=True, kw_only=True)
class PoolGivenBack(Event):
    NAME: ClassVar[str] = "pool_given_back"
    reason: str


@dataclass(frozen=True)
class HandedBackHere(Event):
    """This node's agent, handed back to the scheduler (``handbacks/<node>``), leaves the job (exit 0)."""

    NAME: ClassVar[str] = "handed_back"
    reason: str


@dataclass(frozen=True)
class HandBackRefused(Event):
    """A hand-back asked of a node where ranks still run: the agent stays (the leader asks only once they left)."""

    NAME: ClassVar[str] = "handback_refused"
    reason: str
    ranks: list[int]


@dataclass(frozen=True, kw_only=True)
class ReplicasCheckedNoted(Event):
    NAME: ClassVar[str] = "replicas_checked"
    reported_by: int | None
    step: int | None
    ok: bool
    action: str
    ranks: Any
    groups: Any
    nbytes: int
    seconds: float
    differ: Any
    detail: str
    recheck: bool


@dataclass(frozen=True, kw_only=True)
class Restart(Event):
    NAME: ClassVar[str] = "restart"
    reason: str
    remaining: int


@dataclass(frozen=True, kw_only=True)
class ShardMirror(Event):
    NAME: ClassVar[str] = "shard_mirror"
    rank: int | None
    slot: int
    bytes_per_refresh: int
    local_held: Any
    interval: Any
    buddy: str | None
    mirrored_step: int | None


@dataclass(frozen=True, kw_only=True)
class Signal(Event):
    NAME: ClassVar[str] = "signal"
    signal: str


@dataclass(frozen=True, kw_only=True)
class SlotQuarantined(Event):
    NAME: ClassVar[str] = "slot_quarantined"
    slot: int
    reason: str
    taint: str


@dataclass(frozen=True, kw_only=True)
class SnapshotFailed(Event):
    NAME: ClassVar[str] = "snapshot_failed"
    seq: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class SnapshotMigrated(Event):
    NAME: ClassVar[str] = "snapshot_migrated"
    rank: int | None
    from_slot: int
    to_slot: int
    seconds: float
    seq: int


@dataclass(frozen=True, kw_only=True)
class SnapshotRestored(Event):
    NAME: ClassVar[str] = "snapshot_restored"
    rank: int | None
    code: int
    seq: int
    snapshot_age: float
    seconds: float


@dataclass(frozen=True, kw_only=True)
class SnapshotTaken(Event):
    NAME: ClassVar[str] = "snapshot_taken"
    seq: int
    seconds: float
    ranks: Any
    bytes: int


@dataclass(frozen=True, kw_only=True)
class SpareLost(Event):
    NAME: ClassVar[str] = "spare_lost"
    slot: int
    code: int


@dataclass(frozen=True, kw_only=True)
class SpareNodeJoined(Event):
    NAME: ClassVar[str] = "spare_node_joined"
    joined: Any


@dataclass(frozen=True, kw_only=True)
class SpareReady(Event):
    NAME: ClassVar[str] = "spare_ready"
    slot: int
    pid: int | None


@dataclass(frozen=True, kw_only=True)
class StepInterrupted(Event):
    NAME: ClassVar[str] = "step_interrupted"
    slot: int
    rank: int | None
    step: int | None
    by: str
    error: str
    error_type: str
    failure: str
    log: str | None


@dataclass(frozen=True, kw_only=True)
class StoreStandby(Event):
    NAME: ClassVar[str] = "store_standby"
    port: int
    pid: int | None


@dataclass(frozen=True, kw_only=True)
class TimerExpired(Event):
    NAME: ClassVar[str] = "timer_expired"
    rank: int | None
    slot: int | None
    pid: int | None
    scope: str
    signal: str
    sent: bool


@dataclass(frozen=True, kw_only=True)
class TrainingResumed(Event):
    NAME: ClassVar[str] = "training_resumed"
    step: int | None
    reached: int
    redone: int
    redone_s: float


@dataclass(frozen=True, kw_only=True)
class TransparentFallback(Event):
    NAME: ClassVar[str] = "transparent_fallback"
    reason: str


@dataclass(frozen=True, kw_only=True)
class TransparentOff(Event):
    NAME: ClassVar[str] = "transparent_off"
    reason: str


@dataclass(frozen=True, kw_only=True)
class TransparentOn(Event):
    NAME: ClassVar[str] = "transparent_on"
    criu: str
    version: str
    interval: Any
    dir: str


@dataclass(frozen=True, kw_only=True)
class UnmanagedDeath(Event):
    NAME: ClassVar[str] = "unmanaged_death"
    slot: int
    rank: int | None
    code: int
    restart_onto_spare: bool
    reason: str


@dataclass(frozen=True, kw_only=True)
class WaitingForNodes(Event):
    NAME: ClassVar[str] = "waiting_for_nodes"
    seconds: float
    joined: Any
    needed: int
    nodes: list[str] | None = _optional()
    missing: list[str]


@dataclass(frozen=True, kw_only=True)
class WorkerExit(Event):
    NAME: ClassVar[str] = "worker_exit"
    slot: int
    rank: int | None
    pid: int | None
    code: int
    state: str


@dataclass(frozen=True, kw_only=True)
class WorkersStarted(Event):
    NAME: ClassVar[str] = "workers_started"
    generation: int
    spare_node: bool | None = _optional()
    slots: list[Mapping[str, Any]]


# --------------------------------------------------------------------------------------------- the table
_NAMED: list[type[Event]] = [
    SwapDecided, SwapPhaseChanged, SwapBoundaryReached, SwapShardsRolledBack, SwapTransferStart, SwapTransferEnd,
    SwapTransferFailed, SwapTransferStranger, SwapSendRefused, SwapReformTimings, SwapWorldReformed, SwapResumed,
    SwapAbortedHere, SwapJoinAborted, GenerationCommitted, RankCaughtUp, RecordReplaced, StoreMoved, NodeLost,
    AgentGone, PoolNodeLeft, NodeHandedBack, HandedBackHere, HandBackRefused, CollectivesBroken, RanksRecovered, NodeRecovered,
    WorkerDied, UserError, FailureDropped,
    SpareReturned, MigrateBackRequested, MirrorBuddy, MirrorPushFailed, MirrorPushRestored,
    AddressLoopback, AgentExit, AgentStarted, EtcdConnectionLost, EtcdConnectionOverdue, EtcdConnectionRestored,
    EtcdHosted, ExceptionCause, FallbackRestart, Fenced, GenerationEnded, GenerationJoined, HangDetected, HangHeld, HealthKill,
    HealthMessage, HealthTaint, HealthUntaint, HealthVerdictNoted, LeaseLostNoted, LeaseRegranted, LinkAmbiguous, LinkDegraded,
    LinkDown, LinkHealthy, LinkSuspect, MembershipChange, MetricsServing, PlansUnauthenticated, PoolGivenBack,
    ReplicasCheckedNoted, Restart, ShardMirror, Signal, SlotQuarantined, SnapshotFailed, SnapshotMigrated, SnapshotRestored,
    SnapshotTaken, SpareLost, SpareNodeJoined, SpareReady, StepInterrupted, StoreStandby, TimerExpired, TrainingResumed,
    TransparentFallback, TransparentOff, TransparentOn, UnmanagedDeath, WaitingForNodes, WorkerExit, WorkersStarted]

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
           "HandBackRefused", "HandedBackHere", "NodeHandedBack", "PoolNodeLeft", "RankCaughtUp", "RanksRecovered",
           "RecordReplaced", "Sink", "SpareReturned",
           "StoreMoved",
           "SwapAbortedHere", "SwapBoundaryReached", "SwapDecided", "SwapJoinAborted", "SwapPhaseChanged",
           "SwapPlanSeen", "SwapReformTimings", "SwapResumed", "SwapSendRefused", "SwapShardsRolledBack",
           "SwapTransferEnd", "SwapTransferFailed", "SwapTransferStart", "SwapTransferStranger", "SwapWorldReformed",
           "UserError", "WorkerDied", "emit", "read_event",
           "AddressLoopback", "AgentExit", "AgentStarted", "EtcdConnectionLost", "EtcdConnectionOverdue",
           "EtcdConnectionRestored", "EtcdHosted", "ExceptionCause", "FallbackRestart", "Fenced", "GenerationEnded",
           "GenerationJoined", "HangDetected", "HangHeld", "HealthKill", "HealthMessage", "HealthTaint",
           "HealthUntaint", "HealthVerdictNoted", "LeaseLostNoted", "LeaseRegranted", "LinkAmbiguous", "LinkDegraded", "LinkDown",
           "LinkHealthy", "LinkSuspect", "MembershipChange", "MetricsServing", "PlansUnauthenticated", "PoolGivenBack",
           "ReplicasCheckedNoted", "Restart", "ShardMirror", "Signal", "SlotQuarantined", "SnapshotFailed",
           "SnapshotMigrated", "SnapshotRestored", "SnapshotTaken", "SpareLost", "SpareNodeJoined", "SpareReady",
           "StepInterrupted", "StoreStandby", "TimerExpired", "TrainingResumed", "TransparentFallback",
           "TransparentOff", "TransparentOn", "UnmanagedDeath", "WaitingForNodes", "WorkerExit", "WorkersStarted"]
