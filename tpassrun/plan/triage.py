"""The swap coordinator's triage: one pure function from what the leader read to what it must write.

The leader's tick is *read -> decide -> write*: :class:`tpassrun.swapper.Swapper` reads every swap plan, the
reports for the active one, worker failures, taints and the cluster view from etcd; :func:`triage` (here, no
I/O, no clock) says what to do, as a list of typed :data:`Action` s; the swapper carries them out in order.

Precedence, one thing per tick (each write makes the next tick see the new state):

1. plans from before the last whole-group restart are aborted (their workers are gone);
2. an active plan is advanced by :func:`tpassrun.plan.swap.next_step` (one swap at a time); one during which
   another rank died (a second fault) or a node it needs was lost, before its world re-forms, is *superseded*:
   aborted without a fallback, its own failures handed back, so that the next tick plans every dead rank and
   lost node at once (:func:`tpassrun.plan.swap.plan_for_dead_ranks`, :func:`tpassrun.plan.multiloss.plan_for_losses`)
   with the spares and replicas left, or restarts the group saying why; a node lost while a single rank's swap
   re-forms the world supersedes it too when the lost node's ranks can be recovered live (every rank stops joining
   and waits, the joiner keeps what it received, as for a death there), else restarts the group; a node lost
   while a node plan re-forms restarts the group;
3. else the lost nodes whose ranks nobody holds get one node plan (:func:`tpassrun.plan.swap.plan_for_node_loss`;
   several lost nodes, or a lost node and ranks dead on live nodes, :func:`tpassrun.plan.multiloss.plan_for_losses`)
   or, when none is possible, a whole-group restart that says why (worker failures reported from a lost node
   before it died are its plan's business); a node plan that loses another node, or a donor, before its world
   re-forms is superseded too, and this plans everything gone at once;
4. else the unhandled worker failures get a recovery: one dead rank an unplanned swap, several one plan
   replacing them all (a second fault during a recovery), or a fallback restart;
5. else the first unhandled taint gets a migration (or waits for a spare, said once, or restarts the group
   without the slot when its rank cannot swap live); a taint whose rank already left the slot it names (a second
   taint of one rank: a storm, tpassctl twice) is coalesced into the swap that moved it, never migrated again.

Every new taint is announced once as it arrives, also while a plan runs (a storm's taints queue behind it).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tpassrun.plan.actions import (
    Action,
    CasPlan,
    ClaimFromPool,
    CreatePlan,
    PutFailure,
    PutFallback,
    PutTaint,
    RestartGroup,
    Say,
    Seen,
    Triage,
)
from tpassrun.plan.multiloss import plan_for_losses
from tpassrun.plan.reform import death_in_reform, donor_view, hand_back, needs, node_lost_in_reform, reform_deaths, runs_elsewhere
from tpassrun.plan.swap import (
    SILENT,
    ClusterView,
    Decision,
    choose_spare,
    lost_ranks,
    next_step,
    node_plan_id,
    plan_for_dead_ranks,
    plan_for_failure,
    plan_for_node_loss,
    plan_for_taint,
)
from tpassrun.records import (
    HANDLED_COALESCED,
    HANDLED_RESTART,
    Failure,
    Fallback,
    Phase,
    SlotRef,
    SwapKind,
    SwapPlan,
    Taint,
    TaintEffect,
    TaintSource,
)


def triage(seen: Seen) -> Triage:
    # every new taint is announced at once, even while a swap runs or a recovery goes first: a storm's taints
    # queue behind the plan in flight, and the operator sees each arrive (said once)
    heard, received = _announce_taints(seen)
    decided = _decide(seen)
    return Triage(heard + decided.actions, decided.said, received)


def _announce_taints(seen: Seen) -> tuple[tuple[Action, ...], frozenset[str]]:
    out: list[Action] = []
    received: set[str] = set()
    for taint in seen.taints:
        if taint.id not in seen.received_said and taint.source != TaintSource.HEALTH.value:   # health: health_taint
            received.add(taint.id)
            out.append(Say("taint_received", {"id": taint.id, "rank": taint.rank, "slot": taint.slot,
                                              "target_node": taint.node_id, "effect": taint.effect.value,
                                              "source": taint.source or "tpassctl", "reason": taint.reason}))
    return tuple(out), frozenset(received)


def _decide(seen: Seen) -> Triage:
    now = seen.now
    stale = [(p, rev) for p, rev in seen.plans if not p.terminal and p.generation < seen.epoch]
    out: list[Action] = [CasPlan(p, p.advance(Phase.ABORTED, now), rev) for p, rev in stale]
    active = [(p, rev) for p, rev in seen.plans if not p.terminal and (p, rev) not in stale]
    if active:
        plan, rev = active[0]
        gone = sorted(needs(plan) & set(seen.view.lost))
        if gone and plan.kind == SwapKind.NODE and plan.phase in (Phase.PAUSE, Phase.TRANSFER, Phase.SEND):
            # another node lost before the world re-formed: everything that is gone is planned again at once
            why = f"node {gone[0]} was lost during {plan.reason or 'the plan'}: every loss is planned again at once"
            aborted = plan.advance(Phase.ABORTED, now, outcome=why, superseded=True)
            return Triage(tuple(out) + (CasPlan(plan, aborted, rev, Decision("plan", why, aborted)),
                                        Say("recovery_superseded", {"swap_id": plan.id, "ranks": list(plan.ranks),
                                                                    "lost_node": gone[0], "phase": plan.phase.value,
                                                                    "reason": why}))
                          + hand_back(plan, why, seen))
        if gone and plan.phase in (Phase.PAUSE, Phase.BOUNDARY, Phase.TRANSFER, Phase.SEND):
            return Triage(tuple(out) + _fold_node_loss(plan, rev, gone[0], seen))
        if gone and plan.phase == Phase.REFORM and plan.kind != SwapKind.NODE:
            return Triage(tuple(out) + node_lost_in_reform(plan, rev, gone, seen))
        if gone:
            why = f"node {gone[0]} was lost during the swap"
            decision = Decision("plan", f"aborted: {why}", plan.advance(Phase.ABORTED, now, outcome=why))
            assert decision.plan is not None
            restart = (RestartGroup(f"{plan.reason}: {why}"),) if plan.kind == SwapKind.NODE else ()
            return Triage(tuple(out) + (CasPlan(plan, decision.plan, rev, decision),) + restart)
        if plan.phase == Phase.REFORM:
            late = reform_deaths(plan, seen)
            if late:
                return Triage(tuple(out) + death_in_reform(plan, rev, late, seen))
        second = _second_faults(plan, seen)
        if second:
            return Triage(tuple(out) + _supersede(plan, rev, second, seen))
        return Triage(tuple(out) + _advance(plan, rev, seen))
    node_actions = _lost_nodes(seen)
    if node_actions:
        return Triage(tuple(out) + node_actions)
    stale_failures: list[Action] = []
    pending: list[tuple[str, Failure]] = []
    lost = set(seen.view.lost)
    for fid, f in seen.failures:
        if f.handled:
            continue
        if f.node in lost:
            # a death reported by a node that was lost since: its node plan takes all of its ranks
            stale_failures.append(PutFailure(fid, f.mark("node_lost", f"node {f.node} was lost")))
            continue
        if f.generation < seen.epoch:
            # A death from before the last whole-group restart (e.g. a second failure that ended a
            # recovery): those workers are gone, and the rank runs anew. Never plan a swap for it.
            stale_failures.append(PutFailure(fid, f.mark("stale", "before the restart")))
            continue
        moved = runs_elsewhere(f, seen.view, seen.failures)
        if moved:
            stale_failures.append(PutFailure(fid, f.mark("stale", moved)))
            continue
        pending.append((fid, f))
    if len(pending) > 1:
        return Triage(tuple(out + stale_failures) + _recover_many(pending, seen))
    if pending:
        return Triage(tuple(out + stale_failures) + _recover(*pending[0], seen))
    out += stale_failures
    taint_actions, said = _taints(seen)
    return Triage(tuple(out) + taint_actions, said)


def _lost_nodes(seen: Seen) -> tuple[Action, ...]:
    """The lost nodes whose ranks no plan holds: one node plan for all of them (with the ranks that died on live
    nodes meanwhile, :mod:`tpassrun.plan.multiloss`), or the group restart (said once: a plan born aborted marks the
    first node handled)."""
    view, now = donor_view(seen), seen.now
    # a plan holds a lost node while it runs, once done until its commit is seen (a later generation's view places
    # the moved ranks elsewhere), and born aborted (the group restarts) until that restart. Plans older than that
    # are about an earlier loss of the node and never hold a new one: a node lost again gets its own plan
    covered = {n for p, _ in seen.plans if p.kind == SwapKind.NODE and not p.superseded
               and (not p.terminal or (p.phase == Phase.DONE and p.generation >= view.generation)
                    or (p.phase == Phase.ABORTED and p.generation >= seen.epoch))
               for n in (p.lost_node, *p.lost_also) if n}
    pending = [n for n in view.lost if n not in covered and lost_ranks(view, n)]
    if not pending:
        return ()
    node = pending[0]
    dead = [(fid, f) for fid, f in seen.failures if not f.handled and f.generation >= seen.epoch
            and f.node not in view.lost]
    plan_id = _unique_id(node_plan_id(node), seen)
    if len(pending) == 1 and not dead:
        decision = plan_for_node_loss(view, node=node, now_wall=now, swap_id=plan_id)
    else:
        decision = plan_for_losses(view, pending, [(f.node, f.slot, f.rank) for _fid, f in dead], now_wall=now,
                                   swap_id=plan_id)
    if decision.plan is None and seen.pool and not set(pending) & seen.pool_gave_up \
            and _spare_slots(view) < sum(len(lost_ranks(view, n)) for n in pending):
        # own spares first, the pool second, a restart last: the pool's node is planned once its spares are up
        return (ClaimFromPool(tuple(pending), decision.reason),)
    out: list[Action] = [Say("node_lost_decided", {"lost_node": node, "also": pending[1:], "action": decision.action,
                                                   "reason": decision.reason})]
    out += [PutFailure(fid, f.mark("plan" if decision.plan is not None else "fallback", decision.reason))
            for fid, f in dead]
    if decision.plan is not None:
        return tuple(out) + (CreatePlan(decision.plan, reason=decision.reason),)
    marker = SwapPlan(id=plan_id, kind=SwapKind.NODE, generation=view.generation, leaver=SlotRef(node, 0),
                      joiner=SlotRef(node, 0), donor=None, phase=Phase.ABORTED, reason=f"node {node} lost",
                      nodes=(), history=((Phase.ABORTED.value, now),), lost_node=node, lost_also=tuple(pending[1:]),
                      outcome=decision.reason)
    return tuple(out) + (CreatePlan(marker), RestartGroup(decision.reason))


def _spare_slots(view: ClusterView) -> int:
    """Spare slots on live nodes, ready or still starting (what a node plan may take)."""
    return len([s for s in view.slots if s.state == "spare" and s.node not in view.lost])


REFORM_DEATH_GRACE_S = 30.0   # how long a re-form whose rank did not join waits for that rank's failure record


def _advance(plan: SwapPlan, rev: int, seen: Seen) -> tuple[Action, ...]:
    if plan.phase == Phase.REFORM and any(not r.ok for r in seen.reports) \
            and seen.now - plan.history[-1][1] < REFORM_DEATH_GRACE_S:
        # A rank that did not join the new world has almost always died: its node reports that as soon as it sees
        # it, possibly before its failure record is read, which then folds the death into the recovery
        # (death_in_reform). Only a re-form that fails with nobody dead is given up (a group restart).
        return ()
    spare = None
    sender_dead = joiner_gone = False
    if plan.phase in (Phase.TRANSFER, Phase.SEND):
        view = seen.view
        senders = [plan.leaver] if plan.kind == SwapKind.PLANNED else [m.donor for m in plan.all_moves if m.donor]
        # a sender's failure record may be read before the status that shows it dead (and the other way round)
        failed = {(f.node, f.slot) for _fid, f in seen.failures
                  if not f.handled and f.generation >= seen.epoch}
        for sender in senders:
            held = view.slot_at(sender.node, sender.slot)
            sender_dead = sender_dead or (held is not None and held.state in ("dead", "idle")) \
                or (sender.node, sender.slot) in failed
        joiner = view.slot_at(plan.joiner.node, plan.joiner.slot)
        if any(not r.ok for r in seen.reports) and (joiner is None or joiner.state != "spare"):
            spare = choose_spare(view, plan.joiner.node, plan.excluded_spares + ((plan.joiner.node, plan.joiner.slot),))
            joiner_gone = joiner is None or joiner.state in ("dead", "idle", "quarantined")
    decision = next_step(plan, seen.reports, seen.now, spare_after_failure=spare, sender_dead=sender_dead,
                         joiner_gone=joiner_gone)
    if decision.plan is None:
        return ()
    if joiner_gone and spare is None and decision.plan.phase == Phase.ABORTED and plan.kind != SwapKind.NODE:
        return _joiner_lost(plan, rev, decision, seen)
    out: tuple[Action, ...] = (CasPlan(plan, decision.plan, rev, decision),)
    taint = next((t for t in seen.taints if t.id == plan.taint_id), None) if plan.kind == SwapKind.PLANNED else None
    if decision.action == SILENT and taint is not None:     # a participant never answered: asked for again later
        out += (PutTaint(taint.handled(None, f"waiting: {decision.plan.outcome}")),)
    if (plan.kind == SwapKind.NODE and plan.lost_node is not None and decision.plan.phase == Phase.ABORTED
            and plan.phase in (Phase.TRANSFER, Phase.SEND)
            and not any(p.superseded and p.lost_node == plan.lost_node for p, _ in seen.plans)):
        # a transfer of a lost node's plan failed (a donor died mid-transfer, a joiner went away): tried once
        # more, with the donors and spares there are then (the next look plans everything gone again)
        why = f"{decision.plan.outcome or decision.reason}: tried once more"
        aborted = plan.advance(Phase.ABORTED, seen.now, outcome=why, superseded=True)
        return (CasPlan(plan, aborted, rev, Decision("plan", why, aborted)),
                Say("recovery_superseded", {"swap_id": plan.id, "ranks": list(plan.ranks), "phase": plan.phase.value,
                                            "reason": why})) + hand_back(plan, why, seen)
    if plan.kind == SwapKind.NODE and decision.plan.phase == Phase.ABORTED:
        # nothing is undone by hand: the group restarts, as torchrun would have at once
        why = f"{plan.reason}, no live recovery: {decision.plan.outcome or decision.reason}"
        if plan.lost_node is None:      # several dead ranks (a second fault): a failure, it spends a restart
            first = plan.all_moves[0].leaver
            out += (PutFallback(first.node, Fallback(why, plan.generation, first.slot)),)
        else:
            out += (RestartGroup(why),)
    return out


def _joiner_lost(plan: SwapPlan, rev: int, decision: Decision, seen: Seen) -> tuple[Action, ...]:
    """The joiner died during the transfer and no other spare is left (pure). A planned swap is given up and its
    taint waits for a spare again (the leaver still runs its rank); an unplanned recovery falls back to the group
    restart, its one console line saying why. That restart spends --max-restarts, as any second fault does."""
    aborted = decision.plan
    assert aborted is not None
    why = (f"the joiner {plan.joiner.node}/{plan.joiner.slot} died while receiving rank {plan.leaver.rank}'s state "
           "and no other spare is left")
    if plan.kind == SwapKind.PLANNED:
        out: list[Action] = [CasPlan(plan, aborted, rev, Decision("plan", f"aborted: {why}", aborted))]
        taint = next((t for t in seen.taints if t.id == plan.taint_id), None)
        if taint is not None:
            out.append(PutTaint(taint.handled(None, f"waiting: {why}")))
        return tuple(out)
    # superseded: the dead rank's agent restarts the group from the fallback record below (the line says why),
    # not from the aborted plan (which could only say "its recovery was aborted")
    aborted = dataclasses.replace(aborted, superseded=True)
    why = f"rank {plan.leaver.rank} cannot be recovered live: {why}"
    return (CasPlan(plan, aborted, rev, Decision("plan", f"aborted: {why}", aborted)),
            PutFallback(plan.leaver.node, Fallback(why, plan.generation, plan.leaver.slot)))


def _second_faults(plan: SwapPlan, seen: Seen) -> list[tuple[str, Failure]]:
    """Deaths in this generation, not handled yet, of ranks the active plan does not replace (on a lost node: its
    plan's business)."""
    moved, lost = set(plan.ranks), set(seen.view.lost)
    return [(fid, f) for fid, f in seen.failures if not f.handled and f.generation >= seen.epoch
            and f.node not in lost and f.rank not in moved and not runs_elsewhere(f, seen.view, seen.failures)]


def _supersede(plan: SwapPlan, rev: int, second: Sequence[tuple[str, Failure]], seen: Seen) -> tuple[Action, ...]:
    """Another rank died while ``plan`` ran (pure; see the module doc, item 2)."""
    now = seen.now
    dead = sorted(f.rank for _fid, f in second)
    what = (f"the recovery of rank(s) {list(plan.ranks)}" if plan.kind != SwapKind.PLANNED
            else f"the swap of rank {plan.leaver.rank}")
    who = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {dead}"
    sender = plan.donor if plan.kind == SwapKind.UNPLANNED else None
    if sender is not None and sender.rank in dead and plan.phase in (Phase.TRANSFER, Phase.SEND):
        who += " (the donor) died while handing over the state"
    else:
        who += " died"
    why = f"{who} during {what}: every dead rank is planned again at once"
    aborted = plan.advance(Phase.ABORTED, now, outcome=why, superseded=True)
    out: list[Action] = [CasPlan(plan, aborted, rev, Decision("plan", why, aborted)), Say("recovery_superseded",
           {"swap_id": plan.id, "ranks": list(plan.ranks), "dead": dead, "phase": plan.phase.value, "reason": why})]
    if plan.kind == SwapKind.PLANNED:
        taint = next((t for t in seen.taints if t.id == plan.taint_id), None)
        if taint is not None:       # asked for again once the dead are replaced
            out.append(PutTaint(taint.handled(None, f"waiting: {why}")))
    else:
        out += hand_back(plan, why, seen)
    return tuple(out)


def _fold_node_loss(plan: SwapPlan, rev: int, node: str, seen: Seen) -> tuple[Action, ...]:
    """A single-rank swap needs a node that was lost before its world re-formed (pure). Nothing of the new world
    exists yet, so the swap is superseded, not restarted: an unplanned recovery hands its dead rank back and the
    next look plans the lost node's ranks and that rank at once (:func:`tpassrun.plan.multiloss.plan_for_losses`); a
    planned swap's taint waits again (its rank runs on, or moves with its lost node's plan). A partition longer
    than the lease is the usual way here: the ranks blocked in collectives with the cut-off node go stale, the
    hang watchdog kills one, and its recovery waits for the cut-off node until its lease ends."""
    what = (f"the swap of rank {plan.leaver.rank}" if plan.kind == SwapKind.PLANNED
            else f"the recovery of rank(s) {list(plan.ranks)}")
    why = f"node {node} was lost during {what}: every loss is planned again at once"
    aborted = plan.advance(Phase.ABORTED, seen.now, outcome=why, superseded=True)
    out: list[Action] = [CasPlan(plan, aborted, rev, Decision("plan", why, aborted)),
                         Say("recovery_superseded", {"swap_id": plan.id, "ranks": list(plan.ranks), "lost_node": node,
                                                     "phase": plan.phase.value, "reason": why})]
    if plan.kind == SwapKind.PLANNED:
        taint = next((t for t in seen.taints if t.id == plan.taint_id), None)
        if taint is not None:
            out.append(PutTaint(taint.handled(None, f"waiting: {why}")))
    else:
        out += hand_back(plan, why, seen)
    return tuple(out)


def _unique_id(base: str, seen: Seen) -> str:
    """``base``, or ``base-N`` when a plan of that id exists already (the same failures planned again after a
    superseded plan)."""
    known = {p.id for p, _ in seen.plans}
    if base not in known:
        return base
    n = 1
    while f"{base}-{n}" in known:
        n += 1
    return f"{base}-{n}"


def _recover_many(pending: Sequence[tuple[str, Failure]], seen: Seen) -> tuple[Action, ...]:
    """Several ranks dead at once (a second fault during a recovery): one plan for all of them, or a restart."""
    view, now = donor_view(seen), seen.now
    failures = [f for _fid, f in pending]
    ranks = sorted(f.rank for f in failures)
    reason = f"ranks {ranks} died (exit codes {[f.code for f in sorted(failures, key=lambda f: f.rank)]})"
    # state no live rank holds (sharded without a replica: ZeRO, FSDP); HSDP's shards have their replicas
    odd = [f for f in failures if f.alone or (f.sharded and not set(f.replicas or ()) - {f.rank})]
    needs = tuple(dead_rank_need(f) for f in sorted(failures, key=lambda f: f.rank))
    if not odd and seen.pool and _spare_slots(view) < len(failures) and not set(needs) & seen.pool_gave_up:
        # own spares first, the pool second (one pool node covers as many of them as it has slots), a restart last
        return (ClaimFromPool(needs, f"{reason}, only {_spare_slots(view)} spare(s) of the job's own left"),)
    if odd:
        decision = Decision("fallback", f"{reason}; rank {odd[0].rank}'s state has no replica to take it from "
                                        f"({odd[0].alone or 'sharded'}), with another rank dead too: whole-group restart")
    else:
        base = f"m-{failures[0].generation}-" + "-".join(str(r) for r in ranks)
        decision = plan_for_dead_ranks(view, [(f.node, f.slot, f.rank) for f in failures], reason=reason,
                                       now_wall=now, swap_id=_unique_id(base, seen))
    out: list[Action] = [PutFailure(fid, f.mark(decision.action, decision.reason)) for fid, f in pending]
    out.append(Say("recovery_decided", {"action": decision.action, "reason": decision.reason}))
    if decision.plan is not None:
        out.append(CreatePlan(decision.plan, reason=decision.reason))
    else:
        f0 = failures[0]
        out.append(PutFallback(f0.node, Fallback(decision.reason, f0.generation, f0.slot)))
    return tuple(out)


def dead_rank_need(f: Failure) -> str:
    """What a dead rank asks the spare pool for, as the pool and the console name it (one per death: the step and
    generation tell a second death of the rank from the first)."""
    return f"rank {f.rank} (died at step {f.step}, generation {f.generation})"


def _recover(fid: str, f: Failure, seen: Seen) -> tuple[Action, ...]:
    view, now = donor_view(seen), seen.now
    if seen.pool and choose_spare(view, f.node) is None and dead_rank_need(f) not in seen.pool_gave_up:
        # own spares first, the pool second, a restart last: the failure stays unhandled until the pool node's
        # spares are up (the plan then takes one, ready or still starting) or the pool gave up
        return (ClaimFromPool((dead_rank_need(f),), f"rank {f.rank} died and no spare of the job's own is left"),)
    decision = plan_for_failure(view, node=f.node, slot=f.slot, rank=f.rank, reason=f"exit code {f.code}",
                                now_wall=now, light_available=f.light,
                                swap_id=_unique_id(f"u-{fid}-{f.generation}", seen),
                                replicas=f.replicas, alone=f.alone, sharded=f.sharded)
    out: list[Action] = [PutFailure(fid, f.mark(decision.action, decision.reason)),
                         Say("recovery_decided", {"action": decision.action, "reason": decision.reason})]
    known = {p.id for p, _ in seen.plans}
    if decision.plan is not None and decision.plan.id not in known:
        out.append(CreatePlan(decision.plan))
    elif decision.action == "fallback":
        fake = plan_for_failure(view, node=f.node, slot=f.slot, rank=f.rank, reason="", now_wall=now,
                                light_available=True)
        if fake.plan is not None:
            # Tell the dead rank's agent through an aborted plan: it turns that into a group restart.
            out.append(CreatePlan(fake.plan.advance(Phase.ABORTED, now)))
        else:   # no plan to abort (no spare at all): tell the dead rank's agent directly
            out.append(PutFallback(f.node, Fallback(decision.reason, f.generation, f.slot)))
    return tuple(out)


def _taints(seen: Seen) -> tuple[tuple[Action, ...], frozenset[str]]:
    """Every unhandled taint in turn: the first one that can move gets its plan (one plan per tick); the ones
    that must wait say so once; one whose rank cannot swap live restarts the group without its slot."""
    view, now = seen.view, seen.now
    done = {p.taint_id for p, _ in seen.plans if p.taint_id and p.phase == Phase.DONE}
    out: list[Action] = []
    said: set[str] = set()
    for taint in seen.taints:
        if taint.id in done or taint.handled_by or taint.effect is TaintEffect.EXCLUDE:
            continue  # exclude: keep the rank where it is, only never hand the slot out as a spare
        moot = _already_moved(taint, seen)
        if moot is not None:
            # a second taint of a rank (tpassctl twice, health and an operator, a storm): the rank already left
            # the tainted slot, which stays out of the pool; migrating it again would move it off a healthy one
            by, why = moot
            out += [Say("taint_coalesced", {"taint": taint.id, "rank": taint.rank, "swap_id": by, "reason": why}),
                    PutTaint(taint.handled(by, f"coalesced: {why}"))]
            continue
        rank = taint.rank
        if rank is None:
            target = [s for s in view.slots if s.node == taint.node_id and s.rank is not None
                      and (taint.slot is None or s.slot == taint.slot) and s.state == "running"]
            if not target or target[0].rank is None:
                continue
            rank = target[0].rank
        decision = plan_for_taint(view, node=taint.node_id or "", rank=rank, reason=taint.reason,
                                  taint_id=taint.id, now_wall=now, home=taint.home)
        if decision.action == "plan" and decision.plan is not None:
            out.append(CreatePlan(decision.plan, taint, decision.reason))
            break
        if taint.id not in seen.waiting_said:
            said.add(taint.id)
            out += [Say("swap_waiting", {"taint": taint.id, "action": decision.action, "reason": decision.reason}),
                    PutTaint(taint.handled(None, f"{decision.action}: {decision.reason}"))]
        if decision.action == "fallback":
            # A rank that cannot swap live (its script never called tpassrun.init()): restart the group
            # with the tainted slot quarantined on its node, so the rank starts in a spare slot instead.
            # Like a membership change, this costs no --max-restarts: nothing failed.
            held = view.slot_of_rank(rank)
            where = {"node_id": held.node, "slot": held.slot} if held is not None else {}
            out += [PutTaint(taint.handled(HANDLED_RESTART, decision.reason, **where)),
                    RestartGroup(f"health-aware restart: {decision.reason}", rank=rank)]
            break
    return tuple(out), frozenset(said)


def _already_moved(taint: Taint, seen: Seen) -> tuple[str, str] | None:
    """(what moved it, why) when ``taint``'s rank has left the slot it names (pure): a swap done since the taint
    was made moved that rank off that slot, or the rank runs elsewhere now. None for a migrate-back (its rank is
    meant to move again) or a taint that names no slot."""
    if taint.rank is None or taint.home is not None or taint.node_id is None or taint.slot is None:
        return None
    where = (taint.node_id, taint.slot, taint.rank)
    for p, _rev in seen.plans:
        if p.phase == Phase.DONE and p.history and p.history[-1][1] >= taint.time \
                and any((m.leaver.node, m.leaver.slot, m.leaver.rank) == where for m in p.all_moves):
            return p.id, f"rank {taint.rank} already left {taint.node_id}/{taint.slot} (swap {p.id})"
    held = seen.view.slot_of_rank(taint.rank)
    if held is not None and (held.node, held.slot) != (taint.node_id, taint.slot):
        return HANDLED_COALESCED, (f"rank {taint.rank} already left {taint.node_id}/{taint.slot} "
                                   f"(it runs on {held.node}/{held.slot})")
    return None


__all__ = ["Action", "CasPlan", "ClaimFromPool", "CreatePlan", "PutFailure", "PutFallback", "PutTaint",
           "RestartGroup", "Say", "Seen",
           "Triage", "triage"]
