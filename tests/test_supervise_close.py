"""How an agent ends when another node closes the run as succeeded (tpassrun/agent/supervise.py), against its slot
table only: a node with a rank running waits for its workers to finish; a node with none (a spare node never
promoted, or a member whose ranks swaps moved to other nodes) has nothing that would ever end it, so it ends at once.

The chaos harness found the second kind of member: after taints and recoveries moved both of its ranks away, the
record still listed it as a member, and it waited for ever after the job succeeded."""

from __future__ import annotations

import asyncio
import types

import pytest

from tpassrun.agent.supervise import Outcome, Supervision
from tpassrun.channel.slots import Slot, SlotState
from tpassrun.rendezvous import EventKind, Generation, GenState, Member, RdzvEvent

pytestmark = pytest.mark.timeout(30)

GEN = Generation(number=7, state=GenState.ACTIVE, world_size=4,
                 members=(Member("a", 0, "h", 2, 0), Member("b", 1, "h", 2, 2)))


class _Node:
    """The agent state Supervision reads here (its node and generation: AgentState; its slot table and rendezvous:
    Started), and the part."""

    def __init__(self, node_id: str, states: list[tuple[SlotState, int | None]]) -> None:
        self.node_id, self.generation = node_id, GEN
        self.slots = types.SimpleNamespace(slots=[Slot(index=i, rank=r, state=st, managed=True)
                                                  for i, (st, r) in enumerate(states)])
        self.rdzv = types.SimpleNamespace(is_leader=False)
        self.supervision = Supervision(self, self, cause=None, workers=None, store=None)


def _closed(node: _Node) -> tuple[str, str] | None:
    closed = RdzvEvent(EventKind.CLOSED, reason="succeeded: all workers succeeded")
    changed = RdzvEvent(EventKind.GENERATION_CHANGED,
                        generation=Generation(number=8, state=GenState.CLOSED, world_size=4, members=GEN.members,
                                              reason="succeeded"))
    first, second = (asyncio.run(node.supervision._on_rdzv_event(GEN, ev)) for ev in (closed, changed))
    assert first == second
    return first


def test_a_member_whose_ranks_all_moved_away_ends_with_the_run():
    moved = _Node("a", [(SlotState.SPARE, None), (SlotState.QUARANTINED, None), (SlotState.SPARE, None)])
    outcome = _closed(moved)
    assert outcome is not None and outcome[0] == Outcome.SUCCEEDED and "moved this node's ranks" in outcome[1]


def test_a_spare_node_never_needed_ends_with_the_run():
    spare = _Node("c", [(SlotState.SPARE, None), (SlotState.SPARE, None)])
    outcome = _closed(spare)
    assert outcome is not None and outcome[0] == Outcome.SUCCEEDED and "not needed" in outcome[1]


def test_a_node_still_running_a_rank_waits_for_its_workers():
    for node_id in ("a", "c"):      # a member, or a spare node a swap handed a rank
        busy = _Node(node_id, [(SlotState.RUNNING, 1), (SlotState.SPARE, None)])
        assert _closed(busy) is None
