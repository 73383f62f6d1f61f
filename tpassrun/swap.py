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
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Iterable, Sequence

# The records a plan is made of live with every other etcd record; re-exported: they are the planner's words.
from .records import TRANSITIONS, Phase, Report, SlotRef, SwapKind, SwapPlan

__all__ = ["ClusterView", "Decision", "MAX_SEND_ATTEMPTS", "Phase", "Report", "ResumeChoice", "SlotRef", "SlotView",
           "SwapKind", "SwapPlan", "TRANSITIONS", "choose_donor", "choose_spare", "new_swap_id", "next_step",
           "plan_for_failure", "plan_for_taint", "resume_plan", "resume_step"]


@dataclass(frozen=True)
class SlotView:
    """One worker slot as its agent publishes it in ``status/<node>``."""

    node: str
    slot: int
    rank: int | None
    state: str               # running | spare | quarantined | dead | done | leaving
    managed: bool
    step: int = 0


@dataclass(frozen=True)
class ClusterView:
    generation: int
    members: tuple[str, ...]          # member node ids (group rank order)
    spare_nodes: tuple[str, ...]
    slots: tuple[SlotView, ...]

    def slot_at(self, node: str, slot: int) -> SlotView | None:
        return next((s for s in self.slots if s.node == node and s.slot == slot), None)

    def slot_of_rank(self, rank: int) -> SlotView | None:
        for s in self.slots:
            if s.rank == rank and s.state in ("running", "done"):
                return s
        return None


@dataclass(frozen=True)
class Decision:
    action: str                # "plan" | "wait" | "reject" | "fallback"
    reason: str
    plan: SwapPlan | None = None


