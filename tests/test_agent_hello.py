"""A worker's hello reaches the planners at once: its node publishes its status when the hello arrives, not at
the next periodic publication (up to a second later, more on a loaded host).

The planners decide from the published status: a rank whose status still says it never said hello is taken for a
script without ``tpassrun.init()``, so a taint in that window restarted the whole group (and lost the steps the
job had done) instead of swapping the rank (seen with a taint at step 1 of a megatron job)."""

from __future__ import annotations

import asyncio
import types

from tpassrun.agent.workers import WorkerSpawning
from tpassrun.channel.protocol import Done, Hello
from tpassrun.channel.slots import Slot, SlotState


class _Agent:
    """What WorkerSpawning.on_worker_message uses: the agent state's event log, mirror and queue, and the publication
    (GenerationTasks.publish_status)."""

    def __init__(self) -> None:
        self.published = 0
        self.said: list[str] = []
        self.events = types.SimpleNamespace(write=lambda name, **_: self.said.append(name))
        self.mirror = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.workers = WorkerSpawning(self, self, store=None, tasks=self)    # (the state, and what started)

    async def publish_status(self) -> None:
        self.published += 1


def test_a_ranks_hello_and_a_spares_are_published_at_once():
    async def scenario() -> _Agent:
        agent = _Agent()
        agent.workers.on_worker_message(Slot(0, rank=0, state=SlotState.RUNNING), Hello(pid=11))
        agent.workers.on_worker_message(Slot(1, rank=None, state=SlotState.SPARE), Hello(pid=12, spare=True))
        agent.workers.on_worker_message(Slot(0, rank=0, state=SlotState.RUNNING), Done(step=3))
        await asyncio.sleep(0)
        return agent

    agent = asyncio.run(scenario())
    assert agent.published == 2                      # each hello, nothing else
    assert agent.said == ["spare_ready"]             # only the spare's is an event
    assert agent.queue.qsize() == 3                 # and the supervisor still hears every message
