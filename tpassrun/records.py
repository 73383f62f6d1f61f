"""Every control-plane record tpassrun keeps in etcd, as a small frozen type, and the one key layout.

The rendezvous keeps its own records (``nodes/``, ``generation``, ``leader``, ``closed``, ``bootstrap/``) in
:mod:`tpassrun.rendezvous.state`; the swap control plane's are here: taints, worker failures, swap plans and
the agents' reports on them, the agents' status and health tables, fallback requests. Every writer and reader
(agent, swapper, health daemon, tpassctl) goes through these types and :class:`Keys`, never through a raw
dict or a string concatenation.

Values are ``{"v": 1, ...}`` JSON (never pickle). ``from_json`` validates strictly and raises one error,
:class:`RecordError`; readers use :func:`load`, which turns a malformed value into ``None`` and logs it once
per (key, revision): a bad value in etcd is skipped, never fatal, never a traceback per tick.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from .health import TaintEffect
from .rendezvous.state import NodeInfo

log = logging.getLogger("tpassrun.records")

SCHEMA_VERSION = 1


class RecordError(ValueError):
    """A value in etcd that is not a valid record of the expected type (wrong shape, type or version)."""


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

    @property
    def mirror_key(self) -> str:
        return self.prefix + "mirror_key"


# ---------------------------------------------------------------------------------------------- validation
def _check(doc: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise RecordError(f"{what}: not a JSON object ({type(doc).__name__})")
    if doc.get("v") != SCHEMA_VERSION:
        raise RecordError(f"{what}: schema version {doc.get('v')!r}; this tpassrun reads v{SCHEMA_VERSION}")
    return doc


def _str(doc: Mapping[str, Any], key: str, what: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise RecordError(f"{what}: {key} must be a string, not {value!r}")
    return value


def _opt_str(doc: Mapping[str, Any], key: str, what: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise RecordError(f"{what}: {key} must be a string or null, not {value!r}")
    return value


def _int(doc: Mapping[str, Any], key: str, what: str, default: int | None = None, *, minimum: int | None = None) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{what}: {key} must be an integer, not {value!r}")
    if minimum is not None and value < minimum:
        raise RecordError(f"{what}: {key} must be >= {minimum}, not {value}")
    return value


def _opt_int(doc: Mapping[str, Any], key: str, what: str, *, minimum: int | None = None) -> int | None:
    return None if doc.get(key) is None else _int(doc, key, what, minimum=minimum)


def _num(doc: Mapping[str, Any], key: str, what: str, default: float = 0.0) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{what}: {key} must be a number, not {value!r}")
    return float(value)


def _bool(doc: Mapping[str, Any], key: str, what: str, default: bool = False) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise RecordError(f"{what}: {key} must be true or false, not {value!r}")
    return value


def _list(doc: Mapping[str, Any], key: str, what: str) -> list[Any]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise RecordError(f"{what}: {key} must be a list, not {value!r}")
    return value


def _enum(cls: type[E], doc: Mapping[str, Any], key: str, what: str) -> E:
    try:
        return cls(doc.get(key))
    except ValueError:
        raise RecordError(f"{what}: {key} {doc.get(key)!r} is not one of "
                          f"{', '.join(m.value for m in cls)}") from None  # type: ignore[attr-defined]


def _addr(value: Any, what: str) -> tuple[str, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or isinstance(value[1], bool) or not isinstance(value[1], int) or not 0 < value[1] < 65536):
        raise RecordError(f"{what}: an address must be [host, port], not {value!r}")
    return value[0], value[1]


E = TypeVar("E", bound=enum.Enum)
R = TypeVar("R")

_REPORTED: dict[str, int] = {}
_REPORTED_MAX = 1024


def load(decode: Callable[[Any], R], key: str, doc: Any, revision: int = 0) -> R | None:
    """``decode(doc)``, or None for a malformed value (logged once per key and revision).

    One bad value must neither stop a reader nor flood the log: the coordinator re-reads every family on
    every change, a dashboard every half second.
    """
    try:
        return decode(doc)
    except RecordError as exc:
        if _REPORTED.get(key) != revision:
            if len(_REPORTED) >= _REPORTED_MAX:
                _REPORTED.pop(next(iter(_REPORTED)))
            _REPORTED[key] = revision
            log.warning("ignoring malformed etcd value %s (revision %d): %s", key, revision, exc)
        return None


# ---------------------------------------------------------------------------------------------- taints
class TaintSource(str, enum.Enum):
    TPASSCTL = "tpassctl"
    HEALTH = "health"
    MIGRATE_BACK = "migrate-back"


HANDLED_RESTART = "restart"        # ``handled_by``: no live swap possible, the group restarted without the slot
HANDLED_KILLED = "health-kill"     # ``handled_by``: a FAIL verdict killed the worker; the unplanned path recovers


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
    handled_by: str | None = None    # a swap id, HANDLED_RESTART or HANDLED_KILLED
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

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node": self.node, "slot": self.slot, "rank": self.rank, "code": self.code,
                "step": self.step, "light": self.light, "generation": self.generation, "time": self.time,
                "handled": self.handled, "reason": self.reason}

    @classmethod
    def from_json(cls, doc: Any) -> "Failure":
        what = "worker failure"
        d = _check(doc, what)
        return cls(node=_str(d, "node", what), slot=_int(d, "slot", what, minimum=0),
                   rank=_int(d, "rank", what, minimum=0), code=_int(d, "code", what),
                   step=_int(d, "step", what, 0), light=_bool(d, "light", what),
                   generation=_int(d, "generation", what, minimum=0), time=_num(d, "time", what),
                   handled=_opt_str(d, "handled", what), reason=_str(d, "reason", what, ""))

    def mark(self, handled: str, reason: str) -> "Failure":
        return dataclasses.replace(self, handled=handled, reason=reason)


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
    quarantine_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "rank": self.rank, "local_rank": self.local_rank, "pid": self.pid,
                "state": self.state, "step": self.step, "managed": self.managed, "spare": self.spare,
                "last_step_ms": self.last_step_ms, "quarantine_reason": self.quarantine_reason}

    @classmethod
    def from_json(cls, doc: Any) -> "WorkerRow":
        what = "status worker row"
        if not isinstance(doc, Mapping):
            raise RecordError(f"{what}: not a JSON object")
        return cls(slot=_int(doc, "slot", what, minimum=0), state=_str(doc, "state", what),
                   rank=_opt_int(doc, "rank", what, minimum=0), local_rank=_opt_int(doc, "local_rank", what),
                   pid=_opt_int(doc, "pid", what), step=_int(doc, "step", what, 0),
                   managed=_bool(doc, "managed", what), spare=_bool(doc, "spare", what),
                   last_step_ms=_num(doc, "last_step_ms", what),
                   quarantine_reason=_opt_str(doc, "quarantine_reason", what))


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

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node_id": self.node_id, "addr": self.addr, "pid": self.pid,
                "generation": self.generation, "restart_count": self.restart_count,
                "workers": [w.to_json() for w in self.workers], "time": self.time}

    @classmethod
    def from_json(cls, doc: Any) -> "NodeStatus":
        what = "node status"
        d = _check(doc, what)
        return cls(node_id=_str(d, "node_id", what), addr=_str(d, "addr", what, ""), pid=_int(d, "pid", what, 0),
                   generation=_opt_int(d, "generation", what), restart_count=_int(d, "restart_count", what, 0),
                   workers=tuple(WorkerRow.from_json(w) for w in _list(d, "workers", what)),
                   time=_num(d, "time", what))


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


# ---------------------------------------------------------------------------------------------- run
@dataclass(frozen=True)
class RunClosed:
    """``closed`` (written by the rendezvous when the run ends), as tpassctl reads it."""

    reason: str
    node_id: str | None = None
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "reason": self.reason, "node_id": self.node_id, "time": self.time}

    @classmethod
    def from_json(cls, doc: Any) -> "RunClosed":
        what = "closed record"
        d = _check(doc, what)
        return cls(reason=_str(d, "reason", what, ""), node_id=_opt_str(d, "node_id", what), time=_num(d, "time", what))


def node_info(doc: Any) -> NodeInfo:
    """``nodes/<node_id>`` (the rendezvous's registration record), with :class:`RecordError` for a bad one."""
    try:
        return NodeInfo.from_json(doc)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise RecordError(f"node record: {exc}") from exc


def leader_of(doc: Any) -> str:
    """The node id in ``leader`` (written by the rendezvous under the leader's lease)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("node_id"), str):
        raise RecordError(f"leader record: no node_id in {doc!r}")
    return doc["node_id"]


# ---------------------------------------------------------------------------------------------- swaps
class Phase(str, enum.Enum):
    PAUSE = "pause"
    BOUNDARY = "boundary"
    TRANSFER = "transfer"
    SEND = "send"
    REFORM = "reform"
    DONE = "done"
    ABORTED = "aborted"


# The one table of a swap plan's allowed transitions (the planner, tpassrun.swap, decides which to take).
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
class SwapPlan:
    """``swaps/<id>``: one swap, advanced phase by phase by the leader (compare-and-swap)."""

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

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    def to_json(self) -> dict[str, Any]:
        return {
            "v": SCHEMA_VERSION, "id": self.id, "secret": self.secret, "kind": self.kind.value, "generation": self.generation,
            "leaver": self.leaver.to_json(), "joiner": self.joiner.to_json(),
            "donor": self.donor.to_json() if self.donor else None, "phase": self.phase.value,
            "reason": self.reason, "nodes": list(self.nodes), "boundary": self.boundary,
            "joiner_addr": list(self.joiner_addr) if self.joiner_addr else None, "light_b64": self.light_b64,
            "attempt": self.attempt, "excluded_spares": [list(x) for x in self.excluded_spares],
            "taint_id": self.taint_id, "release": self.release, "history": [list(h) for h in self.history],
            "outcome": self.outcome,
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
        return cls(
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
        )

    def advance(self, phase: Phase, now_wall: float, **changes: Any) -> "SwapPlan":
        if phase not in TRANSITIONS[self.phase]:
            raise ValueError(f"swap {self.id}: {self.phase.value} -> {phase.value} is not allowed")
        return dataclasses.replace(self, phase=phase, history=self.history + ((phase.value, now_wall),), **changes)


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
    final: bool = False               # the error is deterministic: retrying cannot help
    joiner_addr: tuple[str, int] | None = None
    light_b64: str | None = None
    error: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node": self.node, "phase": self.phase.value, "ok": self.ok,
                "candidate": self.candidate, "steps": list(self.steps), "failed_steps": list(self.failed_steps),
                "post_commit": list(self.post_commit),
                "dead_steps": None if self.dead_steps is None else list(self.dead_steps), "final": self.final,
                "joiner_addr": list(self.joiner_addr) if self.joiner_addr else None, "light_b64": self.light_b64,
                "error": self.error, "extra": dict(self.extra)}

    @classmethod
    def from_json(cls, doc: Any) -> "Report":
        what = "swap report"
        d = _check(doc, what)
        steps, failed = _list(d, "steps", what), _list(d, "failed_steps", what)
        post = _list(d, "post_commit", what)
        dead = None if d.get("dead_steps") is None else _list(d, "dead_steps", what)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps + failed + post + (dead or [])):
            raise RecordError(f"{what}: steps must be integers")
        extra = d.get("extra") or {}
        if not isinstance(extra, Mapping):
            raise RecordError(f"{what}: extra must be a JSON object")
        return cls(node=_str(d, "node", what), phase=_enum(Phase, d, "phase", what), ok=_bool(d, "ok", what, True),
                   candidate=_opt_int(d, "candidate", what), steps=tuple(steps), failed_steps=tuple(failed),
                   post_commit=tuple(post), dead_steps=None if dead is None else tuple(dead),
                   final=_bool(d, "final", what),
                   joiner_addr=_addr(d.get("joiner_addr"), what), light_b64=_opt_str(d, "light_b64", what),
                   error=_opt_str(d, "error", what), extra=dict(extra))


__all__ = ["Failure", "Fallback", "HANDLED_KILLED", "HANDLED_RESTART", "HealthRecord", "Keys", "NodeStatus",
           "Phase", "RecordError", "Report", "RunClosed", "leader_of", "node_info", "SCHEMA_VERSION", "SlotRef", "SwapKind", "SwapPlan", "TERMINAL",
           "TRANSITIONS", "Taint", "TaintEffect", "TaintSource", "WorkerRow", "load"]
