"""What each node publishes about itself, and the run's end: ``status/`` (the worker table), ``health/`` (the
monitor's snapshot), ``closed``, and the rendezvous's ``nodes/``, ``leader`` and ``generation`` records read
strictly; the rendezvous's records sealed with the run key (:func:`rendezvous_guard`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from tpassrun.records import provenance
from tpassrun.records.fields import (SCHEMA_VERSION, RecordError, _bool, _check, _int, _list, _num, _opt_int,
                                     _opt_ranks, _opt_str,
                             _str, sealed)
from tpassrun.rendezvous.guard import RecordGuard
from tpassrun.rendezvous.state import Generation, NodeInfo


# ---------------------------------------------------------------------------------------------- status
@dataclass(frozen=True)
class WorkerRow:
    """One worker slot in ``status/<node>``."""

    slot: int
    state: str                  # a SlotState value: running | spare | quarantined | dead | done | leaving | idle
    rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    step: int = 0
    managed: bool = False       # the worker said hello (it runs tpassrun.init())
    spare: bool = False
    last_step_ms: float = 0.0
    total: int = 0              # the total_steps its sess.run() was given (0: not known)
    quarantine_reason: str | None = None
    replicas: tuple[int, ...] | None = None   # the ranks holding this rank's state, as its adapter declared them
                                              # (None: every rank, plain data parallelism)
    # sharded state (tpassrun/worker/shards.py): host bytes of its local copies, bytes of one refresh of its mirror,
    # the newest step its buddy's mirror holds (None: none yet), bytes pushed in all
    shard_held: int = 0
    shard_bytes: int = 0
    shard_mirrored: int | None = None
    shard_sent: int = 0
    shard_interval: int = 0     # refreshes every K steps (0: not fixed yet: --shard-mirror-interval auto measures)

    def to_json(self) -> dict[str, Any]:
        doc = {"slot": self.slot, "rank": self.rank, "local_rank": self.local_rank, "pid": self.pid,
               "state": self.state, "step": self.step, "managed": self.managed, "spare": self.spare,
               "last_step_ms": self.last_step_ms, "quarantine_reason": self.quarantine_reason,
               "replicas": None if self.replicas is None else list(self.replicas)}
        if self.total:
            doc["total"] = self.total
        if self.shard_held:
            doc.update(shard_held=self.shard_held, shard_bytes=self.shard_bytes, shard_mirrored=self.shard_mirrored,
                       shard_sent=self.shard_sent, shard_interval=self.shard_interval)
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> "WorkerRow":
        what = "status worker row"
        if not isinstance(doc, Mapping):
            raise RecordError(f"{what}: not a JSON object")
        return cls(slot=_int(doc, "slot", what, minimum=0), state=_str(doc, "state", what),
                   rank=_opt_int(doc, "rank", what, minimum=0), local_rank=_opt_int(doc, "local_rank", what),
                   pid=_opt_int(doc, "pid", what), step=_int(doc, "step", what, 0),
                   managed=_bool(doc, "managed", what), spare=_bool(doc, "spare", what),
                   last_step_ms=_num(doc, "last_step_ms", what), total=_int(doc, "total", what, 0, minimum=0),
                   quarantine_reason=_opt_str(doc, "quarantine_reason", what),
                   replicas=_opt_ranks(doc, "replicas", what),
                   shard_held=_int(doc, "shard_held", what, 0, minimum=0),
                   shard_bytes=_int(doc, "shard_bytes", what, 0, minimum=0),
                   shard_mirrored=_opt_int(doc, "shard_mirrored", what),
                   shard_sent=_int(doc, "shard_sent", what, 0, minimum=0),
                   shard_interval=_int(doc, "shard_interval", what, 0, minimum=0))


@dataclass(frozen=True)
class NodeStatus:
    """``status/<node>`` (under the agent's lease): the node's worker table, for the coordinator and tpassctl."""

    node_id: str
    workers: tuple[WorkerRow, ...]
    addr: str = ""
    pid: int = 0
    generation: int | None = None
    restart_count: int = 0
    time: float = 0.0
    mirror_held: int = 0        # host bytes this agent's mirror store holds for other nodes' ranks (tpassrun/mirror/__init__.py)

    def to_json(self) -> dict[str, Any]:
        doc = {"v": SCHEMA_VERSION, "node_id": self.node_id, "addr": self.addr, "pid": self.pid,
               "generation": self.generation, "restart_count": self.restart_count,
               "workers": [w.to_json() for w in self.workers], "time": self.time}
        if self.mirror_held:
            doc["mirror_held"] = self.mirror_held
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> "NodeStatus":
        what = "node status"
        d = _check(doc, what)
        return cls(node_id=_str(d, "node_id", what), addr=_str(d, "addr", what, ""), pid=_int(d, "pid", what, 0),
                   generation=_opt_int(d, "generation", what), restart_count=_int(d, "restart_count", what, 0),
                   workers=tuple(WorkerRow.from_json(w) for w in _list(d, "workers", what)),
                   time=_num(d, "time", what), mirror_held=_int(d, "mirror_held", what, 0, minimum=0))


# ---------------------------------------------------------------------------------------------- health
@dataclass(frozen=True)
class HealthRecord:
    """``health/<node>`` (under the agent's lease): the monitor's snapshot (readings, verdicts) for display."""

    node_id: str
    time: float = 0.0
    taints: tuple[str, ...] = ()
    polls: int = 0
    unavailable: Mapping[str, str] = field(default_factory=dict)
    readings: tuple[Mapping[str, Any], ...] = ()
    verdicts: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node_id": self.node_id, "time": self.time, "taints": list(self.taints),
                "polls": self.polls, "unavailable": dict(self.unavailable),
                "readings": [dict(r) for r in self.readings], "verdicts": [dict(v) for v in self.verdicts]}

    @classmethod
    def from_json(cls, doc: Any) -> "HealthRecord":
        what = "health record"
        d = _check(doc, what)
        unavailable = d.get("unavailable") or {}
        rows = {k: _list(d, k, what) for k in ("readings", "verdicts", "taints")}
        if not isinstance(unavailable, Mapping) or not all(isinstance(r, Mapping) for r in
                                                           rows["readings"] + rows["verdicts"]):
            raise RecordError(f"{what}: readings, verdicts and unavailable must be JSON objects")
        return cls(node_id=_str(d, "node_id", what, ""), time=_num(d, "time", what),
                   taints=tuple(str(t) for t in rows["taints"]), polls=_int(d, "polls", what, 0),
                   unavailable=dict(unavailable), readings=tuple(rows["readings"]), verdicts=tuple(rows["verdicts"]))


# ---------------------------------------------------------------------------------------------- run
@dataclass(frozen=True)
class RunClosed:
    """``closed`` (written by the rendezvous when the run ends), as tpassctl reads it."""

    reason: str
    node_id: str | None = None
    time: float = 0.0
    SEALED: ClassVar[bool] = True      # written by the rendezvous with the run key's MAC (rendezvous_guard)

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "reason": self.reason, "node_id": self.node_id, "time": self.time}

    @classmethod
    def from_json(cls, doc: Any) -> "RunClosed":
        what = "closed record"
        d = _check(doc, what)
        return cls(reason=_str(d, "reason", what, ""), node_id=_opt_str(d, "node_id", what), time=_num(d, "time", what))


@dataclass(frozen=True)
class MirrorKey:
    """``mirror_key`` (created once by the first agent): the run's key for the in-memory mirrors, hex."""

    key: str

    def __repr__(self) -> str:   # never print the key
        return "MirrorKey(...)"

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "key": self.key}

    @classmethod
    def from_json(cls, doc: Any) -> "MirrorKey":
        what = "mirror key"
        d = _check(doc, what)
        return cls(key=_str(d, "key", what))


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
