"""Pure decisions of a spare pool: (state, event, now) -> one typed action and its reason. No I/O here.

Two planners:

- :func:`plan_job`: a job's leader that needs replacement capacity. Own spares first (ready, then starting), the
  pool second (an idle node that fits, oldest idle first; else, with ``preempt``, a node held by a job of lower
  priority), a restart last, after waiting for the pool up to ``wait_limit``. Every action says why, in the words
  the console prints.
- :func:`plan_node`: a pool node. Idle until a claim (already checked: sealed with the pool key) names it; then it
  starts the claiming job's spare node (or, for a ``member`` claim, one of the job's member nodes); when the claim
  goes (its claimer's lease expired before the node joined), the job gives it back (a claim marked released: its
  ranks went home) or the spare node exits, it returns idle. A pre-emption request of a strictly higher priority
  stops a member node (SIGTERM, then SIGKILL after :data:`PREEMPT_GRACE_S`); the node is idle once it exited.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Mapping, Union

from tpassrun.records import IDLE, MEMBER, SPARE, Claim, PoolNode, PreemptRequest

# A pre-empted member node gets SIGTERM, and SIGKILL this long after if it has not exited: the whole pre-emption
# (request seen -> node idle) is bounded by it plus one etcd round trip.
PREEMPT_GRACE_S = 10.0


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
    preempts: Mapping[str, PreemptRequest] = field(default_factory=dict)


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
    victim_priority: int = 0


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


def idle_nodes(view: PoolView, nproc: int) -> list[PoolNode]:
    """The pool nodes free to claim with ``nproc`` slots: idle, unclaimed; idle longest first (pure)."""
    return sorted((n for n in view.nodes.values() if n.node_id not in view.claims and n.state == IDLE
                   and n.nproc >= nproc), key=lambda n: (n.since, n.node_id))


def plan_job(need: JobNeed, view: PoolView, now: float) -> JobAction:
    if need.own_ready >= need.nodes:
        return UseOwn(f"{need.own_ready} own spare node(s) ready")
    if need.own_ready + need.own_starting >= need.nodes:
        return UseOwn(f"own spare node(s) still starting ({need.own_starting}): waiting for them, not the pool")
    if not view.exists:
        return Restart("the spare pool does not exist")
    idle = idle_nodes(view, need.nproc)
    if idle:
        pick = idle[0]
        return ClaimNode(pick.node_id, f"no own spare ready; pool node {pick.node_id} is idle "
                                       f"({len(idle)} idle in the pool)")
    if need.preempt:
        # only lower-priority work (a member claim) is taken: a spare claim holds a node that replaces a failed one
        # of its job, and taking it would turn one failure into two
        victims = [c for c in view.claims.values() if c.job != need.job and c.priority < need.priority
                   and c.kind == MEMBER and not c.released
                   and c.node_id in view.nodes and view.nodes[c.node_id].nproc >= need.nproc]
        if victims:
            v = min(victims, key=lambda c: (c.priority, -c.since, c.node_id))
            return Preempt(v.node_id, v.job, f"the pool has no idle node; pre-empting pool node {v.node_id} from "
                                             f"job {v.job} (priority {v.priority} < {need.priority})",
                           victim_priority=v.priority)
    why = _none_free(need, view)
    waited = now - need.since
    if waited < need.wait_limit:
        return WaitForPool(f"{why}: waiting for the pool ({waited:.0f} of {need.wait_limit:.0f} s)")
    return Restart(f"{why} (waited {waited:.0f} s): restarting as torchrun does")


def _none_free(need: JobNeed, view: PoolView) -> str:
    """Why no pool node can be claimed for ``need`` (pure): "claimed" counts other jobs' claims only, never this
    job's own (one it holds for another loss, or one it has not dropped yet)."""
    fits = [n.node_id for n in view.nodes.values() if n.nproc >= need.nproc]
    if not view.nodes:
        return "the pool has no node"
    if not fits:
        return f"no pool node has {need.nproc} slots"
    jobs = [view.claims[n].job if n in view.claims else None for n in fits]
    others = sum(1 for j in jobs if j is not None and j != need.job)
    if others == len(fits):
        return f"all {len(fits)} pool node(s) are claimed"
    own, unclaimed = jobs.count(need.job), jobs.count(None)
    parts = [f"{others} claimed by other jobs" if others else "",
             f"{own} already this job's" if own else "",
             f"{unclaimed} not idle yet (starting, or serving a job whose claim is gone)" if unclaimed else ""]
    return f"no pool node is free ({', '.join(p for p in parts if p)})"


def plan_members(view: PoolView, want: int, nproc: int) -> tuple[list[str], str]:
    """A lower-priority elastic job's members at start (``--pool-members``): up to ``want`` idle pool nodes with
    ``nproc`` slots, idle longest first, and why (pure). Only idle nodes: lower-priority work never pre-empts."""
    picks = [n.node_id for n in idle_nodes(view, nproc)[:max(want, 0)]]
    if not view.exists:
        return [], "the spare pool does not exist"
    if not picks:
        return [], f"no idle pool node has {nproc} slots ({len(view.nodes)} node(s), {len(view.claims)} claimed)"
    return picks, f"{len(picks)} of {want} wanted: idle pool node(s) {', '.join(picks)}"


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
    priority: int = 0               # the claim's (what a pre-emption must be strictly above)
    kind: str = SPARE               # the claim's: only a MEMBER is ever pre-empted
    taken_by: str = ""              # STOPPING for a pre-emption: the job that takes the node
    given_back: str = ""            # STOPPING for a give-back: the job's reason (its ranks went home)


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


