"""The one state a :class:`tpassrun.worker.session.Session` and its collaborators share: :class:`WorkerState`.

A Session is composed of parts that each own one concern (the step transaction, the command server, a spare's
commands, catch-up, sharded state, the replica check); each holds this object and the parts it calls, never the
Session. Every field is declared here with its type, so that a reader (and mypy) sees who reads and writes what.
"""

from __future__ import annotations

import dataclasses
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from tpassrun.channel import Assign, Message

if TYPE_CHECKING:
    from tpassrun.transfer import LightSnapshotter
    from tpassrun.worker.light_mirror import LightMirror
    from tpassrun.worker.link import AgentLink
    from tpassrun.worker.shards import ShardState

# A transaction (an accumulation window; one step outside one) as going back to its start needs it: its first step,
# its start snapshot, the schedulers'/scalers' step counts at its start and at the one before (replicated_marks).
Txn = tuple[int, "bytes | None", "dict[str, int] | None", "dict[str, int] | None"]


@dataclasses.dataclass
class SpareWait:
    """What a spare holds while it waits for its rank."""

    assign: Assign | None = None
    bundle: Any = None                  # the assigned rank's state, once received
    light: bytes | None = None          # unplanned: the dead rank's light snapshot
    mirrored: tuple[Any, bytes | None] | None = None   # the dead rank's shard and light snapshot, from its mirror
    listener: socket.socket | None = None


@dataclasses.dataclass(slots=True, eq=False)
class WorkerState:
    """A worker's state: who it is in the world, what it tracks, where its step transaction stands."""

    backend: str | None
    link: AgentLink | None              # None: not launched by tpassrun (a plain loop)
    rank: int
    world_size: int
    local_rank: int
    generation: int
    joined: bool                        # True on a spare that took over a rank
    timeout: timedelta | None
    step: int = 0
    swaps: int = 0
    # --- the hook protocol ---
    tracked: dict[str, Any] = dataclasses.field(default_factory=dict)
    per_rank: set[str] = dataclasses.field(default_factory=set)
    callbacks: list[Callable[[], Any]] = dataclasses.field(default_factory=list)
    ddps: int = 0                       # sess.ddp() calls so far: names their bucket layouts
    first_grad_ns: int = 0
    size_published: bool = False
    reform_times: dict[str, float] = dataclasses.field(default_factory=dict)
    # --- a joiner's received state, applied as the script tracks its objects ---
    pending_bundle: Any = None          # state received before the script built its objects
    pending_light_bundle: Any = None    # (unplanned) the dead rank's light snapshot
    pending_shard_bundle: Any = None    # the dead rank's shard, from its mirror
    # --- light snapshots (tpassrun/worker/step.py) ---
    light_enabled: bool = False
    light: LightSnapshotter | None = None   # made at the first snapshot
    rollback_light: bytes | None = None     # what a rollback restores: the open window's start snapshot
    light_mirror: LightMirror | None = None  # this rank pushes its snapshots itself
    light_retarget_due: int = 2         # ask where they go (step._RETARGET_*), 0: settled
    light_polls: int = 0
    # --- the step as a transaction: sealed when its collectives are done, committed when a tracked optimizer
    # starts changing the model (tpassrun/worker/step.py) ---
    in_step: int = -1                   # the step step_fn is executing, -1 outside it
    sealed: int = -1                    # the last step whose per-rank state was sealed
    committed: int = -1                 # the last step that reached its commit point
    commit_light: bytes | None = None   # the sealed snapshot, labelled with the next step
    commit_snapshots: bool = True       # off once user code after the seal changed per-rank state
    seals_verified: int = 0             # seals found equal to the next step's start snapshot
    hooked: set[int] = dataclasses.field(default_factory=set)
    # Gradient accumulation across steps: a step that ends without reaching its commit point leaves its gradients
    # to the next one, so the steps since the last commit form one window, rolled back as one.
    commit_hooks: int = 0               # tracked optimizers and scalers: commits are observable
    window: int = 0                     # the first step of the open window (== the step outside one)
    failed_seal: bytes | None = None    # a step that failed after its commit point: its seal
    scaler_updates: dict[int, int] = dataclasses.field(default_factory=dict)   # GradScaler.update() calls
    mark_sources: tuple[tuple[int, int], list[tuple[str, Any, bool]]] | None = None   # (cache key, what marks read)
    window_marks: dict[str, int] | None = None        # schedulers'/scalers' steps at the window's start
    last_window_marks: dict[str, int] | None = None   # ... and at the last complete window's start
    # --- a mixed commit (tpassrun/worker/catchup.py) ---
    caught_up: tuple[int, bytes] | None = None   # (resume step, own light), from CatchUp
    back_txn: Txn | None = None         # ... and the transaction it goes back to
    txn: Txn | None = None              # this transaction and the one before
    prev_txn: Txn | None = None
    # --- sharded state (track_sharded; tpassrun/worker/sharded.py): local pre-step copies + a buddy's mirror ---
    sharded: set[str] = dataclasses.field(default_factory=set)
    shards: ShardState | None = None
    shard_restore_due: int | None = None
    replica_group: tuple[int, ...] = ()   # declare_replicas(): other ranks holding this one's state
    # --- commands (tpassrun/worker/commands.py, spare.py) ---
    spare: SpareWait | None = None      # set while this session is a spare (no rank yet)
    pending: list[Message] = dataclasses.field(default_factory=list)   # commands that came while a spare waited
    serve_step: int = 0                 # the step the command server serves at (a shard rollback moves it)
    stands_at: int | None = None        # the step it waits at after a re-formed world was given up
    replicas_due: bool | None = None    # a swap or recovery ended: replicas compare digests (replicas.py)

    def managed_link(self) -> AgentLink:
        """The link to the agent, on a worker launched by tpassrun (the only kind that obeys commands)."""
        link = self.link
        assert link is not None, "tpassrun: a worker not launched by tpassrun has no agent"
        return link


__all__ = ["SpareWait", "Txn", "WorkerState"]
