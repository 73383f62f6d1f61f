"""Pure decisions of a spare pool: (state, event, now) -> one typed action and its reason. No I/O here.

Two planners:

- :func:`plan_job`: a job's leader that needs replacement capacity. Own spares first (ready, then starting), the
  pool second (an idle node that fits, oldest idle first; else, with ``preempt``, a node held by a job of lower
  priority), a restart last, after waiting for the pool up to ``wait_limit``. Every action says why, in the words
  the console prints.
- :func:`plan_node`: a pool node. Idle until a claim (already checked: sealed with the pool key) names it; then it
  starts the claiming job's spare node; when the claim goes (its claimer's lease expired before the node joined),
  the job gives it back (a claim marked released: its ranks went home) or the spare node exits, it returns idle.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Union

from tpassrun.records.pool import IDLE, Claim, PoolNode


# ---------------------------------------------------------------------------------------------- the job's side
@dataclass(frozen=True)
class JobNeed:
    """A job's leader at the moment it needs ``nodes`` replacement nodes of ``nproc`` slots each."""

    job: str
    priority: int
    nproc: int
    nodes: int = 1
    own_ready: int = 0          # own spare nodes (or enough spare slots) ready now
    own_starting: int = 0       # own spare nodes still starting
    since: float = 0.0          # when the need arose (the wait for the pool counts from it)
    wait_limit: float = 0.0     # how long to wait for a pool node before torchrun's restart
    preempt: bool = True


@dataclass(frozen=True)
class PoolView:
    nodes: Mapping[str, PoolNode] = field(default_factory=dict)
    claims: Mapping[str, Claim] = field(default_factory=dict)
    exists: bool = True


class Source(str, enum.Enum):
    OWN = "own spare"
    POOL = "pool"
    RESTART = "restart"


@dataclass(frozen=True)
class UseOwn:
    reason: str
    source: Source = Source.OWN


@dataclass(frozen=True)
class ClaimNode:
    node_id: str
    reason: str
    source: Source = Source.POOL


@dataclass(frozen=True)
class Preempt:
    node_id: str
    victim: str
    reason: str
    source: Source = Source.POOL


@dataclass(frozen=True)
class WaitForPool:
    reason: str
    source: Source = Source.POOL


@dataclass(frozen=True)
class Restart:
    reason: str
    source: Source = Source.RESTART


JobAction = Union[UseOwn, ClaimNode, Preempt, WaitForPool, Restart]


def held_by(view: PoolView, job: str) -> list[str]:
    return sorted(n for n, c in view.claims.items() if c.job == job)


def plan_job(need: JobNeed, view: PoolView, now: float) -> JobAction:
    if need.own_ready >= need.nodes:
        return UseOwn(f"{need.own_ready} own spare node(s) ready")
    if need.own_ready + need.own_starting >= need.nodes:
        return UseOwn(f"own spare node(s) still starting ({need.own_starting}): waiting for them, not the pool")
    if not view.exists:
        return Restart("the spare pool does not exist")
    idle = [n for n in view.nodes.values()
            if n.node_id not in view.claims and n.state == IDLE and n.nproc >= need.nproc]
    if idle:
        pick = min(idle, key=lambda n: (n.since, n.node_id))
        return ClaimNode(pick.node_id, f"no own spare ready; pool node {pick.node_id} is idle "
                                       f"({len(idle)} idle in the pool)")
    if need.preempt:
        victims = [c for c in view.claims.values() if c.job != need.job and c.priority < need.priority
                   and c.node_id in view.nodes and view.nodes[c.node_id].nproc >= need.nproc]
        if victims:
            v = min(victims, key=lambda c: (c.priority, -c.since, c.node_id))
            return Preempt(v.node_id, v.job, f"the pool has no idle node; {v.node_id} runs {v.job} "
                                             f"(priority {v.priority} < {need.priority}): pre-empting it")
    fits = sum(1 for n in view.nodes.values() if n.nproc >= need.nproc)
    why = ("the pool has no node" if not view.nodes else
           f"no pool node has {need.nproc} slots" if not fits else
           f"all {fits} pool node(s) are claimed")
    waited = now - need.since
    if waited < need.wait_limit:
        return WaitForPool(f"{why}: waiting for the pool ({waited:.0f} of {need.wait_limit:.0f} s)")
    return Restart(f"{why} (waited {waited:.0f} s): restarting as torchrun does")


