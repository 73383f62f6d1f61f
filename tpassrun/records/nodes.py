"""What each node publishes about itself, and the run's end: ``status/`` (the worker table), ``health/`` (the
monitor's snapshot), ``closed``, and the rendezvous's ``nodes/``, ``leader`` and ``generation`` records read
strictly; the rendezvous's records sealed with the run key (:func:`rendezvous_guard`).
"""

from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, Mapping

from tpassrun import schema
from tpassrun.records import provenance
from tpassrun.records.fields import RecordError, record, sealed
from tpassrun.rendezvous import Closed, Generation, NodeInfo, RecordGuard
from tpassrun.schema import NonNegative, wire


# ---------------------------------------------------------------------------------------------- status
@dataclass(frozen=True)
class WorkerRow(schema.Record):
    """One worker slot in ``status/<node>``: ``WorkerRow(slot, state, ...)``, the rest by keyword (the fields are
    declared in the order of their JSON keys)."""

    slot: NonNegative
    rank: NonNegative | None = field(default=None, kw_only=True)
    local_rank: int | None = field(default=None, kw_only=True)
    pid: int | None = field(default=None, kw_only=True)
    state: str                  # a SlotState value: running | spare | quarantined | dead | done | leaving | idle
    _: KW_ONLY
    step: int = 0
    managed: bool = False       # the worker said hello (it runs tpassrun.init())
    spare: bool = False
    last_step_ms: float = 0.0
    quarantine_reason: str | None = None
    replicas: tuple[NonNegative, ...] | None = None   # the ranks holding this rank's state, as its adapter declared
                                                      # them (None: every rank, plain data parallelism)
    total: NonNegative = field(default=0, metadata=wire(omit_default=True))   # the total_steps its sess.run() was
                                                                              # given (0: not known)
    # it tracks sharded state (sess.track_sharded), said from the call on, before its first copy: the planner counts
    # it as such (tpassrun/plan/swap.py SlotView.sharded) when its node is lost inside step 0
    sharded: bool = field(default=False, metadata=wire(omit_default=True))
    # sharded state (tpassrun/worker/shards.py), written only while it holds some: host bytes of its local copies,
    # bytes of one refresh of its mirror, the newest step its buddy's mirror holds (None: none yet), bytes pushed in all
    shard_held: NonNegative = field(default=0, metadata=wire(omit_default=True))
    shard_bytes: NonNegative = field(default=0, metadata=wire(written_with="shard_held"))
    shard_mirrored: int | None = field(default=None, metadata=wire(written_with="shard_held"))
    shard_sent: NonNegative = field(default=0, metadata=wire(written_with="shard_held"))
    # refreshes every K steps (0: not fixed yet: --shard-mirror-interval auto measures)
    shard_interval: NonNegative = field(default=0, metadata=wire(written_with="shard_held"))

    SCHEMA: ClassVar[schema.Schema] = record("status worker row", versioned=False)


@dataclass(frozen=True)
class NodeStatus(schema.Record):
    """``status/<node>`` (under the agent's lease): the node's worker table, for the coordinator and tpassctl.
    ``NodeStatus(node_id, workers, ...)``, the rest by keyword (declared in the order of the JSON keys)."""

    node_id: str
    addr: str = field(default="", kw_only=True)
    pid: int = field(default=0, kw_only=True)
    generation: int | None = field(default=None, kw_only=True)
    restart_count: int = field(default=0, kw_only=True)
    workers: tuple[WorkerRow, ...] = field(metadata=wire(missing=()))
    _: KW_ONLY
    time: float = 0.0
    # host bytes this agent's mirror store holds for other nodes' ranks (tpassrun/mirror/__init__.py)
    mirror_held: NonNegative = field(default=0, metadata=wire(omit_default=True))

    SCHEMA: ClassVar[schema.Schema] = record("node status")


# ---------------------------------------------------------------------------------------------- health
@dataclass(frozen=True)
class HealthRecord(schema.Record):
    """``health/<node>`` (under the agent's lease): the monitor's snapshot (readings, verdicts) for display."""

    node_id: str = field(metadata=wire(missing=""))
    time: float = 0.0
    taints: tuple[str, ...] = ()
    polls: int = 0
    unavailable: Mapping[str, str] = field(default_factory=dict)
    readings: tuple[Mapping[str, Any], ...] = ()
    verdicts: tuple[Mapping[str, Any], ...] = ()

    SCHEMA: ClassVar[schema.Schema] = record("health record")


# ---------------------------------------------------------------------------------------------- run
@dataclass(frozen=True)
class RunClosed(Closed):
    """``closed`` (:class:`~tpassrun.rendezvous.state.Closed`, written by the rendezvous when the run ends), as
    tpassctl reads it: a sealed record, refused as a :class:`RecordError`."""

    SEALED: ClassVar[bool] = True      # written by the rendezvous with the run key's MAC (rendezvous_guard)
    SCHEMA: ClassVar[schema.Schema] = record("closed record")


@dataclass(frozen=True)
class MirrorKey(schema.Record):
    """``mirror_key`` (created once by the first agent): the run's key for the in-memory mirrors, hex."""

    key: str

    SCHEMA: ClassVar[schema.Schema] = record("mirror key")

    def __repr__(self) -> str:   # never print the key
        return "MirrorKey(...)"


@sealed
def node_info(doc: Any) -> NodeInfo:
    """``nodes/<node_id>`` (the rendezvous's registration record), with :class:`RecordError` for a bad one. Sealed:
    the address a joiner's state is streamed to, and a mirror's, come from it."""
    try:
        return NodeInfo.from_json(doc)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise RecordError(f"node record: {exc}") from exc


@sealed
def leader_of(doc: Any) -> str:
    """The node id in ``leader`` (written by the rendezvous under the leader's lease)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("node_id"), str):
        raise RecordError(f"leader record: no node_id in {doc!r}")
    return str(doc["node_id"])


@sealed
def generation_record(doc: Any) -> Generation:
    """``generation`` (the rendezvous's record of the run's membership), at revision 0 (``with_revision``)."""
    try:
        return Generation.from_json(doc)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise RecordError(f"generation record: {exc}") from exc


# ---------------------------------------------------------------------------------------------- the seal
def rendezvous_guard(run_key: "provenance.RunKey | None") -> RecordGuard:
    """What the rendezvous seals its records with and checks them by (``generation``, ``bootstrap/``, ``nodes/``,
    ``leader``, ``closed``): the run key's MAC, as plans and reports carry it. Without a key nothing is sealed or
    refused, as before; such an agent only notices records sealed by agents that have one, so that it stops at
    once instead of waiting for a join it can never be part of."""
    if run_key is None:
        return RecordGuard(foreign=_sealed_while_keyless)
    return RecordGuard(seal=functools.partial(_seal, run_key), problem=functools.partial(_problem, run_key),
                       foreign=functools.partial(_foreign, run_key))


def _seal(run_key: "provenance.RunKey", etcd_key: str, doc: dict[str, Any]) -> dict[str, Any]:
    return provenance.seal(etcd_key, doc, run_key)


def _problem(run_key: "provenance.RunKey", etcd_key: str, doc: Any) -> str | None:
    return provenance.problem(etcd_key, doc, run_key)


def _foreign(run_key: "provenance.RunKey", etcd_key: str, doc: Any) -> str | None:
    return "was sealed with another run key" if provenance.sealed_with_another_key(etcd_key, doc, run_key) else None


def _sealed_while_keyless(_etcd_key: str, doc: Any) -> str | None:
    return "was sealed with a run key, and this agent was given none" if provenance.carries_mac(doc) else None
