"""What went wrong on a node and what the coordinator did about it: ``taints/`` (a slot or rank that must not
run), ``failures/`` (a managed worker died), ``fallbacks/`` (no live recovery: the node's agent restarts the
group). Strict versioned types; keys from :class:`tpassrun.records.Keys`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from tpassrun.health import TaintEffect
from tpassrun.records.fields import (SCHEMA_VERSION, RecordError, _bool, _check, _enum, _int, _num, _opt_int, _opt_ranks,
                             _opt_str, _str)


# ---------------------------------------------------------------------------------------------- taints
class TaintSource(str, enum.Enum):
    TPASSCTL = "tpassctl"
    HEALTH = "health"
    MIGRATE_BACK = "migrate-back"


HANDLED_RESTART = "restart"        # ``handled_by``: no live swap possible, the group restarted without the slot
HANDLED_KILLED = "health-kill"     # ``handled_by``: a FAIL verdict killed the worker; the unplanned path recovers
HANDLED_COALESCED = "coalesced"    # ``handled_by``: its rank had already left the slot (another taint, a recovery)


@dataclass(frozen=True)
class Taint:
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
    reason: str
    source: str
    node_id: str | None = None
    slot: int | None = None
    local_rank: int | None = None
    rank: int | None = None
    time: float = 0.0
    device: str | None = None        # health: the device (gpuN, rankR) and metric the verdict was about
    metric: str | None = None
    status: str | None = None
    home_node: str | None = None     # migrate-back: the rank goes to this slot only
    home_slot: int | None = None
    handled_by: str | None = None    # a swap id, HANDLED_RESTART, HANDLED_KILLED or HANDLED_COALESCED
    state: str = ""                  # the coordinator's word on it (migrating, quarantined, "wait: ...")

    def __post_init__(self) -> None:
        if self.effect is TaintEffect.NONE:
            raise RecordError(f"taint {self.id}: effect none taints nothing")

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "id": self.id, "effect": self.effect.value, "reason": self.reason,
                "source": self.source, "node_id": self.node_id, "slot": self.slot, "local_rank": self.local_rank,
                "rank": self.rank, "time": self.time, "device": self.device, "metric": self.metric,
                "status": self.status, "home_node": self.home_node, "home_slot": self.home_slot,
                "handled_by": self.handled_by, "state": self.state}

    @classmethod
    def from_json(cls, doc: Any) -> "Taint":
        what = "taint"
        d = _check(doc, what)
        what = f"taint {d.get('id')!r}"
        return cls(id=_str(d, "id", what), effect=_enum(TaintEffect, d, "effect", what),
                   reason=_str(d, "reason", what, ""), source=_str(d, "source", what, ""),
                   node_id=_opt_str(d, "node_id", what), slot=_opt_int(d, "slot", what, minimum=0),
                   local_rank=_opt_int(d, "local_rank", what, minimum=0), rank=_opt_int(d, "rank", what, minimum=0),
                   time=_num(d, "time", what), device=_opt_str(d, "device", what),
                   metric=_opt_str(d, "metric", what), status=_opt_str(d, "status", what),
                   home_node=_opt_str(d, "home_node", what), home_slot=_opt_int(d, "home_slot", what, minimum=0),
                   handled_by=_opt_str(d, "handled_by", what), state=_str(d, "state", what, ""))

    def handled(self, by: str | None, state: str, **where: Any) -> "Taint":
        return dataclasses.replace(self, handled_by=by, state=state, **where)

    @property
    def home(self) -> tuple[str, int] | None:
        return (self.home_node, self.home_slot) if self.home_node is not None and self.home_slot is not None else None


# ---------------------------------------------------------------------------------------------- failures
@dataclass(frozen=True)
class Failure:
    """``failures/<node>-<slot>``: a managed worker died; the leader's coordinator decides its recovery."""

    node: str
    slot: int
    rank: int
    code: int
    step: int
    light: bool               # the dead rank's light snapshot is readable on its node
    generation: int
    time: float = 0.0
    handled: str | None = None   # the coordinator's action ("plan", "fallback", "stale", ...)
    reason: str = ""
    # the ranks holding exactly the dead rank's model/optimizer state, as its framework adapter declared them
    # (None: not declared, every rank does); ``alone``: why no other rank does, when it is the only one
    replicas: tuple[int, ...] | None = None
    alone: str = ""
    sharded: bool = False     # it kept local copies of sharded state (tpassrun/worker/shards.py): a mirror may hold its shard

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node": self.node, "slot": self.slot, "rank": self.rank, "code": self.code,
                "step": self.step, "light": self.light, "generation": self.generation, "time": self.time,
                "handled": self.handled, "reason": self.reason,
                "replicas": None if self.replicas is None else list(self.replicas), "alone": self.alone,
                "sharded": self.sharded}

    @classmethod
    def from_json(cls, doc: Any) -> "Failure":
        what = "worker failure"
        d = _check(doc, what)
        return cls(node=_str(d, "node", what), slot=_int(d, "slot", what, minimum=0),
                   rank=_int(d, "rank", what, minimum=0), code=_int(d, "code", what),
                   step=_int(d, "step", what, 0), light=_bool(d, "light", what),
                   generation=_int(d, "generation", what, minimum=0), time=_num(d, "time", what),
                   handled=_opt_str(d, "handled", what), reason=_str(d, "reason", what, ""),
                   replicas=_opt_ranks(d, "replicas", what), alone=_str(d, "alone", what, ""),
                   sharded=_bool(d, "sharded", what))

    def mark(self, handled: str, reason: str) -> "Failure":
        return dataclasses.replace(self, handled=handled, reason=reason)


# ---------------------------------------------------------------------------------------------- fallbacks
@dataclass(frozen=True)
class Fallback:
    """``fallbacks/<node>``: the coordinator found no live recovery for a death on that node: the node's agent
    restarts the group (torchrun's path)."""

    reason: str
    generation: int = 0
    slot: int | None = None     # the dead worker's slot (torchrun's failure report names it)

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "reason": self.reason, "generation": self.generation, "slot": self.slot}

    @classmethod
    def from_json(cls, doc: Any) -> "Fallback":
        what = "fallback request"
        d = _check(doc, what)
        return cls(reason=_str(d, "reason", what, ""), generation=_int(d, "generation", what, 0, minimum=0),
                   slot=_opt_int(d, "slot", what, minimum=0))