def _spares(view: ClusterView, near: str, excluded: Iterable[tuple[str, int]] = ()) -> list[SlotView]:
    banned = {tuple(x) for x in excluded}
    spares = [s for s in view.slots if s.state == "spare" and (s.node, s.slot) not in banned]
    # Same node first (no cross-node transfer), then other member nodes, then spare nodes.
    order = {n: i for i, n in enumerate(view.members)}
    # A spare that already said hello (torch imported, waiting in tpassrun.init) beats one still starting.
    return sorted(spares, key=lambda s: (s.node != near, s.node in view.spare_nodes, not s.managed,
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
    )
    return Decision("plan", f"replace dead rank {rank} by spare {spare.node}/{spare.slot}, state from rank "
                            f"{donor.rank} on {donor.node}: {reason}", plan)


def _involved(view: ClusterView, joiner_node: str) -> tuple[str, ...]:
    nodes = list(view.members)
    if joiner_node not in nodes:
        nodes.append(joiner_node)
    return tuple(nodes)


MAX_SEND_ATTEMPTS = 4


def resume_step(reports: Sequence[Report], dead_rank: int | None) -> tuple[int | None, str]:
    """The step an unplanned recovery resumes at, or None and why no step is exact (pure).

    A step is a transaction that commits when the tracked optimizers start stepping (after every collective
    of the step). A survivor paused before step s, or failed inside step s before its commit point, holds the
    model of step s and rolls its per-rank state back to s's start snapshot: it resumes at s. All survivors
    must agree (a collective that completed on some ranks only leaves them one step apart: a mixed commit),
    and the dead rank must have left a snapshot for that step (taken at step s's start, or at step s-1's
    commit point when it died after committing). A survivor that failed after its commit point (a collective
    in user code after the optimizer step) holds a step that can be neither finished nor undone.
    """
    who = f"rank {dead_rank}" if dead_rank is not None else "the dead rank"
    post = sorted({s for r in reports for s in r.post_commit})
    if post:
        return None, (f"survivors failed in a collective after their optimizer step of step {post[0]} (user code "
                      "after the commit point): that step can be neither finished nor undone")
    stopped = sorted({s for r in reports for s in r.steps} | {s for r in reports for s in r.failed_steps})
    if len(stopped) > 1:
        return None, (f"mixed commit: survivors stopped at different steps {stopped} (a collective completed on "
                      "some ranks only)")
    step = stopped[0] if stopped else 0
    saved = [r.dead_steps for r in reports if r.dead_steps is not None]
    if saved:
        have = set(saved[0])
        if step not in have and not (step == 0 and not have):
            if have and max(have) < step:
                why = (f"{who} died inside step {max(have)} after the survivors had completed it (its part of "
                       "a collective was delivered before it died, its own state after the step was not saved)")
            else:
                why = f"{who} saved state for steps {sorted(have)}, the survivors stopped at step {step}"
            return None, why
    return step, f"all survivors stopped at step {step}; {who} resumes there too"


@dataclass(frozen=True)
class ResumeChoice:
    """Where an unplanned recovery resumes (:func:`resume_plan`): ``step`` (None: nowhere exact, ``why``)."""

    step: int | None
    why: str
    restore: bool = False                       # every survivor first rolls back to its local copy of ``step``
    shard_from: tuple[str, int] | None = None   # the dead rank's shard comes from this mirror server ...
    shard_node: str | None = None               # ... of this node


def resume_plan(reports: Sequence[Report], dead_rank: int | None) -> ResumeChoice:
    """:func:`resume_step`, and for a job with sharded state (``sess.track_sharded``) where the dead rank's shard
    comes from (pure).

    No live peer holds a dead rank's shard: its buddy's mirror does, at the steps it was refreshed at
    (``mirror_steps``), and every rank keeps a local copy of its whole state at the same steps (``rings``).
    The recovery resumes at the step :func:`resume_step` finds when the mirror holds the dead rank's shard of
    that step (the survivors roll back their light state only, as under DDP). Otherwise (the rank died after
    the survivors committed the step's optimizer update, or before the refresh of its step had landed, or the
    mirror is refreshed every K > 1 steps) every rank rolls back to the newest step that every survivor holds a
    local copy of and the mirror holds the dead rank's shard of, and re-executes from there; none: the group
    restarts, and the reason says which copy was missing.
    """
    who = f"rank {dead_rank}" if dead_rank is not None else "the dead rank"
    step, why = resume_step(reports, dead_rank)
    if not any(r.dead_ring is not None or r.rings is not None for r in reports):
        return ResumeChoice(step, why)
    holders = [(r.node, r.mirror_addr, set(r.mirror_steps)) for r in reports if r.mirror_steps and r.mirror_addr]

    def source(v: int) -> tuple[str, tuple[str, int]] | None:
        return next(((node, addr) for node, addr, steps in holders if v in steps), None)

    if step is not None and (src := source(step)) is not None:
        return ResumeChoice(step, f"{why}; its shard of step {step} from the mirror on {src[0]}",
                            shard_from=src[1], shard_node=src[0])
    mirrored = sorted(set().union(*(steps for _, _, steps in holders))) if holders else []
    if not mirrored:
        return ResumeChoice(None, f"{who} held sharded state and no mirror holds a copy of it "
                                  "(it died before its first refresh, or its buddy is gone too)")
    rings = [set(r.rings or ()) for r in reports if r.rings is not None or (r.steps or r.failed_steps or r.post_commit)]
    common = set.intersection(*rings) if rings else set()
    usable = sorted((v for v in common if source(v) is not None), reverse=True)
    if not usable:
        have = sorted(common)
        return ResumeChoice(None, f"no step is held both by the mirror of {who}'s shard (steps {mirrored}) and by "
                                  f"every survivor's local copy (steps {have}): "
                                  + (why if step is None else f"the survivors stopped at step {step}"))
    v = usable[0]
    src = source(v)
    assert src is not None
    stopped = sorted({s for r in reports for s in (*r.steps, *r.failed_steps, *r.post_commit)})
    at = f"step {stopped[0]}" if len(stopped) == 1 else f"steps {stopped}" if stopped else "their step"
    return ResumeChoice(v, f"every rank rolls back to its copy of step {v} (the survivors stopped at {at}; "
                           f"{who}'s newest mirrored shard that every rank can match is step {v}, on {src[0]})",
                        restore=True, shard_from=src[1], shard_node=src[0])


def next_step(plan: SwapPlan, reports: Sequence[Report], now_wall: float,
              spare_after_failure: SlotView | None = None, sender_dead: bool = False) -> Decision:
    """The leader's move once reports for the plan's current phase are in (pure).

    ``sender_dead``: the rank that streams the state (the leaver of a planned swap, the donor of an
    unplanned one) died during TRANSFER/SEND. Retrying cannot help: abort at once, whatever was reported,
    so the failure is handled afresh (a planned swap's leaver becomes an unplanned recovery; an unplanned
    recovery that lost its donor too falls back to a whole-group restart) instead of waiting out timeouts.
    """
    mine = [r for r in reports if r.phase == plan.phase]
    if plan.phase in (Phase.DONE, Phase.ABORTED):
        return Decision("wait", "terminal")
    if sender_dead and plan.phase in (Phase.TRANSFER, Phase.SEND):
        sender = plan.leaver if plan.kind == SwapKind.PLANNED else plan.donor
        who = f"rank {sender.rank}" if sender is not None else "the sender"
        return Decision("plan", f"{who} died while handing over the state: aborted",
                        plan.advance(Phase.ABORTED, now_wall))
    bad = [r for r in mine if not r.ok]
    if plan.phase in (Phase.TRANSFER, Phase.SEND) and any(r.final for r in bad):
        err = next(r.error for r in bad if r.final)
        return Decision("plan", f"aborted (not retried, it cannot succeed): {err}",
                        plan.advance(Phase.ABORTED, now_wall, outcome=err))
    if plan.phase in (Phase.TRANSFER, Phase.SEND) and bad:
        # The joiner died or the bytes were corrupt: try again (another spare if the joiner is gone).
        if plan.attempt + 1 >= MAX_SEND_ATTEMPTS:
            return Decision("plan", f"giving up after {plan.attempt + 1} attempts: {bad[0].error}",
                            plan.advance(Phase.ABORTED, now_wall))
        if spare_after_failure is not None:
            joiner = SlotRef(spare_after_failure.node, spare_after_failure.slot, plan.joiner.rank)
            return Decision("plan", f"retry with spare {joiner.node}/{joiner.slot}: {bad[0].error}",
                            plan.advance(Phase.TRANSFER, now_wall, joiner=joiner, joiner_addr=None,
                                         attempt=plan.attempt + 1,
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
    have = {r.node for r in mine}
    if not needed <= have:
        return Decision("wait", f"{plan.phase.value}: waiting for {sorted(needed - have)}")

    if plan.phase == Phase.PAUSE:
        if plan.kind == SwapKind.UNPLANNED:
            choice = resume_plan(mine, plan.leaver.rank)
            if choice.step is None:
                return Decision("plan", choice.why, plan.advance(Phase.ABORTED, now_wall, outcome=choice.why))
            return Decision("plan", choice.why, plan.advance(Phase.TRANSFER, now_wall, boundary=choice.step,
                                                             restore=choice.restore, shard_from=choice.shard_from,
                                                             shard_node=choice.shard_node))
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
        return Decision("plan", f"joiner listening at {addr[0]}:{addr[1]}",
                        plan.advance(Phase.SEND, now_wall, joiner_addr=addr, light_b64=light))
    if plan.phase == Phase.SEND:
        return Decision("plan", "state received and verified", plan.advance(Phase.REFORM, now_wall))
    if plan.phase == Phase.REFORM:
        return Decision("plan", "world re-formed; training resumed", plan.advance(Phase.DONE, now_wall))
    return Decision("wait", f"nothing to do in {plan.phase.value}")
