"""The swap planner: pure decisions, no I/O.

Every function here takes the state it needs (plans, reports, the cluster view) and returns a decision with a
human-readable reason; the effects (etcd writes, commands to workers) live in :mod:`tpassrun.swapper`.

A swap moves one rank from a *leaver* slot to a *joiner* slot (a warm spare). Its phases, in order:

====================  ==========================================================================
``pause``             every agent stops its active workers at their next step start and reports
                      the earliest boundary it can offer
``boundary``          every agent lets its workers run up to the agreed step B and reports all paused at B
``transfer``          the joiner listens; its agent reports the address (and, unplanned, the dead
                      rank's light snapshot is attached by the dead rank's agent)
``send``              the leaver (planned) or a donor replica (unplanned) streams its state to the joiner
``reform``            the generation is committed; every rank joins the new world; the leaver exits
``done``/``aborted``  terminal
====================  ==========================================================================

A *node plan* (:func:`plan_for_node_loss`) moves every rank of a lost node at once, through the same phases:
in PAUSE every surviving node also says which light copies its mirror holds for the lost ranks
(:func:`resume_step_node` picks the step and where each rank's state comes from); in TRANSFER every joiner
node hands its spares their ranks; in SEND several donors stream in parallel (one per joiner, spread over the
surviving nodes) while the joiners' agents fetch the light state from the buddy's mirror; REFORM re-forms the
world with the joiners in the lost ranks' places. It is never retried: a failure aborts it, and the group
restarts (what torchrun would have done from the start).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from tpassrun.plan.catchup import leaders_donate, roll_forward
from tpassrun.plan.node_shards import replica_held, sharded_resume
from tpassrun.plan.resume import ResumeChoice, resume_plan, resume_step

# The records a plan is made of live with every other etcd record; re-exported: they are the planner's words.
from tpassrun.records import TRANSITIONS, Move, Phase, Report, SlotRef, SwapKind, SwapPlan

__all__ = ["ClusterView", "Decision", "MAX_SEND_ATTEMPTS", "Move", "PHASE_TIMEOUT_S", "Phase", "REPORT_DEADLINE_S",
           "Report", "ResumeChoice", "SILENT", "SlotRef", "SlotView", "SwapKind", "SwapPlan", "TRANSITIONS",
           "choose_donor", "choose_spare", "lost_ranks", "new_swap_id", "next_step", "node_plan_id",
           "plan_for_dead_ranks", "plan_for_failure", "plan_for_node_loss", "plan_for_taint", "resume_plan",
           "resume_step", "resume_step_node", "transfer_key"]


@dataclass(frozen=True)
class SlotView:
    """One worker slot as its agent publishes it in ``status/<node>``."""

    node: str
    slot: int
    rank: int | None
    state: str               # running | spare | quarantined | dead | done | leaving (| joining: triage's own mark)
    managed: bool
    step: int = 0
    replicas: tuple[int, ...] | None = None   # its declared replica group (None: every rank holds its state)
    sharded: bool = False      # it tracks sharded state (sess.track_sharded): local copies, a mirror at its buddy


@dataclass(frozen=True)
class ClusterView:
    generation: int
    members: tuple[str, ...]          # member node ids (group rank order)
    spare_nodes: tuple[str, ...]
    slots: tuple[SlotView, ...]
    lost: tuple[str, ...] = ()        # nodes whose lease expired in this generation
    homes: tuple[tuple[int, str, int], ...] = ()   # (rank, node, slot) where the generation placed each rank

    def slot_at(self, node: str, slot: int) -> SlotView | None:
        return next((s for s in self.slots if s.node == node and s.slot == slot), None)

    def slot_of_rank(self, rank: int) -> SlotView | None:
        for s in self.slots:
            if s.rank == rank and s.state in ("running", "done", "joining"):
                return s
        return None


@dataclass(frozen=True)
class Decision:
    action: str                # "plan" | "wait" | "reject" | "fallback" | SILENT (a plan given up: nobody answered)
    reason: str
    plan: SwapPlan | None = None


def _spares(view: ClusterView, near: str, excluded: Iterable[tuple[str, int]] = ()) -> list[SlotView]:
    banned = {tuple(x) for x in excluded}
    spares = [s for s in view.slots if s.state == "spare" and (s.node, s.slot) not in banned]
    # A spare that already said hello (torch imported, waiting in tpassrun.init) beats one still starting, wherever
    # it is: a spare that was just started again (a slot back in the pool after a swap) takes seconds to tens of
    # seconds to import torch on a loaded host, which the swap then waited for (a taint storm's later swaps took a
    # cold spare on their own node over a ready one next door); a cross-node transfer costs far less. Then the
    # same node (no cross-node transfer), then other member nodes, then spare nodes.
    order = {n: i for i, n in enumerate(view.members)}
    return sorted(spares, key=lambda s: (not s.managed, s.node != near, s.node in view.spare_nodes,
                                         order.get(s.node, 1 << 30), s.node, s.slot))


def choose_spare(view: ClusterView, near: str, excluded: Iterable[tuple[str, int]] = ()) -> SlotView | None:
    found = _spares(view, near, excluded)
    return found[0] if found else None


def choose_donor(view: ClusterView, dead_rank: int, near: str,
                 replicas: Sequence[int] | None = None) -> SlotView | None:
    """A live managed rank holding the dead rank's model and optimizer: any rank under plain data parallelism,
    one of ``replicas`` when the dead rank's adapter declared its replica group (HSDP: the rank with the same
    shard coordinates in another replica group). Prefer the joiner's node so the bulk of the transfer stays
    local."""
    live = [s for s in view.slots if s.rank is not None and s.rank != dead_rank and s.state == "running"
            and s.managed and (replicas is None or s.rank in replicas)]
    live.sort(key=lambda s: (s.node != near, s.rank))
    return live[0] if live else None


def new_swap_id() -> str:
    return "s-" + uuid.uuid4().hex[:8]


def plan_for_taint(view: ClusterView, *, node: str, rank: int, reason: str, taint_id: str | None,
                   now_wall: float, swap_id: str | None = None,
                   home: tuple[str, int] | None = None) -> Decision:
    """A taint on a live, managed rank: plan a cooperative migration to a spare.

    ``home`` (migrate-back): the rank goes to that slot only, once it is a ready spare again, and the slot it
    leaves is returned to the pool instead of quarantined.
    """
    leaver = view.slot_of_rank(rank)
    if leaver is None:
        return Decision("reject", f"rank {rank} is not running in generation {view.generation}")
    if not leaver.managed:
        return Decision("fallback", f"rank {rank} does not use tpassrun.init(): restart the group without the "
                                    "tainted slot")
    if home is not None:
        spare = next((s for s in view.slots if (s.node, s.slot) == tuple(home) and s.state == "spare"
                      and s.managed), None)
        if spare is None:
            return Decision("wait", f"rank {rank} waits for its home slot {home[0]}/{home[1]} to be a ready spare")
    else:
        spare = choose_spare(view, leaver.node)
    if spare is None:
        return Decision("wait", f"no spare available for rank {rank}; the swap waits for one")
    if not spare.managed:
        # Only spares still starting (back in the pool after a swap: importing torch, up to tens of seconds on a
        # loaded host). A planned swap waits for one with the job training: planned now, every rank would sit
        # paused at the boundary until the spare is ready.
        return Decision("wait", f"no ready spare for rank {rank} (spare {spare.node}/{spare.slot} is still "
                                "starting); the swap waits for it")
    plan = SwapPlan(
        id=swap_id or new_swap_id(), kind=SwapKind.PLANNED, generation=view.generation,
        leaver=SlotRef(leaver.node, leaver.slot, rank), joiner=SlotRef(spare.node, spare.slot, rank), donor=None,
        phase=Phase.PAUSE, reason=reason, nodes=_involved(view, spare.node), taint_id=taint_id,
        release=home is not None, history=((Phase.PAUSE.value, now_wall),),
    )
    return Decision("plan", f"migrate rank {rank} from {leaver.node}/{leaver.slot} to spare "
                            f"{spare.node}/{spare.slot}: {reason}", plan)


def plan_for_failure(view: ClusterView, *, node: str, slot: int, rank: int, reason: str, now_wall: float,
                     light_available: bool, swap_id: str | None = None, replicas: Sequence[int] | None = None,
                     alone: str = "", sharded: bool = False) -> Decision:
    """A managed rank died: replace it from a data-parallel replica, or say why we must restart.

    ``replicas``: the dead rank's declared replica group (None: every rank holds its state); ``alone``: why no
    other rank does, quoted when it is the only member. ``sharded``: the dead rank kept copies of its sharded state
    (``sess.track_sharded``), so when it is alone in its group its shard may come from a mirror (the PAUSE phase
    finds out, :func:`resume_plan`) and the rest of its state, identical on every rank, from any of them."""
    spare = choose_spare(view, node)
    if spare is None:
        return Decision("fallback", f"rank {rank} died and no spare is left: whole-group restart")
    if sharded and replicas is not None and not set(replicas) - {rank}:
        replicas = None
    donor = choose_donor(view, rank, spare.node, replicas)
    if donor is None:
        others = sorted(set(replicas or ()) - {rank})
        if replicas is not None and not others:
            why = f": {alone}" if alone else " (its state is sharded without a replica)"
            return Decision("fallback", f"rank {rank} died and no other rank holds its state{why}: whole-group "
                                        "restart")
        if others:
            return Decision("fallback", f"rank {rank} died and none of the ranks holding its state "
                                        f"({', '.join(map(str, others))}) is running: whole-group restart")
        return Decision("fallback", f"rank {rank} died and no live replica can donate its state")
    # Without a snapshot (it died before its first step) the rank can still be replaced at step 0: the
    # joiner's script builds the same per-rank state the dead one had. The PAUSE phase decides.
    plan = SwapPlan(
        id=swap_id or new_swap_id(), kind=SwapKind.UNPLANNED, generation=view.generation,
        leaver=SlotRef(node, slot, rank), joiner=SlotRef(spare.node, spare.slot, rank),
        donor=SlotRef(donor.node, donor.slot, donor.rank), phase=Phase.PAUSE, reason=reason,
        nodes=_involved(view, spare.node), history=((Phase.PAUSE.value, now_wall),),
        replica_held=(rank,) if sharded and set(replicas or ()) - {rank} else (),
    )
    return Decision("plan", f"replace dead rank {rank} by spare {spare.node}/{spare.slot}, state from rank "
                            f"{donor.rank} on {donor.node}: {reason}", plan)


def _involved(view: ClusterView, joiner_node: str) -> tuple[str, ...]:
    return involved(view, (joiner_node,))


def involved(view: ClusterView, joiner_nodes: Iterable[str] = (), without: Iterable[str] = ()) -> tuple[str, ...]:
    """The nodes a plan pauses and re-forms (pure): the live members, every other live node that runs a rank now
    (a spare node that took one in an earlier swap), then the joiners' nodes. Every node that runs a rank is in:
    one left out would go on stepping into a collective nobody else joins, and the world would never re-form."""
    skip = set(view.lost) | set(without)
    nodes = [n for n in view.members if n not in skip]
    hosting = sorted({s.node for s in view.slots if s.rank is not None and s.state in ("running", "joining")})
    for n in (*hosting, *joiner_nodes):
        if n not in nodes and n not in skip:
            nodes.append(n)
    return tuple(nodes)


# --------------------------------------------------------------------------------------------- node loss
def node_plan_id(node: str) -> str:
    """One node plan per lost node, ever (node ids are unique per agent): a second look finds it done."""
    return f"n-{node}"


def lost_ranks(view: ClusterView, node: str) -> list[tuple[int, int]]:
    """(rank, slot) of every rank the generation placed on ``node`` that no live slot holds now."""
    return sorted((rank, slot) for rank, where, slot in view.homes
                  if where == node and view.slot_of_rank(rank) is None)


def _node_joiners(view: ClusterView, lost: str, n: int) -> list[SlotView] | None:
    """``n`` spare slots off the lost node: all on one spare node when one has enough ready ones (it then takes
    the lost node's place, as one more node of the same shape would), else ready ones wherever they are. Short of
    ready ones, spares still starting make up the rest (a spare node started a moment ago, a slot back in the pool
    after a swap): the plan's joiners are waited for as a single rank's recovery waits for its joiner, seconds,
    where a whole-group restart would redo every step since the last checkpoint."""
    usable = [s for s in view.slots if s.state == "spare" and s.node != lost and s.node not in view.lost]
    ready = [s for s in usable if s.managed]
    by_node: dict[str, list[SlotView]] = {}
    for s in ready:
        by_node.setdefault(s.node, []).append(s)
    for node in sorted(by_node, key=lambda x: (x not in view.spare_nodes, x in view.members, x)):
        if node not in view.members and len(by_node[node]) >= n:
            return sorted(by_node[node], key=lambda s: s.slot)[:n]
    spread = _spares(view, near="", excluded=[(s.node, s.slot) for s in view.slots if s not in usable])
    return spread[:n] if len(spread) >= n else None     # (ready ones first: _spares orders them so)


def _interleaved_donors(view: ClusterView, lost: str, rank: int | None = None) -> list[SlotView]:
    """Live managed ranks ordered to spread the transfers: one per node in turn (several donors in parallel,
    each streaming to one joiner, the bulk leaving from as many nodes as there are). With ``rank``: only those
    holding that rank's state (a declared replica group that names it, or none declared: data parallel)."""
    # (a rank alone in its replica group with sharded state, ZeRO's or pure FSDP's: its shard comes from its
    # mirror, the rest of its state, replicated on every rank, from any other such rank)
    live = [s for s in view.slots if s.rank is not None and s.state == "running" and s.node != lost
            and s.node not in view.lost and (rank is None or s.replicas is None or rank in s.replicas
                                             or (s.sharded and s.replicas == (s.rank,)))]
    by_node: dict[str, list[SlotView]] = {}
    for s in sorted(live, key=lambda s: s.rank or 0):
        by_node.setdefault(s.node, []).append(s)
    out: list[SlotView] = []
    queues = [by_node[n] for n in sorted(by_node)]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def plan_for_node_loss(view: ClusterView, *, node: str, now_wall: float, swap_id: str | None = None) -> Decision:
    """A whole node is gone (its lease expired): plan to move all its ranks at once, or say why the group must
    restart. ``none``: the node held no ranks (an idle spare node): nothing to recover."""
    lost = lost_ranks(view, node)
    if not lost:
        return Decision("none", f"node {node} held no ranks: nothing to recover")
    ranks = [r for r, _slot in lost]
    donors = _interleaved_donors(view, node)
    if not donors:
        return Decision("fallback", f"node {node} lost with ranks {ranks} and no rank survived elsewhere")
    unmanaged = sorted({d.rank for d in donors if not d.managed and d.rank is not None})
    if unmanaged:
        return Decision("fallback", f"node {node} lost: ranks {unmanaged} do not use tpassrun.init(), no live "
                                    "recovery")
    joiners = _node_joiners(view, node, len(lost))
    if joiners is None:
        have = len([s for s in view.slots if s.state == "spare" and s.node != node and s.node not in view.lost])
        return Decision("fallback", f"node {node} lost with {len(lost)} ranks {ranks}; only {have} spare "
                                    f"slot(s) elsewhere")
    chosen: list[SlotView] = []
    used: dict[tuple[str, int], int] = {}
    for rank, _slot in lost:
        holders = _interleaved_donors(view, node, rank)
        if not holders:
            return Decision("fallback", f"node {node} lost: no surviving rank holds rank {rank}'s state (its "
                                        "replica group was on that node, or its state is sharded without one)")
        # the least used holder first: one donor per joiner while there are enough of them
        donor = holders[min(range(len(holders)), key=lambda i: (used.get((holders[i].node, holders[i].slot), 0), i))]
        used[(donor.node, donor.slot)] = used.get((donor.node, donor.slot), 0) + 1
        chosen.append(donor)
    moves = tuple(Move(SlotRef(node, slot, rank), SlotRef(j.node, j.slot, rank),
                       SlotRef(d.node, d.slot, d.rank))
                  for (rank, slot), j, d in zip(lost, joiners, chosen))
    where = sorted({j.node for j in joiners})
    replaces = where[0] if len(where) == 1 and where[0] not in view.members else None
    nodes = list(involved(view, where, without=(node,)))
    first = moves[0]
    plan = SwapPlan(id=swap_id or node_plan_id(node), kind=SwapKind.NODE, generation=view.generation,
                    leaver=first.leaver, joiner=first.joiner, donor=first.donor, phase=Phase.PAUSE,
                    reason=f"node {node} lost", nodes=tuple(nodes), history=((Phase.PAUSE.value, now_wall),),
                    moves=moves, lost_node=node, replaces=replaces, replica_held=replica_held(view.slots, view.lost, ranks))
    donors_used = sorted({m.donor.rank for m in moves if m.donor is not None and m.donor.rank is not None})
    return Decision("plan", f"node {node} lost: ranks {ranks} to spare slots on {', '.join(where)}, state from "
                            f"ranks {donors_used} in parallel and from the buddy's mirror", plan)


def plan_for_dead_ranks(view: ClusterView, dead: Sequence[tuple[str, int, int]], *, reason: str, now_wall: float,
                        swap_id: str) -> Decision:
    """Several managed ranks dead at once (a second fault during a recovery: its donor, or another rank, died
    while it ran): plan to replace all of them in one re-formed world, as a node plan does, each from a live
    replica and its own agent's copy of its light state; or say why the group must restart (pure)."""
    ranks = sorted(rank for _node, _slot, rank in dead)
    excluded: list[tuple[str, int]] = []
    moves: list[Move] = []
    used: dict[tuple[str, int], int] = {}
    for node, slot, rank in sorted(dead, key=lambda d: d[2]):
        spare = choose_spare(view, node, excluded)
        if spare is None:
            return Decision("fallback", f"ranks {ranks} died and only {len(moves)} spare(s) are left: "
                                        "whole-group restart")
        excluded.append((spare.node, spare.slot))
        holders = [s for s in _interleaved_donors(view, "", rank) if s.managed and s.rank not in ranks]
        if not holders:
            return Decision("fallback", f"ranks {ranks} died and no live replica holds rank {rank}'s state")
        donor = holders[min(range(len(holders)), key=lambda i: (used.get((holders[i].node, holders[i].slot), 0),
                                                                 holders[i].node != spare.node, i))]
        used[(donor.node, donor.slot)] = used.get((donor.node, donor.slot), 0) + 1
        moves.append(Move(SlotRef(node, slot, rank), SlotRef(spare.node, spare.slot, rank),
                          SlotRef(donor.node, donor.slot, donor.rank)))
    nodes = list(involved(view, [m.joiner.node for m in moves]))
    first = moves[0]
    plan = SwapPlan(id=swap_id, kind=SwapKind.NODE, generation=view.generation, leaver=first.leaver,
                    joiner=first.joiner, donor=first.donor, phase=Phase.PAUSE, reason=reason, nodes=tuple(nodes),
                    history=((Phase.PAUSE.value, now_wall),), moves=tuple(moves),
                    replica_held=replica_held(view.slots, view.lost, ranks))
    donors = sorted({m.donor.rank for m in moves if m.donor is not None and m.donor.rank is not None})
    return Decision("plan", f"replace dead ranks {ranks} by spares "
                            f"{', '.join(f'{m.joiner.node}/{m.joiner.slot}' for m in moves)}, state from ranks "
                            f"{donors}: {reason}", plan)


def resume_step_node(reports: Sequence[Report], ranks: Sequence[int],
                     at: int | None = None) -> tuple[int | None, dict[int, str], str]:
    """The step a node plan resumes at and, for each lost rank, the node whose mirror holds its light state for
    that step; or None and why not (pure). The survivors' rule is :func:`resume_step`'s (``at``: the step a
    mixed commit rolls forward to, :func:`tpassrun.plan.catchup.roll_forward`)."""
    step, why = (at, f"the survivors catch up to step {at}") if at is not None else resume_step(reports, None)
    if step is None:
        return None, {}, why
    light_from: dict[int, str] = {}
    for rank in ranks:
        held = [(r.node, set(r.held.get(rank, ()))) for r in sorted(reports, key=lambda r: r.node)]
        having = [node for node, steps in held if step in steps]
        if having:
            light_from[rank] = having[0]
            continue
        seen = sorted(set().union(*(steps for _n, steps in held)))
        if step == 0 and not seen:
            continue   # died before its first snapshot: the joiner's script builds the same state at step 0
        if seen:
            return None, {}, (f"the mirror holds rank {rank}'s state for steps {seen}, the survivors stopped at "
                              f"step {step}")
        return None, {}, (f"no copy of rank {rank}'s per-rank state survived (its buddy node is lost too, or "
                          "its copies never reached it)")
    return step, light_from, f"all survivors stopped at step {step}; ranks {list(ranks)} resume there from the mirror"


def _next_node_step(plan: SwapPlan, mine: Sequence[Report], now_wall: float, sender_dead: bool) -> Decision:
    """:func:`next_step` for a node plan: no retries (any failure aborts: the group restarts)."""
    def abort(why: str) -> Decision:
        return Decision("plan", f"aborted: {why}", plan.advance(Phase.ABORTED, now_wall, outcome=why))

    if sender_dead and plan.phase in (Phase.TRANSFER, Phase.SEND):   # its failure supersedes the plan (triage)
        return Decision("wait", "a donor died while handing over the state: every loss is planned again")
    bad = [r for r in mine if not r.ok]
    if bad:
        return abort(f"{plan.phase.value}: {bad[0].node}: {bad[0].error}")
    joiner_nodes = {m.joiner.node for m in (*plan.moves, *plan.catch_up)}
    needed = joiner_nodes if plan.phase in (Phase.TRANSFER, Phase.SEND) else set(plan.nodes)
    if plan.phase == Phase.TRANSFER and plan.restore:
        needed = needed | set(plan.nodes)      # every survivor rolled back to its copy before a donor sends
    have = {r.node for r in mine}
    if not needed <= have:
        return silent(plan, needed - have, now_wall)
    if plan.phase == Phase.PAUSE:
        sharded = (None if set(plan.ranks) <= set(plan.replica_held)    # HSDP: from live replicas, as below
                   else sharded_resume(mine, plan.ranks, *resume_step(mine, None)))
        if sharded is not None:     # the lost ranks' shards come from their mirrors (tpassrun/plan/node_shards.py)
            if sharded.step is None:
                return abort(sharded.why)
            return Decision("plan", sharded.why, plan.advance(Phase.TRANSFER, now_wall, boundary=sharded.step,
                                                              restore=sharded.restore, shards_from=sharded.shards_from))
        step, light_from, why = resume_step_node(mine, plan.ranks)
        if step is None:
            forward = roll_forward(mine)        # a mixed commit: the laggards catch up from the leaders
            if forward.step is None:
                return abort(why if "mixed commit" not in forward.why else forward.why)
            step, light_from, why2 = resume_step_node(mine, plan.ranks, at=forward.step)
            if step is None:
                return abort(f"{forward.why}; but {why2}")
            return Decision("plan", forward.why, plan.advance(
                Phase.TRANSFER, now_wall, boundary=step, light_from=light_from, catch_up=forward.moves,
                moves=leaders_donate(plan.moves, forward.moves)))
        return Decision("plan", why, plan.advance(Phase.TRANSFER, now_wall, boundary=step, light_from=light_from))
    if plan.phase == Phase.TRANSFER:
        addrs = {rank: addr for r in mine for rank, addr in r.joiner_addrs.items()}
        missing = [m.rank for m in (*plan.moves, *plan.catch_up) if m.rank not in addrs]
        if missing:
            return abort(f"no joiner listened for ranks {missing}")
        moves = tuple(dataclasses.replace(m, joiner_addr=addrs[m.rank]) for m in plan.moves)
        catch_up = tuple(dataclasses.replace(m, joiner_addr=addrs[m.rank]) for m in plan.catch_up)
        return Decision("plan", f"{len(moves)} joiners, {len(catch_up)} survivors catching up listening",
                        plan.advance(Phase.SEND, now_wall, moves=moves, catch_up=catch_up))
    if plan.phase == Phase.SEND:
        return Decision("plan", "every joiner received and verified its state", plan.advance(Phase.REFORM, now_wall))
    if plan.phase == Phase.REFORM:
        return Decision("plan", "world re-formed; training resumed", plan.advance(Phase.DONE, now_wall))
    return Decision("wait", f"nothing to do in {plan.phase.value}")


MAX_SEND_ATTEMPTS = 4
PHASE_TIMEOUT_S = 120.0        # how long a participant waits for its workers in one phase
# how long the leader waits for a participant's report in one phase: past every wait a live participant makes in
# a phase (a transfer's accept is 3 x PHASE_TIMEOUT_S), so only one that never answers (alive, its lease kept, but
# its swapper stuck or deaf) meets it; a participant that dies or stops is lost with its lease, much sooner
REPORT_DEADLINE_S = 5 * PHASE_TIMEOUT_S
SILENT = "silent"              # a Decision's action: given up because a participant never reported


def silent(plan: SwapPlan, missing: Iterable[str], now_wall: float) -> Decision:
    """Wait for the participants that have not reported yet, or give the plan up once the phase is older than
    :data:`REPORT_DEADLINE_S`, naming them (pure)."""
    who, since = sorted(missing), now_wall - plan.history[-1][1]
    if since < REPORT_DEADLINE_S:
        return Decision("wait", f"{plan.phase.value}: waiting for {who}")
    why = f"{', '.join(who)} did not answer in {plan.phase.value} within {since:.0f} s"
    return Decision(SILENT, f"aborted: {why}", plan.advance(Phase.ABORTED, now_wall, outcome=why))


def next_step(plan: SwapPlan, reports: Sequence[Report], now_wall: float,
              spare_after_failure: SlotView | None = None, sender_dead: bool = False,
              joiner_gone: bool = False) -> Decision:
    """The leader's move once reports for the plan's current phase are in (pure).

    ``sender_dead``: the rank that streams the state (the leaver of a planned swap, the donor of an
    unplanned one) died during TRANSFER/SEND. Retrying cannot help. A planned swap is aborted at once,
    whatever was reported, and its leaver's failure is then recovered from a replica (an unplanned recovery)
    instead of waiting out timeouts. An unplanned recovery waits for the donor's failure record: the triage
    then supersedes it and plans every dead rank again at once, from the replicas left (it retries from
    another replica; the joiner drops the partial bundle when it is told to abort or given a new assignment).
    ``joiner_gone``: the joiner died, and ``spare_after_failure`` is the next spare (None: none is left, the
    attempt is given up instead of being retried with a dead joiner).
    """
    mine = [r for r in reports if r.phase == plan.phase]
    if plan.phase in (Phase.DONE, Phase.ABORTED):
        return Decision("wait", "terminal")
    if plan.kind == SwapKind.NODE:
        return _next_node_step(plan, mine, now_wall, sender_dead)
    if sender_dead and plan.phase in (Phase.TRANSFER, Phase.SEND):
        sender = plan.leaver if plan.kind == SwapKind.PLANNED else plan.donor
        who = f"rank {sender.rank}" if sender is not None else "the sender"
        if plan.kind != SwapKind.PLANNED:     # its failure supersedes the plan (triage)
            return Decision("wait", f"{who} (the donor) died while handing over the state: every dead rank is "
                                    "planned again once its failure is read")
        return Decision("plan", f"{who} died while handing over the state: aborted",
                        plan.advance(Phase.ABORTED, now_wall))
    bad = [r for r in mine if not r.ok]
    if plan.phase in (Phase.TRANSFER, Phase.SEND) and any(r.final for r in bad):
        err = next(r.error for r in bad if r.final)
        return Decision("plan", f"aborted (not retried, it cannot succeed): {err}",
                        plan.advance(Phase.ABORTED, now_wall, outcome=err))
    if plan.phase in (Phase.TRANSFER, Phase.SEND) and bad:
        # The joiner died or the bytes were corrupt: try again (another spare if the joiner is gone).
        if joiner_gone and spare_after_failure is None:
            return Decision("plan", f"the joiner died and no other spare is left: {bad[0].error}",
                            plan.advance(Phase.ABORTED, now_wall))
        if plan.attempt + 1 >= MAX_SEND_ATTEMPTS:
            return Decision("plan", f"giving up after {plan.attempt + 1} attempts: {bad[0].error}",
                            plan.advance(Phase.ABORTED, now_wall))
        if spare_after_failure is not None:
            joiner = SlotRef(spare_after_failure.node, spare_after_failure.slot, plan.joiner.rank)
            # the new joiner's node re-forms with the others: a spare node that runs no rank is not among the plan's
            # nodes yet, and left out, its spare would never get its Reform (the world would wait for it)
            nodes = plan.nodes if joiner.node in plan.nodes else (*plan.nodes, joiner.node)
            return Decision("plan", f"retry with spare {joiner.node}/{joiner.slot}: {bad[0].error}",
                            plan.advance(Phase.TRANSFER, now_wall, joiner=joiner, joiner_addr=None,
                                         attempt=plan.attempt + 1, nodes=tuple(nodes),
                                         excluded_spares=plan.excluded_spares + ((plan.joiner.node,
                                                                                  plan.joiner.slot),)))
        return Decision("plan", f"retry the transfer: {bad[0].error}",
                        plan.advance(Phase.TRANSFER, now_wall, joiner_addr=None, attempt=plan.attempt + 1))
    if bad:
        return Decision("plan", f"aborted in {plan.phase.value}: {bad[0].node}: {bad[0].error}",
                        plan.advance(Phase.ABORTED, now_wall))
    needed = set(plan.nodes) if plan.phase in (Phase.PAUSE, Phase.BOUNDARY, Phase.REFORM) else set()
    if plan.phase == Phase.TRANSFER:
        needed = {plan.joiner.node}
        if plan.kind == SwapKind.UNPLANNED:
            needed.add(plan.leaver.node)
        if plan.restore:
            needed |= set(plan.nodes)     # every survivor rolled back before the donor sends
    if plan.phase == Phase.SEND:
        needed = {plan.joiner.node}
    if plan.phase in (Phase.TRANSFER, Phase.SEND):
        needed |= {m.joiner.node for m in plan.catch_up}     # a mixed commit: survivors moved to the boundary
    have = {r.node for r in mine}
    if not needed <= have:
        return silent(plan, needed - have, now_wall)

    if plan.phase == Phase.PAUSE:
        if plan.kind == SwapKind.UNPLANNED:
            choice = resume_plan(mine, plan.leaver.rank, replica_held=plan.leaver.rank in plan.replica_held)
            if choice.step is None:
                return Decision("plan", choice.why, plan.advance(Phase.ABORTED, now_wall, outcome=choice.why))
            return Decision("plan", choice.why, plan.advance(Phase.TRANSFER, now_wall, boundary=choice.step,
                                                             restore=choice.restore, shard_from=choice.shard_from,
                                                             shard_node=choice.shard_node, catch_up=choice.catch_up,
                                                             donor=choice.donor or plan.donor))
        boundary = max((r.candidate or 0) for r in mine)
        return Decision("plan", f"boundary step {boundary}", plan.advance(Phase.BOUNDARY, now_wall, boundary=boundary))
    if plan.phase == Phase.BOUNDARY:
        over = max((r.candidate or 0) for r in mine)
        if plan.boundary is not None and over > plan.boundary:
            return Decision("plan", f"a rank was already past {plan.boundary}: boundary moved to {over}",
                            plan.advance(Phase.BOUNDARY, now_wall, boundary=over))
        return Decision("plan", f"every rank paused at step {plan.boundary}", plan.advance(Phase.TRANSFER, now_wall))
    if plan.phase == Phase.TRANSFER:
        addr = next((r.joiner_addr for r in mine if r.joiner_addr), None)
        light = next((r.light_b64 for r in mine if r.light_b64), None)
        if addr is None:
            return Decision("wait", "joiner has not reported its address")
        if plan.kind == SwapKind.UNPLANNED and light is None and plan.boundary and plan.shard_from is None:
            why = f"the dead rank's snapshot for step {plan.boundary} is missing"
            return Decision("plan", why, plan.advance(Phase.ABORTED, now_wall, outcome=why))
        listening = {rank: a for r in mine for rank, a in r.joiner_addrs.items()}
        missing = [m.rank for m in plan.catch_up if m.rank not in listening]
        if missing:
            why = f"ranks {missing} did not listen for the replicated state of step {plan.boundary}"
            return Decision("plan", why, plan.advance(Phase.ABORTED, now_wall, outcome=why))
        catch_up = tuple(dataclasses.replace(m, joiner_addr=listening[m.rank]) for m in plan.catch_up)
        return Decision("plan", f"joiner listening at {addr[0]}:{addr[1]}",
                        plan.advance(Phase.SEND, now_wall, joiner_addr=addr, light_b64=light, catch_up=catch_up))
    if plan.phase == Phase.SEND:
        return Decision("plan", "state received and verified", plan.advance(Phase.REFORM, now_wall))
    if plan.phase == Phase.REFORM:
        return Decision("plan", "world re-formed; training resumed", plan.advance(Phase.DONE, now_wall))
    return Decision("wait", f"nothing to do in {plan.phase.value}")


def world_prefix(plan: SwapPlan) -> str:
    """The store prefix of the world ``plan`` re-forms (one per attempt: a given-up world is never joined again)."""
    return f"/tpassrun/{plan.id}/{plan.attempt}/"


def of_attempt(plan: SwapPlan) -> Callable[[object], bool]:
    """Whether a joiner's reply (``Listening``, ``Received``, ``Stranger``) answers this very attempt of ``plan``:
    a late reply to an attempt given up is never paired with the next one."""
    return lambda msg: getattr(msg, "swap_id", None) == plan.id and getattr(msg, "attempt", None) == plan.attempt


def transfer_key(plan: SwapPlan) -> str | None:
    """This attempt's transfer key (hex): a fresh key per attempt, derived from the plan's transfer seed (the run
    key and the plan's secret: tpassrun/records/provenance.py), or from its secret alone in a run without a run key."""
    if not plan.secret:
        return None
    try:
        secret = bytes.fromhex(plan.transfer_seed or plan.secret)
    except ValueError:
        return None
    return hmac.new(secret, f"tpassrun-transfer/{plan.id}/{plan.attempt}".encode(), hashlib.sha256).hexdigest()
