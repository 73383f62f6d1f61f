"""What the agent hands its swap control plane (the swapper) and its health daemon: a narrow port, not itself.

The agent owns the process table, the rendezvous handle and the supervision loop; the swapper and the health
daemon see only what is named here, and talk back through typed :class:`AgentEvent` s posted on the agent's
queue (never its private members). This module imports no agent code, so ``agent -> swapper -> port`` has no
circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Union

if TYPE_CHECKING:
    from tpassrun.channel.protocol import Done, Failed, Hello
    from tpassrun.settings import LaunchConfig
    from tpassrun.rendezvous import EtcdRendezvous, Generation, RdzvEvent
    from tpassrun.channel.slots import LocalSlots, Slot


# --------------------------------------------------------------------------------------------- agent events
@dataclass(frozen=True)
class SignalReceived:
    signal: int


@dataclass(frozen=True)
class SpawnFailed:
    slot: "Slot"
    error: BaseException


@dataclass(frozen=True)
class WorkerExited:
    slot: "Slot"
    proc: Any
    code: int


@dataclass(frozen=True)
class WorkerSaid:
    slot: "Slot"
    message: "Hello | Done | Failed"      # what a worker said that its agent's supervisor handles


@dataclass(frozen=True)
class RendezvousChanged:
    event: "RdzvEvent"


@dataclass(frozen=True)
class FallbackRequested:
    """No live recovery: restart the group (spends a restart, as a worker failure does, unless ``free``)."""

    reason: str
    slot: "Slot | None" = None
    free: bool = False              # the planner found a live recovery impossible: spends no --max-restarts


@dataclass(frozen=True)
class HealthRestartRequested:
    """A tainted rank cannot swap live: restart the group without the slot (costs no restart)."""

    reason: str


@dataclass(frozen=True)
class LeaseLost:
    reason: str


AgentEvent = Union[SignalReceived, SpawnFailed, WorkerExited, WorkerSaid, RendezvousChanged, FallbackRequested,
                   HealthRestartRequested, LeaseLost]


# --------------------------------------------------------------------------------------------- the port
class EventSink(Protocol):
    def write(self, event: str, **fields: Any) -> None: ...


@dataclass(frozen=True)
class SwapSettings:
    """The launch settings the swap control plane reads."""

    nproc_per_node: int
    spares_per_node: int
    migrate_back: bool = False
    pool_wait: float = 0.0      # --spare-pool: how long a lost node's recovery may wait for a pool node (0: no pool)


@dataclass(frozen=True)
class AgentPort:
    """One agent as its swapper sees it. Values are fixed for the agent's life; callables read live state."""

    node_id: str
    addr: str
    settings: SwapSettings
    events: EventSink
    rdzv: "EtcdRendezvous"
    slots: "LocalSlots"
    generation: Callable[[], "Generation | None"]          # the generation the agent runs in now
    spawned_generation: Callable[[], int]                  # the generation whose start spawned the workers here
    master: Callable[[], tuple[str, int]]                  # the workers' store of the current generation
    set_generation: Callable[["Generation"], None]         # a swap committed the next generation
    spawn_spare: Callable[["Slot"], Awaitable[None]]       # start a warm spare in a slot
    publish_status: Callable[[], Awaitable[None]]
    post: Callable[[AgentEvent], None]                     # onto the agent's supervision queue
    store_host: Callable[[], "str | None"] = lambda: None   # the node running that store
    set_master: Callable[[tuple[str, int], "str | None"], None] = lambda addr, host: None   # a swap moved it
    start_store: "Callable[[], Awaitable[tuple[str, int]]] | None" = None   # host a new one here (its address)
    store_ready: "Callable[[float], Awaitable[bool]] | None" = None   # the store run here accepts connections
    mirror: Callable[[], Any] = lambda: None   # this node's mirrorplane.MirrorPlane (its mirror store), or None
    # the generation of the run's last whole-group restart (``Generation.formed``): the same on every agent, where
    # spawned_generation is the one a spare node joined in. None: spawned_generation (tests' ports)
    formed_generation: "Callable[[], int] | None" = None

    def epoch(self) -> int:
        """Since when records and copies count: the last whole-group restart's generation. Plans and failures of
        an older one are stale; mirror copies carry it as their epoch. The same number on every agent: a spare
        node's own spawn generation (the one it joined in) made a leader that joined late take the era's plans and
        deaths for stale, and a joiner's buddy refuse its light copies as older than those already held."""
        return self.formed_generation() if self.formed_generation is not None else self.spawned_generation()


class HealthHost(Protocol):
    """One agent as its health daemon sees it."""

    node_id: str
    cfg: "LaunchConfig"         # health_config, health_interval, health_file, straggler_factor
    environ: dict[str, str]
    rdzv: "EtcdRendezvous"
    slots: "LocalSlots"
    events: EventSink


class StatusHost(Protocol):
    """One agent as its metrics endpoint and its run-registry entry see it."""

    node_id: str
    cfg: "LaunchConfig"            # the launch settings (run id, metrics port, nproc, spares, rdzv conf)
    logs: Any                      # procs.RunLogs (the run's log dir)
    events: Any                    # events.EventLog (listeners are added to it)
    slots: "LocalSlots | None"
    generation: "Generation | None"


__all__ = ["AgentEvent", "AgentPort", "EventSink", "HealthHost", "StatusHost", "FallbackRequested",
           "HealthRestartRequested", "LeaseLost",
           "RendezvousChanged", "SignalReceived", "SpawnFailed", "SwapSettings", "WorkerExited", "WorkerSaid"]