@dataclass(frozen=True)
class PreemptSeen:
    """A pre-emption request for this node; ``request`` is None when it was not sealed with the pool key
    (``problem`` says why)."""

    request: PreemptRequest | None
    problem: str = ""


NodeEvent = Union[ClaimSeen, ClaimGone, ChildStarted, ChildJoined, ChildExited, PreemptSeen]


@dataclass(frozen=True)
class StartSpare:
    claim: Claim
    reason: str


@dataclass(frozen=True)
class StopSpare:
    reason: str
    given_back: str = ""        # the job gave the node back (why): its spare node, holding no rank, leaves cleanly


@dataclass(frozen=True)
class Evict:
    """Stop the member node of ``victim`` (SIGTERM, SIGKILL after :data:`PREEMPT_GRACE_S`): ``request`` takes it."""

    request: PreemptRequest
    victim: str
    victim_priority: int
    reason: str


@dataclass(frozen=True)
class BecomeIdle:
    reason: str
    preempted_by: str = ""      # the job whose pre-emption this ends (its request is done with)


@dataclass(frozen=True)
class Refuse:
    reason: str


@dataclass(frozen=True)
class Keep:
    reason: str


NodeAction = Union[StartSpare, StopSpare, Evict, BecomeIdle, Refuse, Keep]


def preempt_refusal(serving: str | None, kind: str, priority: int, request: PreemptRequest) -> str:
    """Why ``request`` may not take a node running ``serving`` (a claim of ``kind`` at ``priority``); "" when it may.
    The pool node acts on it; the victim job's claimer reads it the same way (pure)."""
    if serving is None:
        return "the node runs no job"
    if request.job == serving:
        return f"{request.job} asks to pre-empt its own node"
    if kind != MEMBER:
        return f"it serves {serving} as a spare node (only lower-priority members are pre-empted)"
    if request.priority <= priority:
        return f"{request.job} (priority {request.priority}) is not above {serving} (priority {priority})"
    return ""


def plan_node(state: NodeState, event: NodeEvent, now: float) -> tuple[NodeState, NodeAction]:
    """The pool node's next state and what to do. ``ClaimSeen`` carries a claim whose seal was already checked."""
    if isinstance(event, ClaimSeen):
        c = event.claim
        if c.released:
            if state.phase is Phase.SERVING and c.job == state.job:
                return replace(state, phase=Phase.STOPPING, given_back=c.released), \
                    StopSpare(f"{c.job} gave it back ({c.released})", given_back=c.released)
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
        nxt = NodeState(state.node_id, state.nproc, Phase.SERVING, c.job, now, priority=c.priority, kind=c.kind)
        as_what = " as a member" if c.kind == MEMBER else ""
        return nxt, StartSpare(c, f"claimed by {c.job} (priority {c.priority}){as_what}: {c.reason}")
    if isinstance(event, PreemptSeen):
        req = event.request
        if req is None:
            return state, Refuse(f"a pre-emption request without the pool key's seal ({event.problem})")
        if state.phase is not Phase.SERVING:
            return state, Keep(f"{req.job} asks for this node: nothing to pre-empt ({state.phase.value})")
        why = preempt_refusal(state.job, state.kind, state.priority, req)
        if why:
            return state, Refuse(f"a pre-emption request of {req.job}: {why}")
        assert state.job is not None
        return replace(state, phase=Phase.STOPPING, taken_by=req.job), \
            Evict(req, state.job, state.priority, f"pre-empted by {req.job} (priority {state.priority} < "
                                                  f"{req.priority}): stopping the member node of {state.job}")
    if isinstance(event, ChildStarted):
        return state, Keep(f"its spare node is {event.agent} in {state.job}" if state.phase is Phase.SERVING
                           else "not serving")
    if isinstance(event, ChildJoined):
        if state.phase is Phase.SERVING:
            return replace(state, joined=True), \
                Keep(f"joined {state.job} as its {'member' if state.kind == MEMBER else 'spare'} node")
        return state, Keep("not serving")
    if isinstance(event, ClaimGone):
        if state.phase is Phase.SERVING and not state.joined:
            return replace(state, phase=Phase.STOPPING), \
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
        if state.taken_by:
            return idle, BecomeIdle(f"the member node of {job} exited ({event.code}): back to the pool for "
                                    f"{state.taken_by}", preempted_by=state.taken_by)
        what = "member" if state.kind == MEMBER else "spare"
        if state.given_back:
            return idle, BecomeIdle(f"the {what} node of {job} left, given back ({state.given_back}; exit "
                                    f"{event.code}): back to the pool")
        return idle, BecomeIdle(f"the {what} node of {job} exited ({event.code}): back to the pool")
    raise TypeError(f"not a pool node event: {event!r}")
