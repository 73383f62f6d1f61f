"""The rendezvous's data: nodes, members, generations, events, and their versioned JSON form.

Everything stored in etcd is ``{"v": 1, ...}`` JSON (never pickle), so another language, ``etcdctl get`` or
a newer tpassrun can read it. Each record is declared once, as a frozen dataclass, and written and read by the one
codec (:mod:`tpassrun.schema`): strictly, other versions refused instead of guessed, one :class:`SchemaError` (a
``ValueError``) of one line for anything malformed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar, Mapping

from tpassrun import schema
from tpassrun.schema import Port, wire

SCHEMA_VERSION = 1


class GenState(str, Enum):
    """Lifecycle of one generation record: ``forming -> active -> (forming of number+1 | closed)``."""

    FORMING = "forming"  # a restart was requested: agents re-join, the leader forms the next active one
    ACTIVE = "active"  # members run workers
    CLOSED = "closed"  # the run is over; nothing forms again


class EventKind(str, Enum):
    GENERATION_CHANGED = "generation_changed"
    NODE_LOST = "node_lost"
    NODE_WAITING = "node_waiting"
    SPARE_NODE_JOINED = "spare_node_joined"
    CLOSED = "closed"
    LEADER_CHANGED = "leader_changed"
    CONNECTION_LOST = "connection_lost"
    CONNECTION_RESTORED = "connection_restored"


@dataclass(frozen=True)
class NodeInfo(schema.Record):
    """What an agent says about itself when it registers (``nodes/<node_id>``)."""

    node_id: str
    addr: str
    nproc: int
    spares: int = 0  # warm spare worker slots on this node
    spare_node: bool = False  # --spare-node: never a member at formation, only a spare node
    pid: int = field(default_factory=os.getpid, metadata=wire(missing=0))
    role: str = "default"  # --role: ROLE_RANK/ROLE_WORLD_SIZE count the workers of the same role
    mirror_port: int = 0  # the agent's mirror store listens here, on ``addr`` (0: none)

    SCHEMA: ClassVar[schema.Schema] = schema.Schema("node record", version=SCHEMA_VERSION)


@dataclass(frozen=True)
class Member(schema.Record):
    """A node's place in a generation. Global ranks of its workers are ``rank_offset .. rank_offset+nproc-1``."""

    node_id: str
    group_rank: int
    addr: str
    nproc: int
    rank_offset: int
    spares: int = 0
    role: str = "default"

    SCHEMA: ClassVar[schema.Schema] = schema.Schema("member")


@dataclass(frozen=True)
class Generation(schema.Record):
    """One version of the run's membership (etcd key ``generation``).

    The record is rewritten in place (same ``number``) when the leader notes a lost node, a waiting node
    or a new spare node; ``number`` changes when the membership itself changes (restart, swap).
    ``revision`` is the etcd mod_revision this copy was read at: the fencing token for compare-and-set.
    It is not part of the value (ignored by ``==``).
    """

    number: int
    state: GenState
    members: tuple[Member, ...] = ()
    spare_nodes: tuple[str, ...] = ()
    world_size: int = 0
    reason: str = ""
    swap_id: str | None = None
    assignments: Mapping[str, Any] = field(default_factory=dict)
    bootstrap: tuple[str, int] | None = None
    waiting: tuple[str, ...] = ()  # registered nodes that would fit as members (torchrun: num_nodes_waiting)
    lost: tuple[str, ...] = ()  # members/spare nodes whose lease expired during this generation
    # the number of the generation the run's workers were last started in (formed by the rendezvous: a restart);
    # swaps' commits and the leader's annotations keep it, so every agent, a spare node that joined later too,
    # knows the same "since the last whole-group restart"
    formed: int = field(default=0, metadata=wire(missing_from="number"))   # a record written without it: its number
    revision: int = field(default=0, compare=False, metadata=wire(skip=True))

    SCHEMA: ClassVar[schema.Schema] = schema.Schema("generation record", version=SCHEMA_VERSION)

    def member(self, node_id: str) -> Member | None:
        for m in self.members:
            if m.node_id == node_id:
                return m
        return None

    def includes(self, node_id: str) -> bool:
        """True if the node has a place here: a member or a spare node (and not marked lost)."""
        if node_id in self.lost:
            return False
        return self.member(node_id) is not None or node_id in self.spare_nodes

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self.members)

    def homes(self) -> dict[int, tuple[str, int]]:
        """rank -> (node, slot) where this generation places each rank: its member's range, moved by the swaps
        committed into it (``assignments``: ``{"<rank>": {"node": ..., "slot": ...}}``)."""
        out: dict[int, tuple[str, int]] = {}
        for m in self.members:
            for i in range(m.nproc):
                out[m.rank_offset + i] = (m.node_id, i)
        for rank, where in (self.assignments or {}).items():
            if isinstance(where, Mapping) and str(rank).isdigit() and isinstance(where.get("node"), str):
                slot = where.get("slot")
                out[int(rank)] = (where["node"], slot if isinstance(slot, int) and slot >= 0 else 0)
        return out

    def placed(self, node_id: str) -> tuple[int, ...]:
        """The ranks this generation places on ``node_id`` (a member whose ranks swaps all moved has none)."""
        return tuple(sorted(r for r, (n, _s) in self.homes().items() if n == node_id))

    @classmethod
    def from_json(cls, doc: Any, revision: int = 0) -> "Generation":
        gen = schema.load(cls, doc)
        return gen if revision == 0 else gen.with_revision(revision)

    def with_revision(self, revision: int) -> "Generation":
        return replace(self, revision=revision)


@dataclass(frozen=True)
class Closed(schema.Record):
    """``closed``: the run is over (written once, by the agent that closes it)."""

    reason: str = field(metadata=wire(missing=""))
    node_id: str | None = None
    time: float = 0.0

    SCHEMA: ClassVar[schema.Schema] = schema.Schema("closed record", version=SCHEMA_VERSION)


@dataclass(frozen=True)
class Leader(schema.Record):
    """``leader`` (under the leader's lease): who decides the run's generations."""

    node_id: str
    addr: str
    pid: int

    SCHEMA: ClassVar[schema.Schema] = schema.Schema("leader record", version=SCHEMA_VERSION)


@dataclass(frozen=True)
class Bootstrap(schema.Record):
    """``bootstrap/<number>``: where generation ``number``'s workers meet (group rank 0's store)."""

    number: int
    addr: str
    port: Port

    SCHEMA: ClassVar[schema.Schema] = schema.Schema("bootstrap address", version=SCHEMA_VERSION)


@dataclass(frozen=True)
class RdzvEvent:
    """Something the agent reacts to while its workers run (see ``EtcdRendezvous.events``)."""

    kind: EventKind
    generation: Generation | None = None
    node_id: str | None = None
    reason: str = ""

