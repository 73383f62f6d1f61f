"""A rank with sharded state (``sess.track_sharded``) counts as one from the call on, not from its first copy
(pure: the worker's ShardState, its channel slot, the status row, the plans).

Issue 35's trials (Megatron's distributed optimizer, 2026-12-07): 8/8 SIGKILLs inside step 0 restarted the group
although every rank had copied step 0 and pushed it to its buddy before the step began (``copy_at_start``). A
slot said it kept sharded state only through ``SHARD_HELD`` (host bytes of its local copies), published at the
step's commit point; a rank killed before it was planned as one whose state other ranks hold, alone in its
replica group: "no other rank holds its state", a whole-group restart. A whole node lost at step 2 fell back the
same way (its ranks' status rows did not say sharded yet). Now the worker says ``SHARD_TRACKED`` when it starts
tracking and publishes its step-0 copy as soon as it is taken."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tpassrun.channel import Field
from tpassrun.channel.slots import LocalSlots, SlotState
from tpassrun.plan.swap import ClusterView, SlotView, plan_for_failure, plan_for_node_loss
from tpassrun.records import WorkerRow
from tpassrun.swapper import shardplane
from tpassrun.worker.shards import ShardState

pytestmark = pytest.mark.timeout(60)


class _Optimizer:
    """A sharded optimizer whose ``state_dict()`` changes nothing before its first step (``copy_at_start``)."""

    copy_at_start = True

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.shard = torch.randn(16)

    def state_dict(self) -> dict:
        return {"shard": self.shard}

    def load_state_dict(self, state: dict) -> None:
        self.shard.copy_(state["shard"])


class _Mirror:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def client(self) -> "_Mirror":
        return self

    def put(self, owner: int, kind: str, version: int, parts, *, epoch: int = 0) -> bool:
        self.steps.append(version)
        return True

    def close(self) -> None:
        pass


def test_a_rank_is_sharded_from_track_sharded_on_and_its_step_0_copy_is_published_before_the_step_runs():
    published: dict[Field, int] = {}
    state = ShardState(1, "auto", published.__setitem__)
    assert published == {Field.SHARD_TRACKED: 1}             # before any copy
    mirror = _Mirror()
    state.retarget(mirror, 1)
    model = torch.nn.Linear(4, 2)
    state.begin(0, ({"opt": _Optimizer()}, {"model": model}), light=b"L0")
    # no fence yet (the step's commit point): step 0 is already in the buddy's memory and said in the slot
    assert mirror.steps == [0]
    assert published[Field.SHARD_V2] == 1 and published[Field.SHARD_HELD] > 0
    deadline = time.monotonic() + 10
    while published.get(Field.SHARD_PUSHED) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    state.close()


def test_the_agent_reads_a_tracked_slot_as_sharded_before_its_first_copy():
    async def go() -> None:
        slots = await LocalSlots(2, 0, on_message=lambda s, m: None).open()
        try:
            tracked, plain = slots.slots
            for s, rank in ((tracked, 0), (plain, 1)):
                s.state, s.rank, s.managed = SlotState.RUNNING, rank, True
            ch = slots.channel
            ch.set(tracked.index, Field.SHARD_TRACKED, 1)
            assert shardplane.tracks_sharded(ch, tracked.index) and shardplane.ring_of(ch, tracked.index) == ()
            assert not shardplane.tracks_sharded(ch, plain.index) and shardplane.ring_of(ch, plain.index) is None
            rows = {r.rank: r for r in slots.table()}
            assert rows[0].sharded and not rows[0].shard_held and not rows[1].sharded
            assert WorkerRow.from_json(rows[0].to_json()) == rows[0]
            assert "sharded" not in rows[1].to_json()           # rows of other jobs read and write as before
            slots.reset(tracked)                                # a new worker in the slot starts untracked
            assert not shardplane.tracks_sharded(ch, tracked.index)
        finally:
            await slots.close()

    asyncio.run(go())


def test_a_sharded_rank_alone_in_its_group_dying_inside_step_0_is_planned_from_its_mirror():
    view = ClusterView(generation=0, members=("a", "b"), spare_nodes=(),
                       slots=(SlotView("a", 0, 0, "running", True, replicas=(0,), sharded=True),
                              SlotView("a", 1, 1, "dead", True, replicas=(1,), sharded=True),
                              SlotView("b", 0, 2, "running", True, replicas=(2,), sharded=True),
                              SlotView("b", 1, None, "spare", True)))
    why = "a DistributedOptimizer's shard exists on this rank only"
    d = plan_for_failure(view, node="a", slot=1, rank=1, reason="exit -9", now_wall=0.0, light_available=False,
                         replicas=(1,), alone=why, sharded=True)
    assert d.action == "plan" and d.plan is not None and d.plan.donor is not None
    # unmarked (the status before the fix), the same death was a whole-group restart
    d = plan_for_failure(view, node="a", slot=1, rank=1, reason="exit -9", now_wall=0.0, light_available=False,
                         replicas=(1,), alone=why, sharded=False)
    assert d.action == "fallback" and why in d.reason


def test_a_node_lost_inside_step_0_is_planned_when_the_survivors_rows_say_sharded():
    def view(sharded: bool) -> ClusterView:
        return ClusterView(generation=0, members=("a", "b"), spare_nodes=("c",),
                           slots=(SlotView("a", 0, 0, "running", True, replicas=(0,), sharded=sharded),
                                  SlotView("a", 1, 1, "running", True, replicas=(1,), sharded=sharded),
                                  SlotView("c", 0, None, "spare", True), SlotView("c", 1, None, "spare", True)),
                           lost=("b",), homes=((0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1)))

    assert plan_for_node_loss(view(True), node="b", now_wall=0.0).action == "plan"
    assert plan_for_node_loss(view(False), node="b", now_wall=0.0).action == "fallback"
