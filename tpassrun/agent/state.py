"""What a :class:`tpassrun.agent.Agent` and its parts share: :class:`AgentState` (from construction on) and
:class:`Started` (what exists once the agent has started: its rendezvous, slots, swapper, mirror and health daemon).

An Agent is composed of parts that each own one concern (the workers' store, the workers, the generation's
background tasks, the cause of a worker's exception, supervision); each holds these two objects and the parts it
calls, never the Agent, and is made once the agent has started, so nothing it reads is ever None. Every field is
declared here with its type, so that a reader (and mypy) sees who reads and writes what. A field one part alone
uses lives in that part.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Awaitable

from tpassrun.launch import ProcessFailure, RunLogs
from tpassrun.ops import EventLog, Progress
from tpassrun.rendezvous import EtcdRendezvous, Generation, Member
from tpassrun.settings import LaunchConfig
from tpassrun.swapper import AgentEvent, EventSink, StatusHost

if TYPE_CHECKING:
    from tpassrun.agent.healthd import AgentHealth
    from tpassrun.channel import LocalSlots
    from tpassrun.swapper import MirrorPlane, Swapper


@dataclasses.dataclass(slots=True, eq=False)
class AgentState:
    """One node's agent: who it is, what its run allows, what it runs now. Set once: ``cfg``, ``node_id``, ``addr``, ``logs``;
    ``events``, ``environ``, ``run_key_file``, ``credentials_file`` and ``devices`` once while the agent starts
    (``Agent._run``), before a generation runs (what the start makes is :class:`Started`)."""

    cfg: LaunchConfig
    environ: dict[str, str]             # what workers are given: the user's environment without the run key
    node_id: str
    addr: str
    logs: RunLogs
    events: EventLog
    remaining_restarts: int
    # A death a spare should have absorbed, whose live recovery turned out impossible, restarts the group without
    # spending --max-restarts (the user gave spares, not a restart budget), at most once per spare of this node: a
    # rank killed over and over still ends in torchrun's failure report.
    free_fallbacks: int
    # --- found while the agent starts (None: there is none) ---
    run_key_file: str | None = None     # an embedded etcd's run key (0600, in its private dir): tpassctl verifies with it
    credentials_file: str | None = None   # an embedded etcd's root password file (0600)
    devices: list[str] | None = None    # the node's GPUs in slot order (tpassrun/launch/devices.py); None: no GPU
    # --- the generation (Agent._generations, and a swap's commit through the swapper's port) ---
    generation: Generation | None = None
    queue: asyncio.Queue[AgentEvent] = dataclasses.field(default_factory=asyncio.Queue)   # replaced by each one
    failures: list[ProcessFailure] = dataclasses.field(default_factory=list)
    progress: Progress = dataclasses.field(default_factory=Progress)   # the steps its ranks run: what a restart redoes
    master: tuple[str, int] = ("", 0)   # the workers' store of the current generation
    store_host: str | None = None       # the node running it (group rank 0's, or a swap's)
    spawned_generation: int = 0         # the generation whose start spawned the current workers (swaps keep them)
    formed_generation: int = 0          # the run's last whole-group restart's (Generation.formed): port.epoch()
    # --- signals ---
    signal_received: int | None = None
    given_back: str = ""                # a SIGTERM from this node's pool node giving it back (why); see on_signal
    handed_back: str = ""               # the leader handed this node back to the scheduler (why): it leaves, exit 0
    cut_by_signal: set[asyncio.Future[Any]] = dataclasses.field(default_factory=set)   # etcd requests a signal cuts short

    @property
    def restart_count(self) -> int:
        return self.cfg.max_restarts - self.remaining_restarts

    def member(self, gen: Generation) -> Member | None:
        """This node's place among ``gen``'s members, or None when it runs no rank there: a spare node, or a
        member lost earlier whose ranks swaps moved to other nodes, back as a spare node (rendezvous.machine)."""
        me = gen.member(self.node_id)
        return me if me is not None and gen.placed(self.node_id) else None

    async def until_signal(self, aw: Awaitable[Any]) -> bool:
        """Await an etcd request that may wait out an outage for as long as it lasts; a signal cuts it short
        (-> False). Every request the supervisor makes between a worker's event and the next one goes through
        here: a signal is obeyed in seconds even while etcd is gone."""
        if self.signal_received is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            return False
        task = asyncio.ensure_future(aw)
        self.cut_by_signal.add(task)
        try:
            await task
            return True
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and self.signal_received is not None and not (me and me.cancelling()):
                return False
            raise
        finally:
            self.cut_by_signal.discard(task)

    def host(self, rdzv: EtcdRendezvous, slots: LocalSlots) -> NodeHost:
        """What the health daemon and the scheduler watcher read of this agent, once it has a rendezvous and slots."""
        return NodeHost(node_id=self.node_id, cfg=self.cfg, environ=self.environ, rdzv=rdzv, slots=slots,
                        events=self.events)

    def status(self, slots: LocalSlots) -> StatusHost:
        """What the metrics endpoint and the run registry read of this agent, once it has slots."""
        return AgentStatus(self, slots)


@dataclasses.dataclass(frozen=True, eq=False)
class Started:
    """What an agent has once started (``Agent._run``, before a generation runs), for the rest of its life."""

    rdzv: EtcdRendezvous
    slots: LocalSlots
    swapper: Swapper
    mirror: MirrorPlane        # this node's mirror store and its light mirror (tpassrun/swapper/mirrorplane.py)
    health: AgentHealth        # one per agent, run in every generation


class AgentStatus:
    """:class:`tpassrun.swapper.agentport.StatusHost` of one agent: read when the metrics are scraped (the current
    generation) and when the run is registered."""

    def __init__(self, state: AgentState, slots: LocalSlots) -> None:
        self._state = state
        self._slots = slots

    @property
    def node_id(self) -> str:
        return self._state.node_id

    @property
    def cfg(self) -> LaunchConfig:
        return self._state.cfg

    @property
    def logs(self) -> RunLogs:
        return self._state.logs

    @property
    def events(self) -> EventLog:
        return self._state.events

    @property
    def slots(self) -> LocalSlots:
        return self._slots

    @property
    def generation(self) -> Generation | None:
        return self._state.generation

    @property
    def run_key_file(self) -> str | None:
        return self._state.run_key_file

    @property
    def credentials_file(self) -> str | None:
        return self._state.credentials_file


@dataclasses.dataclass(eq=False)
class NodeHost:
    """One agent as its health daemon (:class:`tpassrun.swapper.agentport.HealthHost`) and its scheduler watcher
    (:class:`tpassrun.scheduler.watch.SchedulerHost`) see it: values fixed once the agent has started."""

    node_id: str
    cfg: LaunchConfig
    environ: dict[str, str]
    rdzv: EtcdRendezvous
    slots: LocalSlots
    events: EventSink


__all__ = ["AgentState", "AgentStatus", "NodeHost", "Started"]
