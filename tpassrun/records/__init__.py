"""Every control-plane record tpassrun keeps in etcd, as a small frozen type, and the one key layout.

The rendezvous keeps its own records (``nodes/``, ``generation``, ``leader``, ``closed``, ``bootstrap/``) in
:mod:`tpassrun.rendezvous.state`; the swap control plane's are here: taints, worker failures, swap plans and
the agents' reports on them, the agents' status and health tables, fallback requests. Every writer and reader
(agent, swapper, health daemon, tpassctl) goes through these types and :class:`Keys`, never through a raw
dict or a string concatenation.

Values are ``{"v": 1, ...}`` JSON (never pickle). ``from_json`` validates strictly and raises one error,
:class:`RecordError`; readers use :func:`load`, which turns a malformed value into ``None`` and logs it once
per (key, revision): a bad value in etcd is skipped, never fatal, never a traceback per tick.

This module is the one import for all of it: the key layout is here, the record types live by family in
``faults`` (taints, failures, fallbacks), ``nodes`` (status, health, closed, nodes, leader) and
``swaps`` (plans, reports), on top of ``fields`` (schema version, ``RecordError``, ``load``) and
the one codec (:mod:`tpassrun.schema`: each record type declared once, as a frozen dataclass).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpassrun.health import TaintEffect
from tpassrun.records.events import (
    EVENTS,
    AddressLoopback,
    AgentExit,
    AgentGone,
    AgentStarted,
    CollectivesBroken,
    EtcdConnectionLost,
    EtcdConnectionOverdue,
    EtcdConnectionRestored,
    EtcdHosted,
    Event,
    ExceptionCause,
    FailureDropped,
    FallbackRestart,
    Fenced,
    GenerationCommitted,
    GenerationEnded,
    GenerationJoined,
    HandBackRefused,
    HandedBackHere,
    HangDetected,
    HangHeld,
    HealthKill,
    HealthMessage,
    HealthTaint,
    HealthUntaint,
    HealthVerdictNoted,
    LeaseLostNoted,
    LeaseRegranted,
    LinkAmbiguous,
    LinkDegraded,
    LinkDown,
    LinkHealthy,
    LinkSuspect,
    MembershipChange,
    MetricsServing,
    MigrateBackRequested,
    MirrorBuddy,
    MirrorPushFailed,
    MirrorPushRestored,
    NodeHandedBack,
    NodeLost,
    NodeRecovered,
    PlansUnauthenticated,
    PoolGivenBack,
    PoolNodeLeft,
    RankCaughtUp,
    RanksRecovered,
    RecordReplaced,
    ReplicasCheckedNoted,
    Restart,
    ShardMirror,
    Signal,
    SlotQuarantined,
    SnapshotFailed,
    SnapshotMigrated,
    SnapshotRestored,
    SnapshotTaken,
    SpareLost,
    SpareNodeJoined,
    SpareReady,
    SpareReturned,
    StepInterrupted,
    StoreMoved,
    StoreStandby,
    SwapAbortedHere,
    SwapBoundaryReached,
    SwapDecided,
    SwapJoinAborted,
    SwapPhaseChanged,
    SwapPlanSeen,
    SwapReformTimings,
    SwapResumed,
    SwapSendRefused,
    SwapShardsRolledBack,
    SwapTransferEnd,
    SwapTransferFailed,
    SwapTransferStart,
    SwapTransferStranger,
    SwapWorldReformed,
    TimerExpired,
    TrainingResumed,
    TransparentFallback,
    TransparentOff,
    TransparentOn,
    UnmanagedDeath,
    UserError,
    WaitingForNodes,
    WorkerDied,
    WorkerExit,
    WorkersStarted,
    emit,
    read_event,
)
from tpassrun.records.faults import (
    HANDLED_COALESCED,
    HANDLED_KILLED,
    HANDLED_RESTART,
    Failure,
    Fallback,
    HandBack,
    Taint,
    TaintSource,
)
from tpassrun.records.fields import SCHEMA_VERSION, RecordError, load
from tpassrun.records.nodes import (
    HealthRecord,
    MirrorKey,
    NodeStatus,
    RunClosed,
    WorkerRow,
    generation_record,
    leader_of,
    node_info,
    rendezvous_guard,
)
from tpassrun.records.provenance import (
    RUN_KEY_ENV,
    RUN_KEY_FILE_CONF,
    RunKey,
    RunKeyError,
    carries_mac,
    env_without_key,
    key_for,
    register,
    run_key_from,
    seal,
)
from tpassrun.records.swaps import TERMINAL, TRANSITIONS, Move, Phase, Report, SlotRef, SwapKind, SwapPlan

if TYPE_CHECKING:
    from tpassrun.records.pool import (
        IDLE,
        MEMBER,
        POOL_KEY_CONF,
        SERVING,
        SPARE,
        Claim,
        HistoryEntry,
        JobSpec,
        PoolInfo,
        PoolKeys,
        PoolNode,
        PreemptRequest,
        box,
        load_sealed,
        pool_prefix,
        pool_seal,
        unbox,
    )

# the spare pool's records (sealed with the pool key, run keys boxed with AES-GCM), imported on first use: only the
# pool's users pay for `cryptography`'s AEAD
_LAZY = dict.fromkeys(("IDLE", "MEMBER", "POOL_KEY_CONF", "SERVING", "SPARE", "Claim", "HistoryEntry", "JobSpec", "PoolInfo",
                       "PoolKeys", "PoolNode", "PreemptRequest", "box", "load_sealed", "pool_prefix", "pool_seal", "unbox"),
                      "tpassrun.records.pool")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# ---------------------------------------------------------------------------------------------- key layout
@dataclass(frozen=True)
class Keys:
    """Every key of one run, under ``prefix`` (the rendezvous's ``run_prefix``, ending in ``/``).

    The rendezvous builds its own keys (``nodes/``, ``generation``, ``leader``, ``closed``, ``bootstrap/``);
    they are named here too so that one object documents the whole layout (``docs/DESIGN.md``'s table is
    checked against :data:`FAMILIES`).
    """

    prefix: str

    # family -> the key pattern (relative to the prefix) as docs/DESIGN.md writes it
    FAMILIES = {
        "nodes": "nodes/<node_id>",
        "generation": "generation",
        "leader": "leader",
        "closed": "closed",
        "bootstrap": "bootstrap/<generation>",
        "taints": "taints/<taint_id>",
        "failures": "failures/<node_id>-<slot>",
        "swaps": "swaps/<swap_id>",
        "reports": "reports/<swap_id>/<seq>/<node_id>",
        "status": "status/<node_id>",
        "health": "health/<node_id>",
        "fallbacks": "fallbacks/<node_id>",
        "handbacks": "handbacks/<node_id>",
        "mirror_key": "mirror_key",
    }

    def _join(self, *parts: object) -> str:
        for p in parts:
            text = str(p)
            if not text or "/" in text:
                raise ValueError(f"{text!r} cannot be one part of an etcd key")
        return self.prefix + "/".join(str(p) for p in parts)

    def family(self, name: str) -> str:
        """The prefix of every key of one family, ending in ``/`` (for reads and watches)."""
        if name not in self.FAMILIES or "/" not in self.FAMILIES[name]:
            raise ValueError(f"{name!r} is not a key family")
        return self.prefix + name + "/"

    def relative(self, key: str) -> str:
        return key[len(self.prefix):] if key.startswith(self.prefix) else key

    def last(self, key: str) -> str:
        return key.rsplit("/", 1)[-1]

    def node(self, node_id: str) -> str:
        return self._join("nodes", node_id)

    @property
    def closed(self) -> str:
        return self.prefix + "closed"

    def taint(self, taint_id: str) -> str:
        return self._join("taints", taint_id)

    def failure(self, node_id: str, slot: int) -> str:
        return self._join("failures", f"{node_id}-{slot}")

    def failure_by_id(self, failure_id: str) -> str:
        return self._join("failures", failure_id)

    def swap(self, swap_id: str) -> str:
        return self._join("swaps", swap_id)

    def reports(self, swap_id: str, seq: int) -> str:
        return self._join("reports", swap_id, seq) + "/"

    def report(self, swap_id: str, seq: int, node_id: str) -> str:
        return self._join("reports", swap_id, seq, node_id)

    def status(self, node_id: str) -> str:
        return self._join("status", node_id)

    def health(self, node_id: str) -> str:
        return self._join("health", node_id)

    def fallback(self, node_id: str) -> str:
        return self._join("fallbacks", node_id)

    def handback(self, node_id: str) -> str:
        return self._join("handbacks", node_id)

    @property
    def mirror_key(self) -> str:
        return self.prefix + "mirror_key"


__all__ = ["Move", "Failure", "Fallback", "HANDLED_COALESCED", "HANDLED_KILLED", "HANDLED_RESTART", "HandBack", "HealthRecord",
           "Keys", "MirrorKey", "NodeStatus",
           "Phase", "RecordError", "Report", "RunClosed", "generation_record", "leader_of", "node_info",
           "rendezvous_guard", "SCHEMA_VERSION", "SlotRef", "SwapKind", "SwapPlan", "TERMINAL",
           "TRANSITIONS", "Taint", "TaintEffect", "TaintSource", "WorkerRow", "load",
           # the event log's events (tpassrun.records.events)
           "EVENTS", "AddressLoopback", "AgentExit", "AgentGone", "AgentStarted", "CollectivesBroken",
           "EtcdConnectionLost", "EtcdConnectionOverdue", "EtcdConnectionRestored", "EtcdHosted", "Event",
           "ExceptionCause", "FailureDropped", "FallbackRestart", "Fenced", "GenerationCommitted", "GenerationEnded",
           "GenerationJoined", "HangDetected", "HangHeld", "HealthKill", "HealthMessage", "HealthTaint",
           "HealthUntaint", "HealthVerdictNoted", "LeaseLostNoted", "LeaseRegranted", "LinkAmbiguous", "LinkDegraded",
           "LinkDown", "LinkHealthy", "LinkSuspect", "MembershipChange", "MetricsServing", "MigrateBackRequested",
           "MirrorBuddy", "MirrorPushFailed", "MirrorPushRestored", "HandBackRefused", "HandedBackHere", "NodeHandedBack",
           "NodeLost", "NodeRecovered",
           "PlansUnauthenticated", "PoolGivenBack", "PoolNodeLeft", "RankCaughtUp", "RanksRecovered", "RecordReplaced",
           "ReplicasCheckedNoted", "Restart", "ShardMirror", "Signal", "SlotQuarantined", "SnapshotFailed",
           "SnapshotMigrated", "SnapshotRestored", "SnapshotTaken", "SpareLost", "SpareNodeJoined", "SpareReady",
           "SpareReturned", "StepInterrupted", "StoreMoved", "StoreStandby", "SwapAbortedHere", "SwapBoundaryReached",
           "SwapDecided", "SwapJoinAborted", "SwapPhaseChanged", "SwapPlanSeen", "SwapReformTimings", "SwapResumed",
           "SwapSendRefused", "SwapShardsRolledBack", "SwapTransferEnd", "SwapTransferFailed", "SwapTransferStart",
           "SwapTransferStranger", "SwapWorldReformed", "TimerExpired", "TrainingResumed", "TransparentFallback",
           "TransparentOff", "TransparentOn", "UnmanagedDeath", "UserError", "WaitingForNodes", "WorkerDied",
           "WorkerExit", "WorkersStarted", "emit", "read_event",
           # the run key and its seal (tpassrun.records.provenance)
           "RUN_KEY_ENV", "RUN_KEY_FILE_CONF", "RunKey", "RunKeyError", "carries_mac", "env_without_key", "key_for",
           "register", "run_key_from", "seal",
           # the spare pool's records (tpassrun.records.pool)
           "IDLE", "MEMBER", "POOL_KEY_CONF", "SERVING", "SPARE", "Claim", "HistoryEntry", "JobSpec", "PoolInfo", "PoolKeys",
           "PoolNode", "PreemptRequest", "box", "load_sealed", "pool_prefix", "pool_seal", "unbox"]
