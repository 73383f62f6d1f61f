"""The worker's :class:`Session`: what :func:`tpassrun.init` returns. The hook protocol (``track``, ``ddp``,
``on_reconfigure``), the step loop (``run``), and a joiner's received state applied piece by piece. The step
transaction is :mod:`tpassrun.worker.step`, the command dispatcher and a rank's commands
:mod:`tpassrun.worker.commands`, a spare's commands :mod:`tpassrun.worker.spare`.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, Iterable

from tpassrun.channel import Field, WorkerPhase
from tpassrun.channel.protocol import Done, Message, MirrorInfo, MirrorInfoRequest, Replicas
from tpassrun.worker.world import BucketLayout, ReconfigurableDDP
from tpassrun.worker.catchup import CatchUpCommand
from tpassrun.worker.commands import BoundaryCommands
from tpassrun.worker.replicas import ReplicaCheck
from tpassrun.worker.failure import classify_failure, note_interrupted
from tpassrun.worker.link import AgentLink
from tpassrun.worker.sharded import ShardedState
from tpassrun.worker.spare import SpareCommands, SpareWait, _apply_one, _bundle_rng, _bundle_step, _has_object, _object_names
from tpassrun.worker.step import StepTransaction

log = logging.getLogger("tpassrun.worker")


def _is_replicated(obj: Any) -> bool:
    """Model, optimizer, scheduler and scaler are identical on every data-parallel replica; the rest
    (samplers, loaders, user counters) is per rank and goes into the per-step light snapshot."""
    import torch

    replicated = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is not None:
        replicated = replicated + (scaler,)
    return isinstance(obj, replicated)


class Session(StepTransaction, BoundaryCommands, CatchUpCommand, SpareCommands, ShardedState, ReplicaCheck):
    """What :func:`init` returns. Create through :func:`init`, not directly."""

    def __init__(self, *, backend: str | None, link: AgentLink | None, rank: int, world_size: int,
                 local_rank: int, generation: int, joined: bool, timeout: timedelta | None) -> None:
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.generation = generation
        self.joined = joined            # True on a spare that took over a rank
        self.step = 0
        self.swaps = 0
        self._timeout = timeout
        self._link = link
        self._tracked: dict[str, Any] = {}
        self._per_rank: set[str] = set()
        self._callbacks: list[Callable[[], Any]] = []
        self._pending_bundle: Any = None      # joiner: state received before the script built its objects
        self._pending_light_bundle: Any = None   # joiner (unplanned): the dead rank's light snapshot
        self._rollback_light: bytes | None = None   # what a rollback restores: the open window's start snapshot
        self._light: Any = None                   # light.LightSnapshotter, made at the first snapshot
        self._size_published = False
        self._reform_times: dict[str, float] = {}
        self._light_enabled = link is not None
        self._light_mirror: Any = None            # light_mirror.LightMirror: this rank pushes its snapshots itself
        self._light_retarget_due = 2              # ask where they go (worker_step._RETARGET_*), 0: settled
        self._light_polls = 0
        self._caught_up: tuple[int, bytes] | None = None   # a mixed commit: (resume step, own light), CatchUp
        self._back_txn: Any = None                # ... and the transaction it goes back to (tpassrun/worker/catchup.py)
        self._txn: Any = None                     # this transaction and the one before (worker_catchup.Txn)
        self._prev_txn: Any = None
        self._first_grad_ns = 0
        self._ddps = 0                  # sess.ddp() calls so far: names their bucket layouts
        # The step as a transaction (see _seal and _commit_point): sealed when its collectives are done,
        # committed when a tracked optimizer starts changing the model.
        self._in_step = -1                        # the step step_fn is executing, -1 outside it
        self._sealed = -1                         # the last step whose per-rank state was sealed
        self._committed = -1                      # the last step that reached its commit point
        self._commit_light: bytes | None = None   # the sealed snapshot, labelled with the next step
        self._commit_snapshots = True             # off once user code after the seal changed per-rank state
        self._seals_verified = 0                  # seals found equal to the next step's start snapshot
        self._hooked: set[int] = set()
        # Sharded state (track_sharded; tpassrun/worker/sharded.py, tpassrun/worker/shards.py): local pre-step copies
        # + a buddy's mirror.
        self._sharded: set[str] = set()
        self._shards: Any = None
        self._shard_restore_due: int | None = None
        self._replica_group: tuple[int, ...] = ()  # declare_replicas(): other ranks holding this one's state
        self._pending_shard_bundle: Any = None    # joiner: the dead rank's shard, from its mirror
        self._spare: SpareWait | None = None      # set while this session is a spare (no rank yet)
        self._pending: list[Message] = []         # commands that came while a spare waited for its sender
        self._stands_at: int | None = None        # the step it waits at after a re-formed world was given up
        self._replicas_due: bool | None = None    # a swap or recovery ended: replicas compare digests (worker_digest)
        # Gradient accumulation across steps: a step that ends without reaching its commit point leaves its
        # gradients to the next one, so the steps since the last commit form one window, rolled back as one.
        self._commit_hooks = 0                    # tracked optimizers and scalers: commits are observable
        self._window = 0                          # the first step of the open window (== the step outside one)
        self._failed_seal: bytes | None = None    # a step that failed after its commit point: its seal
        self._scaler_updates: dict[int, int] = {}  # GradScaler.update() calls, per tracked scaler
        self._mark_sources: Any = None             # (cache key, what _replicated_marks reads)
        self._window_marks: dict[str, int] | None = None   # schedulers'/scalers' steps at the window's start
        self._last_window_marks: dict[str, int] | None = None   # ... and at the last complete window's start

    # --- the hook protocol ---
    def track(self, **objects: Any) -> "Session":
        """Register objects with ``state_dict()``/``load_state_dict()`` to carry across a swap."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"tpassrun: {name!r} has no state_dict()/load_state_dict()")
            self._tracked[name] = obj
            if not _is_replicated(obj):
                self._per_rank.add(name)
            self._hook_commit_point(obj)
            self._apply_pending_to(name, obj)
        return self

    def track_replicated(self, **objects: Any) -> "Session":
        """Like :meth:`track`, for objects every data-parallel replica holds identically (sent only at a
        handoff, never in the per-step light snapshot), whatever their type."""
        self.track(**objects)
        self._per_rank.difference_update(objects)
        return self

    def track_per_rank(self, **objects: Any) -> "Session":
        """Like :meth:`track`, for objects that differ between ranks even if they look like models."""
        self.track(**objects)
        self._per_rank.update(objects)
        return self

    def declare_replicas(self, ranks: Iterable[int], alone: str = "") -> tuple[int, ...]:
        """Framework adapters: the ranks, this one included, holding exactly this rank's model and optimizer
        state (HSDP: the ranks with the same shard coordinates in the other replica groups; pure FSDP, ZeRO >= 1:
        this rank alone, and ``alone`` says why). An unplanned recovery of this rank then takes its state from a
        live one of them, or restarts the group at once saying why. Without a declaration every rank is taken to
        hold the same state (plain data parallelism)."""
        group = tuple(sorted({int(r) for r in ranks}))
        if self.rank not in group:
            raise ValueError(f"tpassrun: rank {self.rank}'s replica group {list(group)} does not contain it")
        if self._link is not None:
            self._link.send(Replicas(ranks=group, alone=alone[:300]))
        self._replica_group = group
        self._shard_retarget()              # sharded state with replicas needs no mirror (tpassrun/worker/sharded.py)
        return group

    def ddp(self, module: Any, **kwargs: Any) -> "ReconfigurableDDP":
        """``DistributedDataParallel(module, **kwargs)`` that rebuilds itself after every re-formed world.

        Track ``module`` before calling this, so that a joiner holds the right weights before DDP
        broadcasts rank 0's parameters (the joiner may be rank 0).
        """
        # The bucket layout travels with the replicated state (a joiner loads it here, before building)
        layout = BucketLayout()
        self.track_replicated(**{f"tpassrun.ddp{self._ddps}.buckets": layout})
        self._ddps += 1
        proxy = ReconfigurableDDP(module, kwargs, synced=self.joined, layout=layout)
        self._watch_first_grad(module)
        self.on_reconfigure(proxy.rebuild)
        return proxy

    def _watch_first_grad(self, module: Any) -> None:
        # A synchronous job's step time is the same on every rank (the all-reduce waits for the slowest);
        # the time until the first gradient, before any collective, is what shows which rank is slow.
        def hook(grad: Any) -> None:
            if not self._first_grad_ns:
                self._first_grad_ns = time.monotonic_ns()

        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(hook)

    def on_reconfigure(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Run ``fn()`` after each re-formed world on every surviving rank (rebuild DDP, new_group()s)."""
        self._callbacks.append(fn)
        return fn

    @property
    def managed(self) -> bool:
        return self._link is not None

    def mirror_target(self) -> Any:
        """Where this rank's redundant copies go: its node's buddy mirror (a :class:`tpassrun.mirror.MirrorTarget`,
        whose ``client()`` puts copies there), asked from the agent over the private socket; None when not
        launched by tpassrun or when no other node can hold them. Call it from the main thread while running
        (not from a helper thread), again after a re-formed world: the ring may have changed."""
        if self._link is None:
            return None
        from tpassrun.mirror import MirrorTarget

        answer = self._link.request(MirrorInfoRequest(), MirrorInfo)
        buddy = answer.buddy if isinstance(answer, MirrorInfo) else None
        return MirrorTarget.from_json(buddy) if buddy else None

    # --- the step loop ---
    def run(self, step_fn: Callable[[int], Any], total_steps: int) -> int:
        """Call ``step_fn(step)`` from the current step up to ``total_steps``; swaps happen in between."""
        self._apply_pending()
        link = self._link
        if link is None:
            while self.step < total_steps:
                step_fn(self.step)
                self.step += 1
            return self.step
        link.set(Field.RUN_FROM, self.step + 1)
        link.set(Field.TOTAL, max(0, int(total_steps)))
        link.set(Field.PHASE, WorkerPhase.RUNNING)
        self._window = self.step
        self._window_marks = self._replicated_marks()
        while self.step < total_steps:
            step = self.step
            start = time.monotonic_ns()
            link.set(Field.HEARTBEAT_NS, start)
            run_until = link.get(Field.RUN_UNTIL)
            if run_until <= step and (run_until < 0 or self._window == step):
                link.set(Field.PHASE, WorkerPhase.PAUSING)   # never "running step B" while it parks before B
                link.set(Field.STEP, step)
                self._at_boundary(step)
                if self.step != step:     # a recovery moved us (never forward past work not done)
                    continue
                start = time.monotonic_ns()
            # (published after the boundary check: an agent never sees "running step B" from a rank about to
            # pause at B)
            link.set(Field.STEP, step)
            if self._light_retarget_due:
                self._light_retarget()
            if self._light_enabled:
                self._snapshot_light(step)
            if self._replicas_due is not None and self._check_replicas(step):
                continue    # a peer died in the check, or no replica can be trusted: a recovery or restart moved us
            if self._window == step:    # (inside an accumulation window no step start is a resume point)
                self._begin_txn(step)
                self._shard_begin(step, self._rollback_light)
            link.set(Field.PHASE, WorkerPhase.RUNNING)
            self._first_grad_ns = 0
            self._in_step = step
            try:
                step_fn(step)
            except Exception as exc:  # noqa: BLE001 - classified right below
                self._in_step = -1
                kind = classify_failure(exc)
                if not kind.distributed:
                    kind = self._ask_cause(step, exc)   # a casualty of a peer's failure, or its own error
                if not kind.distributed:
                    link.set(Field.PHASE, WorkerPhase.RAISED)   # a user error: torchrun's path, not a spare
                    raise
                note_interrupted(self.rank, f"step {step}", kind, exc)
                self._after_failure(step, exc, kind)
                continue
            self._in_step = -1
            self.step = step + 1
            self._shard_fence()    # a step without a commit point (no tracked optimizer): its copy ends here
            if not (self._commit_hooks and self._committed != step):
                self._window = step + 1   # else no commit: its gradients carry over (accumulation), the window stays open
                if self._committed == step:
                    self._window_closed()
            end = time.monotonic_ns()
            link.set(Field.LAST_STEP_NS, end - start)
            link.set(Field.LAST_COMPUTE_NS, (self._first_grad_ns or end) - start)
            if not self._size_published:   # once: after a step, so the optimizer's state exists
                self._size_published = True
                link.set(Field.STATE_BYTES, self._tracked_nbytes())
        link.set(Field.STEP, self.step)
        self._shard_close()
        link.set(Field.PHASE, WorkerPhase.DONE)
        link.send(Done(step=self.step))
        return self.step

    def _tracked_nbytes(self) -> int:
        """Tensor bytes a handoff of this rank streams (capture copies nothing; 0 if it cannot travel)."""
        from tpassrun.transfer import handoff

        try:
            return handoff.capture(self._tracked, step=self.step).nbytes
        except handoff.HandoffError:
            return 0

    def _apply_pending_to(self, name: str, obj: Any) -> None:
        """On a joiner, load ``name``'s received state as soon as the script tracks it, so that a model is
        right before DDP broadcasts from rank 0 and an optimizer before anything reads it."""
        for attr in ("_pending_bundle", "_pending_light_bundle", "_pending_shard_bundle"):
            bundle = getattr(self, attr)
            if bundle is not None and _has_object(bundle, name):
                _apply_one(bundle, name, obj)

    def _apply_pending(self) -> None:
        """At the start of :meth:`run` on a joiner: everything not applied yet, then RNG and step."""
        from tpassrun.transfer import handoff

        for attr in ("_pending_bundle", "_pending_light_bundle", "_pending_shard_bundle"):
            bundle = getattr(self, attr)
            if bundle is None:
                continue
            missing = [n for n in _object_names(bundle) if n not in self._tracked]
            if missing:
                raise RuntimeError(f"tpassrun: the joiner received state for {missing} but the script did not "
                                   "track objects with those names before run()")
        light, bundle = self._pending_light_bundle, self._pending_bundle
        rng_source = light if light is not None else bundle
        if rng_source is not None:
            rng = _bundle_rng(rng_source)
            if rng is not None:
                handoff.restore_rng(rng)
            self.step = _bundle_step(rng_source)
        self._pending_bundle = self._pending_light_bundle = self._pending_shard_bundle = None
