"""The swap records: ``swaps/<id>`` (a :class:`SwapPlan`, advanced phase by phase along :data:`TRANSITIONS`) and
``reports/<id>/<seq>/<node>`` (each agent's :class:`Report` on one phase).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from tpassrun.records.provenance import RunKey
from tpassrun.records.fields import (SCHEMA_VERSION, RecordError, _addr, _bool, _check, _enum, _int, _list, _opt_int,
                             _opt_str, _str)


# ---------------------------------------------------------------------------------------------- swaps
class Phase(str, enum.Enum):
    PAUSE = "pause"
    BOUNDARY = "boundary"
    TRANSFER = "transfer"
    SEND = "send"
    REFORM = "reform"
    DONE = "done"
    ABORTED = "aborted"


# The one table of a swap plan's allowed transitions (the planner, tpassrun.plan.swap, decides which to take).
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.PAUSE: frozenset({Phase.BOUNDARY, Phase.TRANSFER, Phase.ABORTED}),
    Phase.BOUNDARY: frozenset({Phase.BOUNDARY, Phase.TRANSFER, Phase.ABORTED}),
    Phase.TRANSFER: frozenset({Phase.SEND, Phase.TRANSFER, Phase.ABORTED}),
    Phase.SEND: frozenset({Phase.SEND, Phase.TRANSFER, Phase.REFORM, Phase.ABORTED}),
    Phase.REFORM: frozenset({Phase.DONE, Phase.ABORTED}),
    Phase.DONE: frozenset(),
    Phase.ABORTED: frozenset(),
}
TERMINAL = frozenset({Phase.DONE, Phase.ABORTED})


class SwapKind(str, enum.Enum):
    PLANNED = "planned"        # a taint: the leaver is alive and hands over its own state
    UNPLANNED = "unplanned"    # the rank died: a donor replica sends model/optimizer, the agent the light state
    NODE = "node"              # a whole node was lost: all its ranks at once, model/optimizer from donors on
                               # other nodes, the light state from the mirror of the node's buddy


@dataclass(frozen=True)
class SlotRef:
    node: str
    slot: int
    rank: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "slot": self.slot, "rank": self.rank}

    @classmethod
    def from_json(cls, d: Any, what: str = "slot reference") -> "SlotRef":
        if not isinstance(d, Mapping):
            raise RecordError(f"{what}: must be {{node, slot, rank}}, not {d!r}")
        return cls(_str(d, "node", what), _int(d, "slot", what, minimum=0), _opt_int(d, "rank", what, minimum=0))


@dataclass(frozen=True)
class Move:
    """One rank of a multi-rank plan (a lost node): from where it was, to the spare that takes it, with the
    replica that streams its model/optimizer and (once the joiner listens) the joiner's address."""

    leaver: SlotRef
    joiner: SlotRef
    donor: SlotRef | None = None
    joiner_addr: tuple[str, int] | None = None

    @property
    def rank(self) -> int:
        assert self.leaver.rank is not None
        return self.leaver.rank

    def to_json(self) -> dict[str, Any]:
        return {"leaver": self.leaver.to_json(), "joiner": self.joiner.to_json(),
                "donor": self.donor.to_json() if self.donor else None,
                "joiner_addr": list(self.joiner_addr) if self.joiner_addr else None}

    @classmethod
    def from_json(cls, d: Any, what: str = "move") -> "Move":
        if not isinstance(d, Mapping):
            raise RecordError(f"{what}: must be an object, not {d!r}")
        leaver = SlotRef.from_json(d.get("leaver"), f"{what} leaver")
        if leaver.rank is None:
            raise RecordError(f"{what}: the leaver names no rank")
        donor = d.get("donor")
        return cls(leaver, SlotRef.from_json(d.get("joiner"), f"{what} joiner"),
                   None if donor is None else SlotRef.from_json(donor, f"{what} donor"),
                   _addr(d.get("joiner_addr"), what))


def _ranks(doc: Mapping[str, Any], key: str, what: str) -> tuple[int, ...]:
    ranks = _list(doc, key, what)
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise RecordError(f"{what}: {key} must list ranks (non-negative integers)")
    return tuple(ranks)


