"""Where a node plan of a sharded job resumes (pure): every lost rank's shard from its buddy's shard mirror.

Under ZeRO-1/2, pure FSDP2 or a hand-sharded optimizer (``sess.track_sharded``), no live rank holds a lost
rank's shard; its buddy node's mirror does (``shard/state``: the shard and the rank's light snapshot at a step's
start, refreshed every ``--shard-mirror-interval`` steps: :mod:`tpassrun.worker.shards`), and every rank keeps local
copies of its own whole state at the same steps. A node plan resumes at the step the survivors stopped at when
every lost rank's mirror holds its shard of it; otherwise every survivor rolls back to its own copy of the newest
step that all of them hold and every lost rank's mirror holds too (``restore``), and the steps after it are
recomputed. The single-rank rule is :func:`tpassrun.plan.swap.resume_plan`'s; this is the same for several ranks.

Under HSDP a rank's shards are sharded state too (the torchtitan adapter tracks them so), but a live declared
replica holds them (:func:`replica_held`): they come from that replica, no mirror is kept, and the local copies
serve one case only, survivors that stopped at different steps (:func:`tpassrun.plan.resume.replica_rollback`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from tpassrun.records import Report


@dataclass(frozen=True)
class ShardedResume:
    step: int | None
    why: str
    restore: bool = False                                   # every survivor first loads its copy of ``step``
    shards_from: Mapping[int, str] = field(default_factory=dict)   # lost rank -> the node whose mirror holds it


def sharded_resume(reports: Sequence[Report], ranks: Sequence[int], stopped: int | None,
                   stopped_why: str) -> ShardedResume | None:
    """The resume step of a node plan whose lost ranks kept sharded state; None when none did (no node reports
    a shard copy or a local ring). ``stopped``: where the survivors stopped (:func:`tpassrun.plan.swap.resume_step`),
    None with ``stopped_why`` when they disagree."""
    if not any(r.shard_held for r in reports) and all(r.rings is None for r in reports):
        return None
    holders = {rank: [(r.node, set(r.shard_held.get(rank, ()))) for r in sorted(reports, key=lambda r: r.node)]
               for rank in ranks}

    def source(rank: int, step: int) -> str | None:
        return next((node for node, steps in holders[rank] if step in steps), None)

    def sources(step: int) -> dict[int, str] | None:
        found = {rank: source(rank, step) for rank in ranks}
        return None if any(n is None for n in found.values()) else found  # type: ignore[return-value]

    mirrored = {rank: sorted(set().union(*(s for _n, s in holders[rank]))) for rank in ranks}
    if stopped is not None and (at := sources(stopped)) is not None:
        return ShardedResume(stopped, f"all survivors stopped at step {stopped}; ranks {list(ranks)} resume there "
                                      "from their shard mirror", False, at)
    bare = [rank for rank, steps in mirrored.items() if not steps]
    if bare:
        return ShardedResume(None, f"ranks {bare} held sharded state and no mirror holds a copy of it (lost before "
                                   "their first refresh, or their buddy node is lost too)")
    rings = [set(r.rings) for r in reports if r.rings is not None]
    common = set.intersection(*rings) if rings else set()
    usable = sorted((v for v in common if sources(v) is not None), reverse=True)
    if not usable:
        where = stopped_why if stopped is None else f"the survivors stopped at step {stopped}"
        return ShardedResume(None, f"no step is held both by every survivor's local copy (steps {sorted(common)}) "
                                   f"and by the mirror of every lost rank's shard ({mirrored}): {where}")
    v = usable[0]
    at = sources(v)
    assert at is not None
    return ShardedResume(v, f"every survivor rolls back to its copy of step {v} (the newest step the lost ranks' "
                            f"shard mirrors hold too; {stopped_why if stopped is None else f'they stopped at {stopped}'})"
                            f"; ranks {list(ranks)} resume there from their mirror", v != stopped, at)


def replica_held(slots: Iterable[Any], lost: Iterable[str], ranks: Iterable[int]) -> tuple[int, ...]:
    """The ranks among ``ranks`` whose sharded state a live declared replica holds too (HSDP: a running rank that
    names it in its replica group and tracks sharded state itself). ``slots``: :class:`tpassrun.plan.swap.SlotView`."""
    slots, lost = tuple(slots), set(lost)
    return tuple(sorted(rank for rank in set(ranks) if any(
        s.rank is not None and s.rank != rank and s.state == "running" and s.node not in lost and s.sharded
        and s.replicas is not None and rank in s.replicas for s in slots)))


__all__ = ["ShardedResume", "replica_held", "sharded_resume"]
