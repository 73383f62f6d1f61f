"""The triage's view of a world that was re-forming when something else failed (pure, no I/O).

While a swap re-forms the world, its joiner holds its rank's state as received bytes, not loaded yet: it can
neither donate nor serve as a spare, and it holds that rank (no later plan may move the rank again). A rank that
dies there, or a node lost there, supersedes the swap when the next plan can recover what is gone (every rank
stops joining and waits where it stopped, the joiners keep what they received, and the next plan's world takes
them in); otherwise the group restarts, saying why. :func:`tpassrun.plan.triage.triage` calls these.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tpassrun.plan.actions import Action, CasPlan, PutFailure, PutFallback, RestartGroup, Say, Seen
from tpassrun.plan.multiloss import plan_for_losses
from tpassrun.plan.swap import ClusterView, Decision, lost_ranks, plan_for_dead_ranks, plan_for_failure
from tpassrun.records import Failure, Fallback, Phase, SwapKind, SwapPlan


def needs(plan: SwapPlan) -> set[str]:
    """The nodes a plan cannot finish without."""
    nodes = set(plan.nodes) | {m.joiner.node for m in plan.all_moves}
    nodes |= {m.donor.node for m in plan.all_moves if m.donor is not None}
    if plan.kind == SwapKind.PLANNED and plan.phase != Phase.REFORM:   # (in REFORM its leaver is gone already)
        nodes.add(plan.leaver.node)
    return nodes


def runs_elsewhere(f: Failure, view: ClusterView, failures: Sequence[tuple[str, Failure]] = ()) -> str:
    """Why ``f`` is moot because its rank runs in another slot now ("" if it is not): the death was reported
    late, by a node whose ranks were all moved meanwhile (cut off from etcd, it wrote the record when the link
    came back; its agent drops such writes now, tpassrun/swapper/__init__.py, but a record from an older agent may still
    come). A slot that has died with that rank since (among ``failures``: a joiner that died on its way into the
    world, whose status may still say it runs the rank) holds nothing."""
    held = view.slot_of_rank(f.rank)
    if held is None or (held.node, held.slot) == (f.node, f.slot):
        return ""
    if any((g.node, g.slot) == (held.node, held.slot) and g.rank == f.rank and g.generation >= f.generation
           and g.time >= f.time for _fid, g in failures):
        return ""
    return f"rank {f.rank} runs on {held.node}/{held.slot} since"


def reform_deaths(plan: SwapPlan, seen: Seen) -> list[tuple[str, Failure]]:
    """Deaths not handled yet while ``plan`` re-forms the world: any rank's, its joiners' included."""
    lost = set(seen.view.lost)
    return [(fid, f) for fid, f in seen.failures if not f.handled and f.generation >= seen.epoch
            and f.node not in lost and not runs_elsewhere(f, seen.view, seen.failures)]


def reforming(p: SwapPlan) -> bool:
    """``p`` was given up while its world re-formed and a recovery took over (its joiners hold their ranks'
    received state, not yet loaded: they wait, without a process group, for the next re-form)."""
    return p.superseded and p.phase == Phase.ABORTED and len(p.history) >= 2 and p.history[-2][0] == Phase.REFORM.value


def unjoined(seen: Seen) -> dict[tuple[str, int], int]:
    """The slots of joiners that wait for a world that was given up (no plan finished since), with the rank each
    holds: they cannot donate."""
    out: dict[tuple[str, int], int] = {}
    for p, _rev in seen.plans:
        if not reforming(p) or p.generation < seen.epoch:
            continue
        when = p.history[-1][1]
        if not any(q.phase == Phase.DONE and q.history[-1][1] >= when for q, _ in seen.plans):
            # (a joiner that died there is in the plan's excluded spares: it holds nothing)
            out.update({(m.joiner.node, m.joiner.slot): m.rank for m in p.all_moves
                        if (m.joiner.node, m.joiner.slot) not in p.excluded_spares})
    return out


def donor_view(seen: Seen) -> ClusterView:
    """The cluster as a donor is chosen from: a joiner still waiting to enter its world holds its rank's state as
    received bytes, it cannot stream it. It holds the rank, though, even before its agent's status says so: a
    lost node's plan must not move that rank again (its leaver was on the lost node). Both: state "joining"."""
    return joining(seen.view, unjoined(seen))


