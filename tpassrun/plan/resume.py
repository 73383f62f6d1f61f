"""Where an unplanned recovery of one rank resumes: pure decisions on the survivors' pause reports, no I/O.

A step is a transaction (``tpassrun/worker/step.py``): sealed in its backward pass, committed when a tracked
optimizer starts stepping. :func:`resume_step` finds the one step every survivor and the dead rank's saved
per-rank state agree on; :func:`resume_plan` adds sharded state (where the dead rank's shard comes from, or a
rollback of every rank to a common local copy) and a mixed commit (survivors one transaction apart: some move to
the others' step, :func:`tpassrun.plan.catchup.mixed_commit`; under HSDP a rollback of every rank to a common
local copy, the shards from the dead rank's replica: :func:`replica_rollback`). Re-exported by :mod:`tpassrun.plan.swap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tpassrun.plan.catchup import mixed_commit
from tpassrun.records import Move, Report, SlotRef

__all__ = ["ResumeChoice", "dead_has", "replica_rollback", "resume_plan", "resume_step"]

def resume_step(reports: Sequence[Report], dead_rank: int | None) -> tuple[int | None, str]:
    """The step an unplanned recovery resumes at, or None and why no step is exact (pure).

    A step is a transaction that commits when the tracked optimizers start stepping (after every collective
    of the step). Each survivor offers the one step it can resume at exactly (``steps``: paused ones,
    ``failed_steps``: failed ones): paused before step s, or failed inside step s before its commit point, it
    holds the model of step s and rolls its per-rank state back to s's start snapshot (to the start of its open
    gradient-accumulation window, if any: the window is re-executed); failed after its commit point (a
    collective in user code after the optimizer step), it offers s + 1 when the step had made all its changes to
    the replicated state and its per-rank state was sealed, else nothing (``post_commit``). All survivors must
    agree (a collective that completed on some survivors only leaves them one step apart: a mixed commit), and
    the dead rank must have left a snapshot for that step (taken at its start, or sealed in the backward pass of
    the step before).
    """
    who = f"rank {dead_rank}" if dead_rank is not None else "the dead rank"
    post = sorted({s for r in reports for s in r.post_commit})
    if post:
        return None, (f"survivors failed in a collective after their optimizer step of step {post[0]} (user code "
                      "after the commit point) before the step's other changes (LR scheduler, GradScaler) were "
                      "made, or with their per-rank state not sealed: that step can be neither finished nor undone")
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
                why = (f"{who} died inside step {max(have)} after the survivors had completed it, and its state "
                       "after the step was never saved (no tracked model to seal it in the backward pass, or "
                       "sealing turned off)")
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
    # a mixed commit (catchup.mixed_commit): these survivors first take ``step``'s replicated state from their move's
    # donor (a survivor standing there); ``donor``: the joiner's, one standing there too
    catch_up: tuple[Move, ...] = ()
    donor: SlotRef | None = None


def resume_plan(reports: Sequence[Report], dead_rank: int | None, *, replica_held: bool = False) -> ResumeChoice:
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

    Without sharded state, survivors that stopped one transaction apart (a mixed commit) are put at one step:
    those not there take its replicated state from one that is (``catch_up``; the joiner's ``donor`` stands there).

    ``replica_held``: the dead rank's sharded state is held by a live declared replica too (HSDP): no mirror, it
    comes from that replica (:func:`replica_rollback`).
    """
    who = f"rank {dead_rank}" if dead_rank is not None else "the dead rank"
    step, why = resume_step(reports, dead_rank)
    if not any(r.dead_ring is not None or r.rings is not None for r in reports):
        return ResumeChoice(step, why) if step is not None else _mixed(reports, why, dead_rank)
    if replica_held:
        return replica_rollback(reports, who, step, why)
    return _sharded(reports, who, step, why)


def dead_has(reports: Sequence[Report]) -> Callable[[int], bool]:
    """Whether the dead rank's saved per-rank state (its node's report) holds a step (:func:`resume_step`'s rule:
    a rank that died before its first snapshot resumes at step 0 from what its script builds)."""
    saved = [r.dead_steps for r in reports if r.dead_steps is not None]
    have = set(saved[0]) if saved else None
    return lambda v: have is None or v in have or (v == 0 and not have)


def _mixed(reports: Sequence[Report], why: str, dead_rank: int | None) -> ResumeChoice:
    """No step is every survivor's own: a mixed commit, when the survivors stopped one transaction apart and every
    one said where else it could stand (each its own per-rank state of that step, the replicated state from a
    survivor standing there); else ``why``."""
    stopped = sum(len(r.steps) + len(r.failed_steps) + len(r.post_commit) for r in reports)
    if sum(len(r.stops) for r in reports) != stopped:
        return ResumeChoice(None, why)       # a survivor said nothing more (a declared replica group)
    mixed = mixed_commit(reports, dead_has(reports), dead_rank)
    if mixed.step is None:
        return ResumeChoice(None, why if "mixed commit" in why else f"{why}; {mixed.why}")
    groups = {rank: set(group) for r in reports for rank, group in r.replicas.items()}
    stands = [SlotRef(r.node, slot, rank) for r in reports for rank, (slot, offer, _can) in sorted(r.stops.items())
              if offer == mixed.step and (dead_rank is None or rank not in groups or dead_rank in groups[rank])]
    near = next((r.node for r in reports if r.dead_steps is not None), None)
    donor = min(stands, key=lambda d: (d.node != near, d.rank or 0))
    return ResumeChoice(mixed.step, mixed.why, catch_up=mixed.moves, donor=donor)


def replica_rollback(reports: Sequence[Report], who: str, stopped: int | None,
                     stopped_why: str) -> ResumeChoice:
    """Where a single-rank recovery resumes when a live replica holds the dead rank's shards (HSDP) and the ranks
    keep local copies (``restore``: every survivor first rolls back to its copy of the step).

    Where the survivors stopped, if they agree: the replica's live state is the dead rank's there. Otherwise (a
    *mixed commit*: the dead rank finished its last reduce-scatter with its shard group, whose ranks committed
    the step, and died inside the replicate all-reduce, whose survivors did not; a window as long as the replica
    groups are apart, not a few microseconds) every rank rolls back to its copy of the newest step all survivors
    hold and the dead rank left a light snapshot of, and the replica donates its copy of it."""
    if stopped is not None:
        return ResumeChoice(stopped, f"{stopped_why}; its shards from its replica")
    rings = [set(r.rings or ()) for r in reports if r.rings is not None or (r.steps or r.failed_steps or r.post_commit)]
    common = set.intersection(*rings) if rings else set()
    saved = [set(r.dead_steps) for r in reports if r.dead_steps is not None]
    usable = common & saved[0] if saved else common
    if not usable:
        light = f" and {who}'s light snapshots (steps {sorted(saved[0])})" if saved else ""
        return ResumeChoice(None, f"{stopped_why}; no step is held by every survivor's local copy (steps "
                                  f"{sorted(common)}){light}")
    v = max(usable)
    return ResumeChoice(v, f"{stopped_why}: every rank rolls back to its copy of step {v}, {who}'s shards from its "
                           "replica", restore=True)


def _sharded(reports: Sequence[Report], who: str, step: int | None, why: str) -> ResumeChoice:
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