# ---------------------------------------------------------------------------------------------- the node's side
class Phase(str, enum.Enum):
    IDLE = "idle"
    SERVING = "serving"     # the job's spare node runs (starting, spare or member: the job's business)
    STOPPING = "stopping"   # told to stop; waiting for it to exit


@dataclass(frozen=True)
class NodeState:
    node_id: str
    nproc: int
    phase: Phase = Phase.IDLE
    job: str | None = None          # the job it serves (SERVING, STOPPING)
    claim_since: float = 0.0
    joined: bool = False            # the spare node registered in the job's rendezvous (a claimer's death then
                                    # no longer stops it: the job holds it as its own node)


@dataclass(frozen=True)
class ClaimSeen:
    claim: Claim


@dataclass(frozen=True)
class ClaimGone:
    why: str


@dataclass(frozen=True)
class ChildStarted:
    agent: str                  # the spare node's node id in the job (its event log's first line says it)


@dataclass(frozen=True)
class ChildJoined:
    agent: str = ""             # the spare node's node id in the job


@dataclass(frozen=True)
class ChildExited:
    code: int


NodeEvent = Union[ClaimSeen, ClaimGone, ChildStarted, ChildJoined, ChildExited]


@dataclass(frozen=True)
class StartSpare:
    claim: Claim
    reason: str


@dataclass(frozen=True)
class StopSpare:
    reason: str


@dataclass(frozen=True)
class BecomeIdle:
    reason: str


@dataclass(frozen=True)
class Refuse:
    reason: str


@dataclass(frozen=True)
class Keep:
    reason: str


NodeAction = Union[StartSpare, StopSpare, BecomeIdle, Refuse, Keep]


def plan_node(state: NodeState, event: NodeEvent, now: float) -> tuple[NodeState, NodeAction]:
    """The pool node's next state and what to do. ``ClaimSeen`` carries a claim whose seal was already checked."""
    if isinstance(event, ClaimSeen):
        c = event.claim
        if c.released:
            if state.phase is Phase.SERVING and c.job == state.job:
                return NodeState(state.node_id, state.nproc, Phase.STOPPING, state.job, state.claim_since,
                                 state.joined), StopSpare(f"{c.job} gave it back ({c.released})")
            if state.phase is Phase.IDLE:       # (a node that came back to a claim given back meanwhile)
                return state, BecomeIdle(f"{c.job} gave it back ({c.released})")
            return state, Keep(f"{c.job}'s claim is given back")
        if state.phase is not Phase.IDLE:
            if c.job == state.job:
                return state, Keep(f"still serving {c.job}")
            return state, Refuse(f"claimed by {c.job} while still serving {state.job}")
        if c.spec is None:
            return state, Refuse(f"the claim of {c.job} carries no job spec")
        if c.spec.nproc_per_node > state.nproc:
            return state, Refuse(f"{c.job} needs {c.spec.nproc_per_node} slots; this pool node has {state.nproc}")
        nxt = NodeState(state.node_id, state.nproc, Phase.SERVING, c.job, now)
        return nxt, StartSpare(c, f"claimed by {c.job} (priority {c.priority}): {c.reason}")
    if isinstance(event, ChildStarted):
        return state, Keep(f"its spare node is {event.agent} in {state.job}" if state.phase is Phase.SERVING
                           else "not serving")
    if isinstance(event, ChildJoined):
        if state.phase is Phase.SERVING:
            return NodeState(state.node_id, state.nproc, Phase.SERVING, state.job, state.claim_since, True), \
                Keep(f"joined {state.job} as its spare node")
        return state, Keep("not serving")
    if isinstance(event, ClaimGone):
        if state.phase is Phase.SERVING and not state.joined:
            return NodeState(state.node_id, state.nproc, Phase.STOPPING, state.job, state.claim_since), \
                StopSpare(f"the claim of {state.job} is gone before the node joined it ({event.why})")
        if state.phase is Phase.SERVING:
            # joined: the job holds it as one of its nodes (a member, maybe); it comes back when its spare node
            # exits (the job ended), never by pulling it out from under the job
            return state, Keep(f"{state.job}'s claim is gone ({event.why}); the node stays the job's until its "
                               "spare node exits")
        return state, Keep("no claim to lose")
    if isinstance(event, ChildExited):
        job = state.job
        idle = NodeState(state.node_id, state.nproc)
        if state.phase is Phase.IDLE:
            return idle, Keep("no spare node was running")
        return idle, BecomeIdle(f"the spare node of {job} exited ({event.code}): back to the pool")
    raise TypeError(f"not a pool node event: {event!r}")
