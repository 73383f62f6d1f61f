"""A mixed commit resolved (pure): survivors that failed inside a step others completed catch up (forward), or the
others go back to its start (:func:`mixed_commit`, a single rank's recovery).

When ranks die inside a step's all-reduce, the collective can complete on some survivors and not on others:
the ones that completed it (the *leaders*) committed the step (their optimizer stepped) and stopped at the next
one; the others (the *laggards*) failed inside it, before their commit point. Neither side can be moved to the
other's step by itself: a leader cannot undo its optimizer step (no copy of its model before it, under plain
data parallelism), a laggard does not have the all-reduced gradients. But a laggard needs nothing a leader does
not hold: every survivor's replicated state (model, optimizer, schedulers) of the next step's start is the
leaders' (they all applied the same all-reduced gradients), and a laggard's own per-rank state (RNG, data
position) of the next step is its *seal*: it is written in the step's backward pass, before the rank contributes
to the step's all-reduce, so every rank that a leader's completion needed has sealed the step. So each laggard
takes the replicated state from a leader (a transfer, like a joiner's), keeps its own seal, and everyone, the
lost ranks' replacements too (from the seals their ranks pushed to the buddy), resumes at the next step.

The other way works too, at no per-step cost: a leader keeps the start snapshot of its previous transaction (a
reference to bytes it took anyway, ``Report.backs``), and the replicated state of that start is the laggards'
(they did not commit the step). So a leader can go *back* to the step's start with a laggard's replicated state,
and everyone re-executes the step: nothing the script does after the step's collectives (logging, a checkpoint
save) is skipped on any rank; the leaders do it twice, identically. :func:`mixed_commit` (a single rank's
recovery) prefers it, and goes forward when the dead rank kept no state of the step's start.

:func:`roll_forward` decides it from the PAUSE reports (``Report.stops``: per local survivor, the step it can
resume at and whether it can catch up to the next one); the node-plan participant (``tpassrun/swapper/nodeswap.py``) carries it
out; the worker's side is ``CatchUp`` (``tpassrun/worker/commands.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from tpassrun.records import Move, Report, SlotRef


@dataclass(frozen=True)
class RollForward:
    """Where a mixed commit resumes (``step``; None: not forward, ``why``) and who catches up from whom
    (``moves``: ``leaver`` = ``joiner`` = the laggard's slot, ``donor`` = a leader's)."""

    step: int | None
    why: str
    moves: tuple[Move, ...] = ()


def roll_forward(reports: Sequence[Report]) -> RollForward:
    """The PAUSE reports of a plan whose survivors stopped one step apart: catch the laggards up (pure)."""
    stops = [(r.node, rank, slot, offer, can) for r in reports for rank, (slot, offer, can) in sorted(r.stops.items())]
    if not stops:
        return RollForward(None, "no survivor said where it stopped")
    offers = sorted({offer for *_x, offer, _can in stops})
    if len(offers) != 2 or offers[0] < 0 or offers[1] != offers[0] + 1:
        return RollForward(None, f"survivors can resume at steps {offers}: not one step apart")
    step = offers[1]
    laggards = [(node, rank, slot) for node, rank, slot, offer, _can in stops if offer == step - 1]
    stuck = [rank for _node, rank, _slot, offer, can in stops if offer == step - 1 and not can]
    if stuck:
        return RollForward(None, f"mixed commit: ranks {stuck} stopped inside step {step - 1}, which other survivors "
                                 f"completed, and hold no seal of step {step} to catch up with")
    leaders = [(node, rank, slot) for node, rank, slot, offer, _can in stops if offer == step]
    used: dict[int, int] = {}
    moves = []
    for node, rank, slot in laggards:
        # a leader on the laggard's node first (the transfer stays local), then the least used one
        donor = min(leaders, key=lambda d: (d[0] != node, used.get(d[1], 0), d[1]))
        used[donor[1]] = used.get(donor[1], 0) + 1
        me = SlotRef(node, slot, rank)
        moves.append(Move(me, me, SlotRef(donor[0], donor[2], donor[1])))
    return RollForward(step, f"mixed commit: ranks {sorted(r for _n, r, _s in laggards)} failed inside step "
                             f"{step - 1}, which ranks {sorted(r for _n, r, _s in leaders)} completed: they catch up "
                             f"from them and everyone resumes at step {step}", tuple(moves))


def mixed_commit(reports: Sequence[Report], dead_has: Callable[[int], bool],
                 dead_rank: int | None = None) -> RollForward:
    """A mixed commit resolved either way (pure), for a plan whose dead ranks kept their own per-rank state (a
    single rank's recovery: its agent's copies; ``dead_has(step)`` says which steps they hold).

    Besides going forward (:func:`roll_forward`), the survivors that committed the step (the leaders) can go
    *back* to its start: they keep the start snapshot of their previous transaction (``Report.backs``), and the
    replicated state of that step is the laggards' (they did not commit it). Going back is preferred: everyone
    re-executes the step, so nothing the script does after its collectives is skipped on any rank (its logging,
    a checkpoint save); the leaders do it twice, identically. Forward skips the rest of the failed step on the
    laggards (and the dead rank). Forward is taken when the dead rank kept no state of the step's start, or a
    leader no snapshot of it. Either way each survivor not at the chosen step takes its replicated state from one
    that is (``moves``: ``leaver`` = ``joiner`` = the survivor, ``donor`` = one standing there, on its node first).

    Under declared replica groups (``Report.replicas``; TP x DP: the ranks with the same tensor/pipeline
    coordinates in the other data-parallel replicas) a survivor's donor is one of its own group, and the dead rank
    (``dead_rank``) needs one of its group standing at the chosen step: a step where some survivor, or the dead
    rank, has no replica standing there is not taken (a leader whose only replica died cannot go back)."""
    stops = [(r.node, rank, slot, offer, can, r.backs.get(rank))
             for r in reports for rank, (slot, offer, can) in sorted(r.stops.items())]
    if not stops:
        return RollForward(None, "no survivor said where it stopped")
    groups = {rank: set(group) for r in reports for rank, group in r.replicas.items()}

    def replicas(a: int, b: int) -> bool:
        """Whether ranks ``a`` and ``b`` hold the same replicated state (undeclared: plain data parallelism)."""
        return (a not in groups or b in groups[a]) and (b not in groups or a in groups[b])

    def reaches(v: int, offer: int, can: bool, back: int | None) -> bool:
        return v in (offer, back) or (can and v == offer + 1)

    candidates = sorted({v for *_x, offer, can, back in stops for v in (offer, offer + 1 if can else None, back)
                         if v is not None and v >= 0})
    for v in candidates:
        leaders = [(node, rank, slot) for node, rank, slot, offer, _can, _back in stops if offer == v]
        behind = [(node, rank, slot, offer) for node, rank, slot, offer, can, back in stops if offer != v]
        if not leaders or not behind or not dead_has(v) or not all(
                reaches(v, offer, can, back) for *_x, offer, can, back in stops):
            continue
        if any(not any(replicas(rank, d[1]) for d in leaders) for _n, rank, _s, _o in behind) or (
                dead_rank is not None and not any(replicas(dead_rank, d[1]) for d in leaders)):
            continue
        used: dict[int, int] = {}
        moves = []
        for node, rank, slot, _offer in behind:
            mine = [d for d in leaders if replicas(rank, d[1])]
            donor = min(mine, key=lambda d: (d[0] != node, used.get(d[1], 0), d[1]))
            used[donor[1]] = used.get(donor[1], 0) + 1
            me = SlotRef(node, slot, rank)
            moves.append(Move(me, me, SlotRef(donor[0], donor[2], donor[1])))
        way = "go back" if all(offer > v for *_x, offer in behind) else (
            "catch up" if all(offer < v for *_x, offer in behind) else "move")
        return RollForward(v, f"mixed commit: ranks {sorted(r for _n, r, _s, _o in behind)} stopped one transaction "
                              f"away from ranks {sorted(r for _n, r, _s in leaders)}: they {way} to step {v} with "
                              "the model and optimizer of a rank standing there, and everyone resumes there",
                           tuple(moves))
    offers = sorted({offer for *_x, offer, _can, _back in stops})
    return RollForward(None, f"mixed commit: survivors stopped at steps {offers} and no step is held by all of them "
                             "and by the dead rank's saved state")


def leaders_donate(moves: Sequence[Move], catch_up: Sequence[Move]) -> tuple[Move, ...]:
    """The joiners' donors, none of them a laggard (its state is a step behind until it caught up): such a donor
    is replaced by the leader it catches up from."""
    behind = {(m.leaver.node, m.leaver.slot): m.donor for m in catch_up}
    return tuple(dataclasses.replace(m, donor=behind[(m.donor.node, m.donor.slot)])
                 if m.donor is not None and (m.donor.node, m.donor.slot) in behind else m for m in moves)


__all__ = ["RollForward", "leaders_donate", "mixed_commit", "roll_forward"]