@dataclass(frozen=True)
class SwapPlan:
    """``swaps/<id>``: one swap, advanced phase by phase by the leader (compare-and-swap).

    A node plan (``kind`` node) moves every rank of ``lost_node`` at once: ``moves`` lists them (``leaver``,
    ``joiner`` and ``donor`` repeat the first, for readers that show one), ``light_from`` says which node's
    mirror holds each rank's light state for the resume step, ``replaces`` names the node that takes the lost
    node's place among the members (all its ranks went there), ``store`` is the workers' store the re-formed
    world meets at (a new one when the lost node hosted it; ``store_host`` runs it)."""

    id: str
    kind: SwapKind
    generation: int
    leaver: SlotRef
    joiner: SlotRef
    donor: SlotRef | None
    phase: Phase
    reason: str
    nodes: tuple[str, ...]                 # member nodes that must report each phase
    boundary: int | None = None
    joiner_addr: tuple[str, int] | None = None
    light_b64: str | None = None
    attempt: int = 0
    excluded_spares: tuple[tuple[str, int], ...] = ()
    taint_id: str | None = None
    release: bool = False          # migrate-back: the leaver's slot is healthy, return it to the spare pool
    history: tuple[tuple[str, float], ...] = ()   # (phase, wall time)
    # hex; the leader draws it when it writes the plan; each attempt's transfer key derives from it
    secret: str | None = field(default=None, repr=False)
    outcome: str | None = None     # why it ended (aborted: what made a live recovery impossible)
    # sharded state (tpassrun/worker/shards.py): every survivor first rolls back to its local copy of ``boundary``'s start
    restore: bool = False
    shard_from: tuple[str, int] | None = None   # the dead rank's shard: this agent's mirror server ...
    shard_node: str | None = None               # ... on this node (its step is ``boundary``)
    moves: tuple[Move, ...] = ()   # node plans: every rank that moves
    lost_node: str | None = None
    light_from: Mapping[int, str] = field(default_factory=dict)
    replaces: str | None = None
    store: tuple[str, int] | None = None
    store_host: str | None = None
    # aborted because another rank died while it ran (a second fault): a plan for every dead rank follows, so
    # nobody falls back to a group restart on its account
    superseded: bool = False
    # node plans, a mixed commit (tpassrun/plan/catchup.py): survivors that catch up (leaver = joiner = their slot)
    # from a survivor that completed the step (donor), with their listening address once known
    catch_up: tuple[Move, ...] = ()
    # dead ranks with sharded state (sess.track_sharded) that a live declared replica holds too (HSDP): their
    # shards come from that replica, never from a mirror; survivors' local copies only serve a rollback
    replica_held: tuple[int, ...] = ()
    # node plans of sharded jobs: the node whose mirror holds each lost rank's shard (with its light snapshot) of
    # ``boundary`` (its joiner fetches it from there); ``restore`` as above
    shards_from: Mapping[int, str] = field(default_factory=dict)
    # several losses in one plan (tpassrun/plan/multiloss.py): the other lost nodes, and for each lost node the node
    # that takes its place among the members (all its ranks went there; ``replaces`` is the first lost node's)
    lost_also: tuple[str, ...] = ()
    replacing: Mapping[str, str] = field(default_factory=dict)
    # hex, never in etcd: what each attempt's transfer key derives from, set when the plan is read with the run
    # key (``with_run_key``; without one, the transfer key derives from ``secret`` alone)
    transfer_seed: str | None = field(default=None, repr=False, compare=False)

    SEALED: ClassVar[bool] = True      # carries a MAC of the run key (tpassrun/records/provenance.py)

    def with_run_key(self, run_key: "RunKey") -> "SwapPlan":
        """The plan as read by the job: its transfer seed derived from the run key and the plan's own secret, so
        that reading etcd does not give the transfer key."""
        if not self.secret:
            return self
        return dataclasses.replace(self, transfer_seed=run_key.derive(f"transfer/{self.id}/{self.secret}").hex())

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    @property
    def all_moves(self) -> tuple[Move, ...]:
        """Every rank the plan moves (one for a single-rank swap)."""
        if self.moves:
            return self.moves
        return (Move(self.leaver, self.joiner, self.donor, self.joiner_addr),)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(m.rank for m in self.all_moves if m.leaver.rank is not None)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION, "id": self.id, "secret": self.secret, "kind": self.kind.value, "generation": self.generation,
            "leaver": self.leaver.to_json(), "joiner": self.joiner.to_json(),
            "donor": self.donor.to_json() if self.donor else None, "phase": self.phase.value,
            "reason": self.reason, "nodes": list(self.nodes), "boundary": self.boundary,
            "joiner_addr": list(self.joiner_addr) if self.joiner_addr else None, "light_b64": self.light_b64,
            "attempt": self.attempt, "excluded_spares": [list(x) for x in self.excluded_spares],
            "taint_id": self.taint_id, "release": self.release, "history": [list(h) for h in self.history],
            "outcome": self.outcome, "restore": self.restore,
            "shard_from": list(self.shard_from) if self.shard_from else None, "shard_node": self.shard_node,
            "moves": [m.to_json() for m in self.moves], "lost_node": self.lost_node,
            "light_from": {str(r): n for r, n in self.light_from.items()}, "replaces": self.replaces,
            "store": list(self.store) if self.store else None, "store_host": self.store_host,
            "superseded": self.superseded,
            "catch_up": [m.to_json() for m in self.catch_up],
            "replica_held": list(self.replica_held),
            "shards_from": {str(r): n for r, n in self.shards_from.items()},
            "lost_also": list(self.lost_also), "replacing": dict(self.replacing),
        }

    @classmethod
    def from_json(cls, doc: Any) -> "SwapPlan":
        what = "swap plan"
        d = _check(doc, what)
        what = f"swap plan {d.get('id')!r}"
        nodes = _list(d, "nodes", what)
        excluded = _list(d, "excluded_spares", what)
        history = _list(d, "history", what)
        if not all(isinstance(n, str) for n in nodes):
            raise RecordError(f"{what}: nodes must be strings")
        if not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], int)
                   for x in excluded):
            raise RecordError(f"{what}: excluded_spares must be [node, slot] pairs")
        if not all(isinstance(h, list) and len(h) == 2 and isinstance(h[0], str)
                   and isinstance(h[1], (int, float)) for h in history):
            raise RecordError(f"{what}: history must be [phase, time] pairs")
        donor = d.get("donor")
        light_from, shards_from = d.get("light_from") or {}, d.get("shards_from") or {}
        for name, m in (("light_from", light_from), ("shards_from", shards_from)):
            if not isinstance(m, Mapping) or not all(isinstance(k, str) and k.isdigit() and isinstance(v, str)
                                                     for k, v in m.items()):
                raise RecordError(f"{what}: {name} must map ranks to node ids")
        return cls(
            moves=tuple(Move.from_json(m, f"{what} move") for m in _list(d, "moves", what)),
            lost_node=_opt_str(d, "lost_node", what), light_from={int(k): v for k, v in light_from.items()},
            replaces=_opt_str(d, "replaces", what), store=_addr(d.get("store"), what),
            store_host=_opt_str(d, "store_host", what), superseded=_bool(d, "superseded", what),
            catch_up=tuple(Move.from_json(m, f"{what} catch-up") for m in _list(d, "catch_up", what)),
            replica_held=_ranks(d, "replica_held", what),
            shards_from={int(k): v for k, v in shards_from.items()},
            lost_also=tuple(_strs(d, "lost_also", what)), replacing=_str_map(d, "replacing", what),
            id=_str(d, "id", what), kind=_enum(SwapKind, d, "kind", what),
            generation=_int(d, "generation", what, minimum=0),
            leaver=SlotRef.from_json(d.get("leaver"), f"{what} leaver"),
            joiner=SlotRef.from_json(d.get("joiner"), f"{what} joiner"),
            donor=None if donor is None else SlotRef.from_json(donor, f"{what} donor"),
            phase=_enum(Phase, d, "phase", what), reason=_str(d, "reason", what, ""), nodes=tuple(nodes),
            boundary=_opt_int(d, "boundary", what, minimum=0), joiner_addr=_addr(d.get("joiner_addr"), what),
            light_b64=_opt_str(d, "light_b64", what), attempt=_int(d, "attempt", what, 0, minimum=0),
            excluded_spares=tuple((x[0], x[1]) for x in excluded), taint_id=_opt_str(d, "taint_id", what),
            release=_bool(d, "release", what), history=tuple((h[0], float(h[1])) for h in history),
            secret=_opt_str(d, "secret", what), outcome=_opt_str(d, "outcome", what),
            restore=_bool(d, "restore", what), shard_from=_addr(d.get("shard_from"), what),
            shard_node=_opt_str(d, "shard_node", what),
        )

    def advance(self, phase: Phase, now_wall: float, **changes: Any) -> "SwapPlan":
        if phase not in TRANSITIONS[self.phase]:
            raise ValueError(f"swap {self.id}: {self.phase.value} -> {phase.value} is not allowed")
        return dataclasses.replace(self, phase=phase, history=self.history + ((phase.value, now_wall),), **changes)


