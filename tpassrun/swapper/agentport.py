"""What the agent hands its swap control plane (the swapper) and its health daemon: a narrow port, not itself.

The agent owns the process table, the rendezvous handle and the supervision loop; the swapper and the health
daemon see only what is named here, and talk back through typed :class:`AgentEvent` s posted on the agent's
queue (never its private members). This module imports no agent code, so ``agent -> swapper -> port`` has no
circle.

Which generation (docs/concepts.md, "Which generation"): each notion has one name here, and every reader goes
through it.

* **running** (:attr:`AgentPort.generation`): the generation record this agent runs its workers in, as it adopted
  it (at the group's start, then at each swap's commit).
* **latest** (:meth:`AgentPort.latest`): the newest record the rendezvous handle has read (no I/O; None before
  its first read). Ahead of the running one in place (same number: the leader annotates lost nodes and spare
  nodes that joined) or by number (a restart, or a commit this agent has not adopted yet).
* **annotated** (:meth:`AgentPort.annotated`, :func:`annotated`): the running generation as it reads now: the
  latest record when it has the running one's number, else the running one.
* **spawned** (:attr:`AgentPort.spawned_generation`): the number of the generation whose start spawned this
  node's workers (swaps keep them; a spare node's is the one it joined in).
* **formed** (:attr:`AgentPort.formed_generation`, ``Generation.formed``): the number of the run's last
  whole-group restart, the same on every agent.
* **epoch** (:meth:`AgentPort.epoch`): since when records and mirror copies count: the formed generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol, Union, overload

if TYPE_CHECKING:
    from tpassrun.channel import Done, Failed, Hello, LocalSlots, Raised, Slot
    from tpassrun.rendezvous import EtcdRendezvous, Generation, RdzvEvent
    from tpassrun.settings import LaunchConfig


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
    message: "Hello | Done | Failed | Raised"      # what a worker said that its agent's supervisor handles


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
    rank: int | None = None          # the tainted rank, when one is (the transparent mode moves it instead)


@dataclass(frozen=True)
class LeaseLost:
    reason: str


@dataclass(frozen=True)
class HandedBack:
    """The leader hands this node back to the scheduler (``handbacks/<node>``): holding no rank, the agent stops its
    spares and exits 0 (its part of the scheduler's job step ends cleanly)."""

    reason: str


AgentEvent = Union[SignalReceived, SpawnFailed, WorkerExited, WorkerSaid, RendezvousChanged, FallbackRequested,
                   HealthRestartRequested, LeaseLost, HandedBack]


# --------------------------------------------------------------------------------------------- the port
class EventSink(Protocol):
    def write(self, event: str, **fields: Any) -> object: ...   # an event log returns what it wrote


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
    generation: Callable[[], "Generation | None"]          # running: the generation the agent runs in now
    spawned_generation: Callable[[], int]                  # spawned: the generation whose start spawned the workers here
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
    # formed: the generation of the run's last whole-group restart (``Generation.formed``): the same on every agent,
    # where spawned_generation is the one a spare node joined in. None: spawned_generation (tests' ports)
    formed_generation: "Callable[[], int] | None" = None

    def latest(self) -> "Generation | None":
        """The newest generation record the rendezvous handle has read (no I/O; None before its first read): the
        running one, rewritten in place since, or a later one this agent has not adopted (yet)."""
        return self.rdzv.generation

    def annotated(self) -> "Generation | None":
        """The running generation as it reads now (:func:`annotated`): with the lost nodes and the spare nodes that
        joined since it formed."""
        return annotated(self.generation(), self.latest())

    def epoch(self) -> int:
        """Since when records and copies count: the last whole-group restart's generation (formed). Plans and
        failures of an older one are stale; mirror copies carry it as their epoch. The same number on every agent,
        never a spare node's spawn generation: a leader that joined late and a buddy judge plans, deaths and copies
        as every other agent does."""
        return self.formed_generation() if self.formed_generation is not None else self.spawned_generation()


@overload
def annotated(running: "Generation", latest: "Generation | None") -> "Generation": ...
@overload
def annotated(running: "Generation | None", latest: "Generation | None") -> "Generation | None": ...
def annotated(running: "Generation | None", latest: "Generation | None") -> "Generation | None":
    """``running`` as the rendezvous rewrote it since: ``latest`` when it is the same generation (the leader
    annotates lost nodes and joined spare nodes in place, keeping the number), else ``running`` (a later record is
    another generation, not adopted here yet)."""
    if running is not None and latest is not None and latest.number == running.number:
        return latest
    return running


class HealthHost(Protocol):
    """One agent as its health daemon sees it."""

    node_id: str
    cfg: "LaunchConfig"         # health_config, health_interval, health_file, straggler_factor
    environ: dict[str, str]
    rdzv: "EtcdRendezvous"
    slots: "LocalSlots"
    events: EventSink


class StatusHost(Protocol):
    """One started agent as its metrics endpoint and its run-registry entry see it (read only)."""

    @property
    def node_id(self) -> str: ...
    @property
    def cfg(self) -> "LaunchConfig": ...          # the launch settings (run id, metrics port, nproc, spares, rdzv conf)
    @property
    def logs(self) -> Any: ...                    # procs.RunLogs (the run's log dir)
    @property
    def events(self) -> Any: ...                  # events.EventLog (listeners are added to it)
    @property
    def slots(self) -> "LocalSlots": ...
    @property
    def generation(self) -> "Generation | None": ...


__all__ = ["AgentEvent", "AgentPort", "annotated", "EventSink", "HealthHost", "StatusHost", "FallbackRequested", "HandedBack",
           "HealthRestartRequested", "LeaseLost",
           "RendezvousChanged", "SignalReceived", "SpawnFailed", "SwapSettings", "WorkerExited", "WorkerSaid"]
