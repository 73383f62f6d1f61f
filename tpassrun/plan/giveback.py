"""Giving a claimed pool node back, pure: with ``--migrate-back``, once the job has capacity of its own again (the
failed slot re-admitted, the lost node back as a spare node), the ranks a pool node runs go home one at a time and
the pool node, holding no rank any more, is released to its pool (issue 24, "given back").

:func:`plan_give_back` is asked on every leader tick of a job with ``--spare-pool`` (the coordinator carries its
answer out): one :class:`MoveHome` (a migrate-back taint: the existing planned swap with ``home``, whose leaver's
slot is freed, not quarantined), or one :class:`GiveBack` (the job marks its claim released; the pool node stops its
spare node and is idle again), or nothing. Never while anything else is under way: a plan in flight, a failure,
a taint of the job's or a move home not finished yet; the triage always goes first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Union

from tpassrun.plan.swap import ClusterView
from tpassrun.records import Taint


@dataclass(frozen=True)
class MoveHome:
    rank: int
    node: str                       # the pool node, as the job names it
    home: tuple[str, int]           # an own spare slot, ready
    reason: str


@dataclass(frozen=True)
class GiveBack:
    node: str                       # the pool node, as the job names it
    ranks: tuple[int, ...]          # the ranks it ran, gone home
    reason: str


GiveBackAction = Union[MoveHome, GiveBack]


def ranks_on(view: ClusterView, node: str) -> tuple[int, ...]:
    return tuple(sorted(s.rank for s in view.slots if s.node == node and s.rank is not None))


def seen_ranks(view: ClusterView, pool_nodes: Iterable[str],
               used: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Every rank each held pool node has run so far (a pool node that never ran one is still starting, or serves
    as a spare: it is not given back here)."""
    out = {n: tuple(r) for n, r in used.items()}
    for node in pool_nodes:
        out[node] = tuple(sorted({*out.get(node, ()), *ranks_on(view, node)}))
    return {n: r for n, r in out.items() if r}


def plan_give_back(view: ClusterView, pool_nodes: Mapping[str, str], used: Mapping[str, tuple[int, ...]],
                   taints: Iterable[Taint], *, migrate_back: bool, busy: bool) -> GiveBackAction | None:
    """What to do next about the pool nodes this job holds (``pool_nodes``: the node id each one's spare node has in
    the job -> its id in the pool; ``used``: the ranks each ran, from :func:`seen_ranks`). ``busy``: the triage
    acted this tick, or a plan is in flight. Actions name the node as the job's view does."""
    held = sorted(pool_nodes)
    if not migrate_back or busy or not held or any(t.handled_by is None or t.home_node is not None for t in taints
                                                    if t.rank is not None):
        return None
    lost = set(view.lost)
    for node in held:
        if node in lost or not used.get(node):
            continue
        running = ranks_on(view, node)
        if not running:
            if any(s.node == node and s.state in ("leaving", "joining") for s in view.slots):
                continue            # the last rank's slot is still being freed
            return GiveBack(node, used[node], f"its ranks {list(used[node])} moved home to the job's own spares")
        own = sorted((s.node, s.slot) for s in view.slots if s.state == "spare" and s.managed
                     and s.node not in lost and s.node not in held)
        if len(own) < len(running):
            continue                # not all of them can go: the pool node stays (half a move frees nothing)
        rank = running[0]
        return MoveHome(rank, node, own[0], f"rank {rank} moves off pool node {pool_nodes[node]} to the job's own "
                                            f"spare {own[0][0]}/{own[0][1]} (--migrate-back)")
    return None


__all__ = ["GiveBack", "GiveBackAction", "MoveHome", "plan_give_back", "ranks_on", "seen_ranks"]