def _strs(d: Mapping[str, Any], key: str, what: str) -> list[str]:
    items = _list(d, key, what)
    if not all(isinstance(x, str) for x in items):
        raise RecordError(f"{what}: {key} must be strings")
    return items


def _str_map(d: Mapping[str, Any], key: str, what: str) -> dict[str, str]:
    m = d.get(key) or {}
    if not isinstance(m, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in m.items()):
        raise RecordError(f"{what}: {key} must map node ids to node ids")
    return dict(m)


@dataclass(frozen=True)
class Report:
    """``reports/<swap id>/<seq>/<node>``: what one agent says about one phase of one swap."""

    node: str
    phase: Phase
    ok: bool = True
    candidate: int | None = None      # pause: earliest boundary this node can offer
    steps: tuple[int, ...] = ()       # pause (unplanned): the step each local survivor stopped at
    failed_steps: tuple[int, ...] = ()
    post_commit: tuple[int, ...] = ()   # pause (unplanned): steps a local survivor failed in after its commit point
    dead_steps: tuple[int, ...] | None = None   # pause (unplanned, the dead rank's node): its saved snapshots' steps
    # sharded state (pause, unplanned): the steps every local survivor holds a local copy of (None: no sharded
    # state here); the dead rank's own (None: it had none); the dead rank's shard in this agent's mirror
    rings: tuple[int, ...] | None = None
    dead_ring: tuple[int, ...] | None = None
    mirror_steps: tuple[int, ...] = ()
    mirror_addr: tuple[str, int] | None = None
    final: bool = False               # the error is deterministic: retrying cannot help
    joiner_addr: tuple[str, int] | None = None
    light_b64: str | None = None
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    held: Mapping[int, tuple[int, ...]] = field(default_factory=dict)   # pause (node plan): rank -> steps of the
                                                                      # light copies this node's mirror holds
    joiner_addrs: Mapping[int, tuple[str, int]] = field(default_factory=dict)   # transfer (node plan): rank -> addr
    # pause (node plan): rank -> (slot, the step this survivor can resume at exactly or -1, whether it can catch up
    # to the next one: it failed inside that step before its commit point and sealed it; tpassrun/plan/catchup.py)
    stops: Mapping[int, tuple[int, int, bool]] = field(default_factory=dict)
    shard_held: Mapping[int, tuple[int, ...]] = field(default_factory=dict)   # pause (node plan): rank -> steps
                                                          # of its sharded state this node's mirror holds
    # pause (unplanned): rank -> the start of the transaction before its own offer, which this survivor can go back
    # to given the replicated state of a survivor standing there (a mixed commit the other way: it committed a step
    # another survivor did not; tpassrun/plan/catchup.py)
    backs: Mapping[int, int] = field(default_factory=dict)
    # pause (unplanned): rank -> the replica group a local survivor declared (``Session.declare_replicas``: the ranks
    # holding exactly its model and optimizer state, tensor-parallel peers' replicas under TP x DP); a survivor
    # that declared none is anyone's replica
    replicas: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    SEALED: ClassVar[bool] = True      # carries a MAC of the run key (tpassrun/records/provenance.py)

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node": self.node, "phase": self.phase.value, "ok": self.ok,
                "held": {str(r): list(v) for r, v in self.held.items()},
                "joiner_addrs": {str(r): list(a) for r, a in self.joiner_addrs.items()},
                "stops": {str(r): list(v) for r, v in self.stops.items()},
                "shard_held": {str(r): list(v) for r, v in self.shard_held.items()},
                "backs": {str(r): v for r, v in self.backs.items()},
                "replicas": {str(r): list(v) for r, v in self.replicas.items()},
                "candidate": self.candidate, "steps": list(self.steps), "failed_steps": list(self.failed_steps),
                "post_commit": list(self.post_commit),
                "dead_steps": None if self.dead_steps is None else list(self.dead_steps), "final": self.final,
                "joiner_addr": list(self.joiner_addr) if self.joiner_addr else None, "light_b64": self.light_b64,
                "error": self.error, "extra": dict(self.extra),
                "rings": None if self.rings is None else list(self.rings),
                "dead_ring": None if self.dead_ring is None else list(self.dead_ring),
                "mirror_steps": list(self.mirror_steps),
                "mirror_addr": list(self.mirror_addr) if self.mirror_addr else None}

    @classmethod
    def from_json(cls, doc: Any) -> "Report":
        what = "swap report"
        d = _check(doc, what)
        steps, failed = _list(d, "steps", what), _list(d, "failed_steps", what)
        post = _list(d, "post_commit", what)
        dead = None if d.get("dead_steps") is None else _list(d, "dead_steps", what)
        rings = None if d.get("rings") is None else _list(d, "rings", what)
        dead_ring = None if d.get("dead_ring") is None else _list(d, "dead_ring", what)
        mirrored = _list(d, "mirror_steps", what)
        if not all(isinstance(s, int) and not isinstance(s, bool)
                   for s in steps + failed + post + (dead or []) + (rings or []) + (dead_ring or []) + mirrored):
            raise RecordError(f"{what}: steps must be integers")
        extra = d.get("extra") or {}
        if not isinstance(extra, Mapping):
            raise RecordError(f"{what}: extra must be a JSON object")
        held, addrs, shard_held = d.get("held") or {}, d.get("joiner_addrs") or {}, d.get("shard_held") or {}
        if not isinstance(held, Mapping) or not isinstance(addrs, Mapping) or not isinstance(shard_held, Mapping) \
                or not all(isinstance(k, str) and k.isdigit() for k in [*held, *addrs, *shard_held]):
            raise RecordError(f"{what}: held, shard_held and joiner_addrs must be keyed by rank")
        if not all(isinstance(v, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in v)
                   for v in [*held.values(), *shard_held.values()]):
            raise RecordError(f"{what}: held and shard_held must list steps")
        backs = d.get("backs") or {}
        if not isinstance(backs, Mapping) or not all(isinstance(k, str) and k.isdigit() and isinstance(v, int)
                                                     and not isinstance(v, bool) for k, v in backs.items()):
            raise RecordError(f"{what}: backs must map ranks to steps")
        replicas = d.get("replicas") or {}
        if not isinstance(replicas, Mapping) or not all(
                isinstance(k, str) and k.isdigit() and isinstance(v, list)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in v) for k, v in replicas.items()):
            raise RecordError(f"{what}: replicas must map ranks to lists of ranks")
        stops = d.get("stops") or {}
        if not isinstance(stops, Mapping) or not all(
                isinstance(k, str) and k.isdigit() and isinstance(v, list) and len(v) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) for x in v[:2]) and isinstance(v[2], bool)
                for k, v in stops.items()):
            raise RecordError(f"{what}: stops must map ranks to [slot, step, can catch up]")
        return cls(
                   stops={int(k): (v[0], v[1], v[2]) for k, v in stops.items()},
                   backs={int(k): v for k, v in backs.items()},
                   replicas={int(k): tuple(v) for k, v in replicas.items()},
                   shard_held={int(k): tuple(v) for k, v in shard_held.items()},
                   held={int(k): tuple(v) for k, v in held.items()},
                   joiner_addrs={int(k): a for k, v in addrs.items() if (a := _addr(v, what)) is not None},
                   node=_str(d, "node", what), phase=_enum(Phase, d, "phase", what), ok=_bool(d, "ok", what, True),
                   candidate=_opt_int(d, "candidate", what), steps=tuple(steps), failed_steps=tuple(failed),
                   post_commit=tuple(post), dead_steps=None if dead is None else tuple(dead),
                   final=_bool(d, "final", what),
                   joiner_addr=_addr(d.get("joiner_addr"), what), light_b64=_opt_str(d, "light_b64", what),
                   error=_opt_str(d, "error", what), extra=dict(extra),
                   rings=None if rings is None else tuple(rings),
                   dead_ring=None if dead_ring is None else tuple(dead_ring), mirror_steps=tuple(mirrored),
                   mirror_addr=_addr(d.get("mirror_addr"), what))