def joining(view: ClusterView, joiners: dict[tuple[str, int], int]) -> ClusterView:
    """``view`` with each of ``joiners``' slots holding its rank, waiting to enter a world (no donor, no spare)."""
    if not joiners:
        return view
    return dataclasses.replace(view, slots=tuple(
        dataclasses.replace(s, state="joining", rank=joiners[(s.node, s.slot)]) if (s.node, s.slot) in joiners else s
        for s in view.slots))


def death_in_reform(plan: SwapPlan, rev: int, late: Sequence[tuple[str, Failure]], seen: Seen) -> tuple[Action, ...]:
    """A rank died while ``plan`` re-formed the world (pure). The others stop joining and wait where they are (the
    participants tell them, swap_phases._abort_joins), the joiners keep the state they received, and the dead ranks
    are recovered by the next plan as any new fault, from the spares and the replicas left. An unplanned
    recovery's joiner that died there had not loaded its rank yet: that rank is recovered again from its first
    death (its node still holds the dead rank's snapshots, any replica donates again) and the joiner's death is
    moot. When they cannot be, or a planned swap's joiner died (its leaver has left), or several nodes' ranks move
    at once (a node plan), the group restarts and the fallback line names the death."""
    now = seen.now
    failures = [f for _fid, f in late]
    dead = sorted(f.rank for f in failures)
    what = (f"the recovery of rank(s) {list(plan.ranks)}" if plan.kind != SwapKind.PLANNED
            else f"the swap of rank {plan.leaver.rank}")
    who = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {dead}"
    joiners = {(m.joiner.node, m.joiner.slot) for m in plan.all_moves}
    gone_joiners = [(fid, f) for fid, f in late if (f.node, f.slot) in joiners]
    why = f"{who} died while the world re-formed for {what}"
    blocker, first = None, None
    if plan.kind == SwapKind.NODE:
        blocker = "a plan that moves several ranks is not re-planned inside its re-form"
    elif gone_joiners:
        first = next(((fid, f) for fid, f in seen.failures if f.handled == "plan" and f.rank == plan.leaver.rank
                      and (f.node, f.slot) == (plan.leaver.node, plan.leaver.slot)
                      and f.generation >= seen.epoch), None) if plan.kind == SwapKind.UNPLANNED else None
        if first is None:
            blocker = "the joiner died before it had loaded the state it received"
    if blocker is None:
        todo = [f for f in failures if (f.node, f.slot) not in joiners] + ([first[1]] if first else [])
        waiting = {(m.joiner.node, m.joiner.slot): m.rank for m in plan.all_moves
                   if (m.joiner.node, m.joiner.slot) not in {(f.node, f.slot) for _fid, f in gone_joiners}}
        view = joining(donor_view(seen), waiting)
        if len(todo) == 1:
            f = todo[0]
            trial = plan_for_failure(view, node=f.node, slot=f.slot, rank=f.rank, reason="", now_wall=now,
                                     light_available=f.light, replicas=f.replicas, alone=f.alone, sharded=f.sharded)
        else:
            trial = plan_for_dead_ranks(view, [(f.node, f.slot, f.rank) for f in todo], reason="", now_wall=now,
                                        swap_id="trial")
        if trial.plan is None:
            blocker = trial.reason
    if blocker is None:
        # the dead are planned on the next tick (their failures stay unhandled); the ranks this plan moved are its
        # joiners' now (their failures stay handled), but a dead joiner's: its rank's first death is handed back
        why += ": every rank waits where it stopped, the dead are replaced live"
        aborted = plan.advance(Phase.ABORTED, now, outcome=why, superseded=True, excluded_spares=plan.excluded_spares
                               + tuple((f.node, f.slot) for _fid, f in gone_joiners))
        out: list[Action] = [CasPlan(plan, aborted, rev, Decision("plan", why, aborted)),
                             Say("recovery_superseded", {"swap_id": plan.id, "ranks": list(plan.ranks), "dead": dead,
                                                         "phase": plan.phase.value, "reason": why})]
        if first is not None:
            moot = f"the joiner of rank {plan.leaver.rank} died before it loaded its state: recovered again"
            out += [PutFailure(fid, f.mark("stale", moot)) for fid, f in gone_joiners]
            out += hand_back(plan, why, seen)
        return tuple(out)
    why = f"{why}, and it cannot be recovered live ({blocker}): the group restarts"
    # superseded: no second, vaguer fallback from the aborted plan; no outcome: a second fault spends a restart
    aborted = plan.advance(Phase.ABORTED, now, superseded=True)
    out = [CasPlan(plan, aborted, rev, Decision("plan", why, aborted))]
    out += [PutFailure(fid, f.mark("fallback", why)) for fid, f in late]
    f0 = failures[0]
    out.append(PutFallback(f0.node, Fallback(why, f0.generation, f0.slot)))
    return tuple(out)


