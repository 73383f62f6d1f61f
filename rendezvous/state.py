"""The rendezvous's data: nodes, members, generations, events, and their versioned JSON form.

Everything stored in etcd is ``{"v": 1, ...}`` JSON (never pickle), so another language, ``etcdctl get`` or
a newer tpassrun can read it. Decoders reject other versions instead of guessing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Mapping

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
class NodeInfo:
    """What an agent says about itself when it registers (``nodes/<node_id>``)."""

    node_id: str
    addr: str
    nproc: int
    spares: int = 0  # warm spare worker slots on this node
    spare_node: bool = False  # --spare-node: never a member at formation, only a spare node
    pid: int = field(default_factory=os.getpid)
    role: str = "default"  # --role: ROLE_RANK/ROLE_WORLD_SIZE count the workers of the same role
    mirror_port: int = 0  # the agent's mirror store listens here, on ``addr`` (0: none)

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node_id": self.node_id, "addr": self.addr, "nproc": self.nproc,
                "spares": self.spares, "spare_node": self.spare_node, "pid": self.pid, "role": self.role,
                "mirror_port": self.mirror_port}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "NodeInfo":
        _check_version(doc, "node record")
        return cls(node_id=str(doc["node_id"]), addr=str(doc["addr"]), nproc=int(doc["nproc"]),
                   spares=int(doc.get("spares", 0)), spare_node=bool(doc.get("spare_node", False)),
                   pid=int(doc.get("pid", 0)), role=str(doc.get("role", "default")),
                   mirror_port=int(doc.get("mirror_port", 0)))


@dataclass(frozen=True)
class Member:
    """A node's place in a generation. Global ranks of its workers are ``rank_offset .. rank_offset+nproc-1``."""

    node_id: str
    group_rank: int
    addr: str
    nproc: int
    rank_offset: int
    spares: int = 0
    role: str = "default"

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "group_rank": self.group_rank, "addr": self.addr,
                "nproc": self.nproc, "rank_offset": self.rank_offset, "spares": self.spares, "role": self.role}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "Member":
        return cls(node_id=str(doc["node_id"]), group_rank=int(doc["group_rank"]), addr=str(doc["addr"]),
                   nproc=int(doc["nproc"]), rank_offset=int(doc["rank_offset"]), spares=int(doc.get("spares", 0)),
                   role=str(doc.get("role", "default")))


@dataclass(frozen=True)
class Generation:
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
    formed: int = 0
    revision: int = field(default=0, compare=False)

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

    def to_json(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION,
            "number": self.number,
            "state": self.state.value,
            "members": [m.to_json() for m in self.members],
            "spare_nodes": list(self.spare_nodes),
            "world_size": self.world_size,
            "reason": self.reason,
            "swap_id": self.swap_id,
            "assignments": dict(self.assignments),
            "bootstrap": list(self.bootstrap) if self.bootstrap else None,
            "waiting": list(self.waiting),
            "lost": list(self.lost),
            "formed": self.formed,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], revision: int = 0) -> "Generation":
        _check_version(doc, "generation record")
        boot = doc.get("bootstrap")
        return cls(
            number=int(doc["number"]),
            state=GenState(doc["state"]),
            members=tuple(Member.from_json(m) for m in doc.get("members", ())),
            spare_nodes=tuple(str(n) for n in doc.get("spare_nodes", ())),
            world_size=int(doc.get("world_size", 0)),
            reason=str(doc.get("reason", "")),
            swap_id=doc.get("swap_id"),
            assignments=dict(doc.get("assignments") or {}),
            bootstrap=(str(boot[0]), int(boot[1])) if boot else None,
            waiting=tuple(str(n) for n in doc.get("waiting", ())),
            lost=tuple(str(n) for n in doc.get("lost", ())),
            formed=int(doc.get("formed", doc["number"])),
            revision=revision,
        )

    def with_revision(self, revision: int) -> "Generation":
        return replace(self, revision=revision)


@dataclass(frozen=True)
class RdzvEvent:
    """Something the agent reacts to while its workers run (see ``EtcdRendezvous.events``)."""

    kind: EventKind
    generation: Generation | None = None
    node_id: str | None = None
    reason: str = ""


def _check_version(doc: Mapping[str, Any], what: str) -> None:
    if doc.get("v") != SCHEMA_VERSION:
        raise ValueError(f"{what} has schema version {doc.get('v')!r}; this tpassrun reads v{SCHEMA_VERSION}")
