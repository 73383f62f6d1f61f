"""The swap records: ``swaps/<id>`` (a :class:`SwapPlan`, advanced phase by phase along :data:`TRANSITIONS`) and
``reports/<id>/<seq>/<node>`` (each agent's :class:`Report` on one phase).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar, Mapping

from tpassrun import schema
from tpassrun.records.fields import record
from tpassrun.records.provenance import RunKey
from tpassrun.schema import Address, NonNegative, wire


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
class SlotRef(schema.Record):
    node: str
    slot: NonNegative
    rank: NonNegative | None = None

    SCHEMA: ClassVar[schema.Schema] = record("slot reference", versioned=False)

    @classmethod
    def from_json(cls, d: Any, what: str = "slot reference") -> "SlotRef":
        return schema.load(cls, d, what)


def _names_its_rank(move: "Move") -> str | None:
    return None if move.leaver.rank is not None else "the leaver names no rank"


@dataclass(frozen=True)
class Move(schema.Record):
    """One rank of a multi-rank plan (a lost node): from where it was, to the spare that takes it, with the
    replica that streams its model/optimizer and (once the joiner listens) the joiner's address."""

    leaver: SlotRef
    joiner: SlotRef
    donor: SlotRef | None = None
    joiner_addr: Address | None = None

    SCHEMA: ClassVar[schema.Schema] = record("move", versioned=False, check=_names_its_rank)

    @property
    def rank(self) -> int:
        assert self.leaver.rank is not None
        return self.leaver.rank

    @classmethod
    def from_json(cls, d: Any, what: str = "move") -> "Move":
        return schema.load(cls, d, what)


@dataclass(frozen=True)
class SwapPlan(schema.Record):
    """``swaps/<id>``: one swap, advanced phase by phase by the leader (compare-and-swap).

    A node plan (``kind`` node) moves every rank of ``lost_node`` at once: ``moves`` lists them (``leaver``,
    ``joiner`` and ``donor`` repeat the first, for readers that show one), ``light_from`` says which node's
    mirror holds each rank's light state for the resume step, ``replaces`` names the node that takes the lost
    node's place among the members (all its ranks went there), ``store`` is the workers' store the re-formed
    world meets at (a new one when the lost node hosted it; ``store_host`` runs it)."""

    id: str
    # hex; the leader draws it when it writes the plan; each attempt's transfer key derives from it
    secret: str | None = field(default=None, repr=False, kw_only=True)
    kind: SwapKind
    generation: NonNegative
    leaver: SlotRef
    joiner: SlotRef
    donor: SlotRef | None
    phase: Phase
    reason: str = field(metadata=wire(missing=""))
    nodes: tuple[str, ...] = field(metadata=wire(missing=()))   # member nodes that must report each phase
    boundary: NonNegative | None = None
    joiner_addr: Address | None = None
    light_b64: str | None = None
    attempt: NonNegative = 0
    excluded_spares: tuple[tuple[str, int], ...] = ()
    taint_id: str | None = None
    release: bool = False          # migrate-back: the leaver's slot is healthy, return it to the spare pool
    history: tuple[tuple[str, float], ...] = ()   # (phase, wall time)
    outcome: str | None = None     # why it ended (aborted: what made a live recovery impossible)
    # sharded state (tpassrun/worker/shards.py): every survivor first rolls back to its local copy of ``boundary``'s start
    restore: bool = False
    shard_from: Address | None = None           # the dead rank's shard: this agent's mirror server ...
    shard_node: str | None = None               # ... on this node (its step is ``boundary``)
    moves: tuple[Move, ...] = ()   # node plans: every rank that moves
    lost_node: str | None = None
    light_from: Mapping[int, str] = field(default_factory=dict)
    replaces: str | None = None
    store: Address | None = None
    store_host: str | None = None
    # aborted because another rank died while it ran (a second fault): a plan for every dead rank follows, so
    # nobody falls back to a group restart on its account
    superseded: bool = False
    # node plans, a mixed commit (tpassrun/plan/catchup.py): survivors that catch up (leaver = joiner = their slot)
    # from a survivor that completed the step (donor), with their listening address once known
    catch_up: tuple[Move, ...] = ()
    # dead ranks with sharded state (sess.track_sharded) that a live declared replica holds too (HSDP): their
    # shards come from that replica, never from a mirror; survivors' local copies only serve a rollback
    replica_held: tuple[NonNegative, ...] = ()
    # node plans of sharded jobs: the node whose mirror holds each lost rank's shard (with its light snapshot) of
    # ``boundary`` (its joiner fetches it from there); ``restore`` as above
    shards_from: Mapping[int, str] = field(default_factory=dict)
    # several losses in one plan (tpassrun/plan/multiloss.py): the other lost nodes, and for each lost node the node
    # that takes its place among the members (all its ranks went there; ``replaces`` is the first lost node's)
    lost_also: tuple[str, ...] = ()
    replacing: Mapping[str, str] = field(default_factory=dict)
    # hex, never in etcd: what each attempt's transfer key derives from, set when the plan is read with the run
    # key (``with_run_key``; without one, the transfer key derives from ``secret`` alone)
    transfer_seed: str | None = field(default=None, repr=False, compare=False, metadata=wire(skip=True))

    SEALED: ClassVar[bool] = True      # carries a MAC of the run key (tpassrun/records/provenance.py)
    SCHEMA: ClassVar[schema.Schema] = record("swap plan", named_by="id")

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

    def advance(self, phase: Phase, now_wall: float, **changes: Any) -> "SwapPlan":
        if phase not in TRANSITIONS[self.phase]:
            raise ValueError(f"swap {self.id}: {self.phase.value} -> {phase.value} is not allowed")
        return dataclasses.replace(self, phase=phase, history=self.history + ((phase.value, now_wall),), **changes)


@dataclass(frozen=True)
class Report(schema.Record):
    """``reports/<swap id>/<seq>/<node>``: what one agent says about one phase of one swap."""

    node: str
    phase: Phase
    ok: bool = True
    _: KW_ONLY
    held: Mapping[int, tuple[int, ...]] = field(default_factory=dict)   # pause (node plan): rank -> steps of the
                                                                      # light copies this node's mirror holds
    joiner_addrs: Mapping[int, Address] = field(default_factory=dict)   # transfer (node plan): rank -> addr
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
    candidate: int | None = None      # pause: earliest boundary this node can offer
    steps: tuple[int, ...] = ()       # pause (unplanned): the step each local survivor stopped at
    failed_steps: tuple[int, ...] = ()
    post_commit: tuple[int, ...] = ()   # pause (unplanned): steps a local survivor failed in after its commit point
    dead_steps: tuple[int, ...] | None = None   # pause (unplanned, the dead rank's node): its saved snapshots' steps
    final: bool = False               # the error is deterministic: retrying cannot help
    joiner_addr: Address | None = None
    light_b64: str | None = None
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # sharded state (pause, unplanned): the steps every local survivor holds a local copy of (None: no sharded
    # state here); the dead rank's own (None: it had none); the dead rank's shard in this agent's mirror
    rings: tuple[int, ...] | None = None
    dead_ring: tuple[int, ...] | None = None
    mirror_steps: tuple[int, ...] = ()
    mirror_addr: Address | None = None

    SEALED: ClassVar[bool] = True      # carries a MAC of the run key (tpassrun/records/provenance.py)
    SCHEMA: ClassVar[schema.Schema] = record("swap report")