def node_lost_in_reform(plan: SwapPlan, rev: int, gone: Sequence[str], seen: Seen) -> tuple[Action, ...]:
    """A node was lost while a single rank's swap re-formed the world (pure). As for a rank dying there
    (:func:`death_in_reform`): when the lost node's ranks (and any rank dead meanwhile) can be recovered live, the
    swap is superseded: every rank stops joining and waits where it stopped, its joiner keeps the state it
    received, and the next look plans the lost node (:func:`_lost_nodes`), whose re-form the waiting joiner
    enters too. A lost node that holds no rank of the new world (its one rank was the leaver) is left out of the
    re-form. When the joiner was on the lost node, or nothing can take the lost ranks, the group restarts saying
    why. Before, every such loss restarted the group, and a planned swap whose leaver's node was lost had
    nobody left to ask for that restart."""
    now, lost = seen.now, set(seen.view.lost)
    what = (f"the recovery of rank(s) {list(plan.ranks)}" if plan.kind != SwapKind.PLANNED
            else f"the swap of rank {plan.leaver.rank}")
    why = f"node {gone[0]} was lost while the world re-formed for {what}"
    blocker = None
    if any(m.joiner.node in lost for m in plan.all_moves):
        blocker = "the joiner was lost with it before it had loaded the state it received"
    else:
        view = joining(donor_view(seen), {(m.joiner.node, m.joiner.slot): m.rank for m in plan.all_moves})
        pending = [n for n in view.lost if lost_ranks(view, n)]
        new = dataclasses.replace(plan, nodes=tuple(n for n in plan.nodes if n not in lost))
        if not pending and not needs(new) & lost:
            # it holds no rank of the new world (its one rank was this swap's leaver): the world re-forms without
            # it (a death there meanwhile is the next look's, death_in_reform)
            why += ": it holds no rank of the new world, which re-forms without it"
            return (CasPlan(plan, new, rev, Decision("plan", why, new)),
                    Say("swap_node_dropped", {"swap_id": plan.id, "lost_node": gone[0], "reason": why}))
        if not pending:
            blocker = "the re-form cannot finish without it"
        else:
            dead = [(f.node, f.slot, f.rank) for _fid, f in reform_deaths(plan, seen)]
            trial = plan_for_losses(view, pending, dead, now_wall=now, swap_id="trial")
            blocker = trial.reason if trial.plan is None else None
    if blocker is None:
        why += ": every rank waits where it stopped, the lost node's ranks are replaced live"
        aborted = plan.advance(Phase.ABORTED, now, outcome=why, superseded=True)
        return (CasPlan(plan, aborted, rev, Decision("plan", why, aborted)),
                Say("recovery_superseded", {"swap_id": plan.id, "ranks": list(plan.ranks), "lost_node": gone[0],
                                            "phase": plan.phase.value, "reason": why}))
    why = f"{why}, and it cannot be recovered live ({blocker}): the group restarts"
    aborted = plan.advance(Phase.ABORTED, now, superseded=True)
    return (CasPlan(plan, aborted, rev, Decision("plan", why, aborted)), RestartGroup(why))


def hand_back(plan: SwapPlan, why: str, seen: Seen) -> tuple[Action, ...]:
    """The failures a superseded plan had taken on, unhandled again: the next plan takes them. Only those of the
    slots it moves ranks off: an earlier death of the same rank in another slot was recovered by an earlier plan,
    and handed back too it would count that rank dead twice (the next plan would find no state for it)."""
    leavers = {(m.leaver.node, m.leaver.slot) for m in plan.all_moves}
    return tuple(PutFailure(fid, dataclasses.replace(f, handled=None, reason=why)) for fid, f in seen.failures
                 if f.handled == "plan" and f.rank in plan.ranks and (f.node, f.slot) in leavers
                 and f.generation >= seen.epoch)


