"""What went wrong on a node and what the coordinator did about it: ``taints/`` (a slot or rank that must not
run), ``failures/`` (a managed worker died), ``fallbacks/`` (no live recovery: the node's agent restarts the
group), ``handbacks/`` (a node the scheduler watcher hands back to the scheduler: its agent leaves the job).
Strict versioned types; keys from :class:`tpassrun.records.Keys`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tpassrun import schema
from tpassrun.health import TaintEffect
from tpassrun.records.fields import RecordError, record
from tpassrun.schema import NonNegative, wire


# ---------------------------------------------------------------------------------------------- taints
class TaintSource(str, enum.Enum):
    TPASSCTL = "tpassctl"
    HEALTH = "health"
    MIGRATE_BACK = "migrate-back"


HANDLED_RESTART = "restart"        # ``handled_by``: no live swap possible, the group restarted without the slot
HANDLED_KILLED = "health-kill"     # ``handled_by``: a FAIL verdict killed the worker; the unplanned path recovers
HANDLED_COALESCED = "coalesced"    # ``handled_by``: its rank had already left the slot (another taint, a recovery)


@dataclass(frozen=True)
class Taint(schema.Record):
    """``taints/<id>``: a slot or rank that must not run (or not be handed out).

    ``slot`` is the agent's worker slot index on ``node_id`` (what the agents and the coordinator match on);
    ``local_rank`` is only what the operator named it by (the worker's LOCAL_RANK when tainted), for display.
    ``rank`` is set when the taint asks for a rank to move; ``None`` taints only the slot.

    Effects: ``migrate`` moves the rank to a spare at a step boundary; ``exclude`` leaves the rank where it
    is and never hands the slot out as a spare; ``fail`` (health policies only) kills the worker at once and
    the unplanned recovery replaces it (the health daemon does the kill and sets ``handled_by``).
    """

    id: str
    effect: TaintEffect
    reason: str = field(metadata=wire(missing=""))
    source: str = field(metadata=wire(missing=""))
    node_id: str | None = None
    slot: NonNegative | None = None
    local_rank: NonNegative | None = None
    rank: NonNegative | None = None
    time: float = 0.0
    device: str | None = None        # health: the device (gpuN, rankR) and metric the verdict was about
    metric: str | None = None
    status: str | None = None
    home_node: str | None = None     # migrate-back: the rank goes to this slot only
    home_slot: NonNegative | None = None
    handled_by: str | None = None    # a swap id, HANDLED_RESTART, HANDLED_KILLED or HANDLED_COALESCED
    state: str = ""                  # the coordinator's word on it (migrating, quarantined, "wait: ...")

    SCHEMA: ClassVar[schema.Schema] = record("taint", named_by="id")

    def __post_init__(self) -> None:
        if self.effect is TaintEffect.NONE:
            raise RecordError(f"taint {self.id}: effect none taints nothing")

    def handled(self, by: str | None, state: str, **where: Any) -> "Taint":
        return dataclasses.replace(self, handled_by=by, state=state, **where)

    @property
    def home(self) -> tuple[str, int] | None:
        return (self.home_node, self.home_slot) if self.home_node is not None and self.home_slot is not None else None


# ---------------------------------------------------------------------------------------------- failures
@dataclass(frozen=True)
class Failure(schema.Record):
    """``failures/<node>-<slot>``: a managed worker died; the leader's coordinator decides its recovery."""

    node: str
    slot: NonNegative
    rank: NonNegative
    code: int
    step: int = field(metadata=wire(missing=0))
    light: bool = field(metadata=wire(missing=False))    # the dead rank's light snapshot is readable on its node
    generation: NonNegative
    time: float = 0.0
    handled: str | None = None   # the coordinator's action ("plan", "fallback", "stale", ...)
    reason: str = ""
    # the ranks holding exactly the dead rank's model/optimizer state, as its framework adapter declared them
    # (None: not declared, every rank does); ``alone``: why no other rank does, when it is the only one
    replicas: tuple[NonNegative, ...] | None = None
    alone: str = ""
    sharded: bool = False     # it kept local copies of sharded state (tpassrun/worker/shards.py): a mirror may hold its shard

    SCHEMA: ClassVar[schema.Schema] = record("worker failure")

    def mark(self, handled: str, reason: str) -> "Failure":
        return dataclasses.replace(self, handled=handled, reason=reason)


# ---------------------------------------------------------------------------------------------- fallbacks
@dataclass(frozen=True)
class Fallback(schema.Record):
    """``fallbacks/<node>``: the coordinator found no live recovery for a death on that node: the node's agent
    restarts the group (torchrun's path)."""

    reason: str = field(metadata=wire(missing=""))
    generation: NonNegative = 0
    slot: NonNegative | None = None     # the dead worker's slot (torchrun's failure report names it)

    SCHEMA: ClassVar[schema.Schema] = record("fallback request")


# ---------------------------------------------------------------------------------------------- hand-backs
@dataclass(frozen=True)
class HandBack(schema.Record):
    """``handbacks/<node>``: the leader's scheduler watcher hands this node back to the scheduler (an operator
    drained it and its ranks have left): its agent, holding no rank, stops its spares and exits 0, and the leader
    then takes the node out of the job's allocation (``scontrol update JobId= NodeList=``). Kept for the run's
    life: a node handed back is never counted on again, and its leaving is no loss."""

    node: str                           # the scheduler's name of it (n2)
    reason: str = field(metadata=wire(missing=""))
    time: float = 0.0

    SCHEMA: ClassVar[schema.Schema] = record("hand-back")
