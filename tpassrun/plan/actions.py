"""What the swap coordinator's triage (:mod:`tpassrun.plan.triage`) reads and what it says to do: :class:`Seen`, one
tick's read of the control plane, and the typed :data:`Action` s the swapper carries out in order (pure data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from tpassrun.plan.swap import ClusterView, Decision
from tpassrun.records import Failure, Fallback, Report, SwapPlan, Taint


@dataclass(frozen=True)
class Seen:
    """What the leader read in one tick."""

    now: float                                        # wall time (plans' history)
    epoch: int                                        # since when plans and deaths count (AgentPort.epoch)
    plans: Sequence[tuple[SwapPlan, int]]             # every plan with its etcd mod revision
    reports: Sequence[Report]                         # for the first active plan's current phase
    failures: Sequence[tuple[str, Failure]]           # (failure id, record), key order
    taints: Sequence[Taint]                           # key order
    view: ClusterView
    waiting_said: frozenset[str] = frozenset()        # taints whose "waiting" was already announced
    received_said: frozenset[str] = frozenset()       # taints whose arrival was already announced
    pool: bool = False                                # the job may draw a node from a spare pool (--spare-pool)
    pool_gave_up: frozenset[str] = frozenset()        # lost nodes the pool could not cover in time: restart


# --------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class CasPlan:
    """Replace ``old`` (at ``revision``) by ``new``; ``decision`` is None for a stale plan aborted quietly."""

    old: SwapPlan
    new: SwapPlan
    revision: int
    decision: Decision | None = None


@dataclass(frozen=True)
class CreatePlan:
    """Create a new plan (with a fresh transfer secret unless it is born aborted); for a taint, mark the taint
    ``migrating`` once the plan exists."""

    plan: SwapPlan
    taint: Taint | None = None
    reason: str = ""


@dataclass(frozen=True)
class PutFailure:
    failure_id: str
    failure: Failure


@dataclass(frozen=True)
class PutTaint:
    taint: Taint


@dataclass(frozen=True)
class PutFallback:
    node: str
    fallback: Fallback


@dataclass(frozen=True)
class Say:
    """An event-log line."""

    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RestartGroup:
    """A health-aware restart: a new generation without the tainted slot (costs no restart)."""

    reason: str
    rank: int | None = None          # the tainted rank (the transparent mode moves it instead, if it can)


@dataclass(frozen=True)
class ClaimFromPool:
    """Lost nodes whose ranks no own spare can take: draw a node from the job's spare pool for them (the plan is
    made when its spares are up; ``reason``: why own spares do not do)."""

    lost: tuple[str, ...]
    reason: str


Action = Union[CasPlan, CreatePlan, PutFailure, PutTaint, PutFallback, Say, RestartGroup, ClaimFromPool]


@dataclass(frozen=True)
class Triage:
    actions: tuple[Action, ...]
    said: frozenset[str] = frozenset()                # taints whose "waiting" is announced by this triage
    received: frozenset[str] = frozenset()            # taints whose arrival is announced by this triage


__all__ = ["Action", "CasPlan", "ClaimFromPool", "CreatePlan", "PutFailure", "PutFallback", "PutTaint",
           "RestartGroup", "Say", "Seen",
           "Triage"]
