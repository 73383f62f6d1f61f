"""Several losses in one plan (pure): nodes lost at once, or a node and a rank that died while its plan ran.

A node plan (:func:`tpassrun.plan.swap.plan_for_node_loss`) moves the ranks of one lost node. When a second node is
lost, or a donor dies, before that plan's world is re-formed, the plan is *superseded* (aborted without a
restart, :mod:`tpassrun.plan.triage`) and the next look plans everything that is gone at once, in one re-formed
world: every rank of every lost node (the lost nodes' ranks each from their buddy's mirror; a lost node whose
buddy is lost too leaves no live recovery) and every rank that died on a live node (its light state from its own
agent's copy), each to a ready spare (one spare node per lost node when there are enough, so each takes its lost
node's place), model and optimizer from the live replicas, spread. When the spares or the replicas do not
suffice, the group restarts and says why.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tpassrun.plan.swap import (
    ClusterView,
    Decision,
    SlotView,
    _interleaved_donors,
    _node_joiners,
    choose_spare,
    involved,
    lost_ranks,
)
from tpassrun.records import Move, Phase, SlotRef, SwapKind, SwapPlan


def plan_for_losses(view: ClusterView, nodes: Sequence[str], dead: Sequence[tuple[str, int, int]], *,
                    now_wall: float, swap_id: str) -> Decision:
    """One plan for the ranks of every node in ``nodes`` (lost) and every dead ``(node, slot, rank)``."""
    leavers = [SlotRef(n, slot, rank) for n in nodes for rank, slot in lost_ranks(view, n)]
    leavers += [SlotRef(n, slot, rank) for n, slot, rank in dead if rank not in {x.rank for x in leavers}]
    if not leavers:
        return Decision("none", f"nodes {list(nodes)} held no ranks: nothing to recover")
    ranks = sorted(x.rank for x in leavers if x.rank is not None)
    what = (f"nodes {', '.join(nodes)} lost" if len(nodes) > 1 else f"node {nodes[0]} lost" if nodes else "") + (
        f"{' and ' if nodes else ''}ranks {sorted(r for _n, _s, r in dead)} dead" if dead else "")
    joiners: dict[int, SlotView] = {}
    replacing: dict[str, str] = {}
    left = view
    for n in nodes:                     # a lost node's ranks on one spare node when one has enough
        mine = [x for x in leavers if x.node == n]
        found = _node_joiners(left, n, len(mine)) if mine else []
        if found is None:
            return Decision("fallback", f"{what}: only {_spare_count(view)} spare slot(s) for {len(leavers)} ranks "
                                        f"{ranks}: whole-group restart")
        for x, j in zip(mine, found):
            joiners[x.rank] = j         # type: ignore[index]
        where = {j.node for j in found}
        taker = next(iter(where)) if len(where) == 1 else None
        if taker is not None and taker not in view.members and taker not in replacing.values():
            replacing[n] = taker        # (a node takes one lost member's place at most)
        left = _without(left, found)
    for x in leavers:
        if x.rank in joiners:
            continue
        spare = choose_spare(left, x.node)
        if spare is None:
            return Decision("fallback", f"{what}: only {_spare_count(view)} spare slot(s) for {len(leavers)} ranks "
                                        f"{ranks}: whole-group restart")
        joiners[x.rank] = spare         # type: ignore[index]
        left = _without(left, [spare])
    used: dict[tuple[str, int], int] = {}
    moves = []
    for x in leavers:
        holders = [s for s in _interleaved_donors(view, "", x.rank) if s.managed and s.rank not in ranks]
        if not holders:
            return Decision("fallback", f"{what}: no live rank holds rank {x.rank}'s state: whole-group restart")
        j = joiners[x.rank]             # type: ignore[index]
        donor = holders[min(range(len(holders)), key=lambda i: (used.get((holders[i].node, holders[i].slot), 0),
                                                                 holders[i].node != j.node, i))]
        used[(donor.node, donor.slot)] = used.get((donor.node, donor.slot), 0) + 1
        moves.append(Move(x, SlotRef(j.node, j.slot, x.rank), SlotRef(donor.node, donor.slot, donor.rank)))
    alive = involved(view, sorted({m.joiner.node for m in moves}))
    first = moves[0]
    plan = SwapPlan(id=swap_id, kind=SwapKind.NODE, generation=view.generation, leaver=first.leaver,
                    joiner=first.joiner, donor=first.donor, phase=Phase.PAUSE, reason=what, nodes=tuple(alive),
                    history=((Phase.PAUSE.value, now_wall),), moves=tuple(moves),
                    lost_node=nodes[0] if nodes else None, lost_also=tuple(nodes[1:]),
                    replaces=replacing.get(nodes[0]) if nodes else None, replacing=replacing)
    return Decision("plan", f"{what}: ranks {ranks} to spare slots on "
                            f"{', '.join(sorted({m.joiner.node for m in moves}))} at once, state from ranks "
                            f"{sorted({m.donor.rank for m in moves if m.donor and m.donor.rank is not None})} and "
                            "from the mirrors", plan)


def _spare_count(view: ClusterView) -> int:
    """Spare slots on live nodes, ready or still starting (a plan takes either: swap._node_joiners)."""
    return len([s for s in view.slots if s.state == "spare" and s.node not in view.lost])


def _without(view: ClusterView, taken: Sequence[SlotView]) -> ClusterView:
    gone = {(s.node, s.slot) for s in taken}
    return dataclasses.replace(view, slots=tuple(s for s in view.slots if (s.node, s.slot) not in gone))


__all__ = ["plan_for_losses"]
