"""The worker's :class:`Session`: what :func:`tpassrun.init` returns. The hook protocol (``track``, ``ddp``,
``on_reconfigure``), the step loop (``run``), and a joiner's received state applied piece by piece. Its parts share
one :class:`~tpassrun.worker.state.WorkerState`: the step transaction is :mod:`tpassrun.worker.step`, the command
dispatcher and a rank's commands :mod:`tpassrun.worker.commands`, a spare's commands :mod:`tpassrun.worker.spare`.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable, Iterable

from tpassrun.channel import Done, Field, MirrorInfo, MirrorInfoRequest, Replicas, WorkerPhase
from tpassrun.worker.catchup import CatchUpCommand
from tpassrun.worker.commands import BoundaryCommands
from tpassrun.worker.failure import classify_failure, note_interrupted
from tpassrun.worker.link import AgentLink
from tpassrun.worker.receive import _apply_one, _bundle_rng, _bundle_step, _has_object, _object_names
from tpassrun.worker.replicas import ReplicaCheck
from tpassrun.worker.sharded import ShardedState
from tpassrun.worker.spare import SpareCommands
from tpassrun.worker.state import WorkerState
from tpassrun.worker.step import StepTransaction
from tpassrun.worker.world import BucketLayout, ReconfigurableDDP

log = logging.getLogger("tpassrun.worker")


def _is_replicated(obj: Any) -> bool:
    """Model, optimizer, scheduler and scaler are identical on every data-parallel replica; the rest
    (samplers, loaders, user counters) is per rank and goes into the per-step light snapshot."""
    import torch

    replicated: tuple[type, ...] = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is not None:
        replicated = replicated + (scaler,)
    return isinstance(obj, replicated)


class Session:
    """What :func:`init` returns. Create through :func:`init`, not directly.

    Composed of parts that share one :class:`~tpassrun.worker.state.WorkerState` (each holds it and the parts
    it calls): the step transaction (step.py), sharded state (sharded.py), catch-up (catchup.py), the replica
    check (replicas.py), the command server with a rank's commands (commands.py) and a spare's (spare.py)."""

    def __init__(self, *, backend: str | None, link: AgentLink | None, rank: int, world_size: int,
                 local_rank: int, generation: int, joined: bool, timeout: timedelta | None) -> None:
        self._state = state = WorkerState(backend=backend, link=link, rank=rank, world_size=world_size,
                                          local_rank=local_rank, generation=generation, joined=joined,
                                          timeout=timeout, light_enabled=link is not None)
        self._txn = StepTransaction(state)
        self._sharded = ShardedState(state, self._txn)
        self._catchup = CatchUpCommand(state, self._txn)
        self._replicas = ReplicaCheck(state, self._txn)
        self._commands = BoundaryCommands(state, self._txn, self._sharded, self._catchup, self._replicas)
        self._spares = SpareCommands(state, self._commands, self._replicas)
        self._commands.spare_table = self._spares.table()

    # --- who this worker is (read from the shared state; ``step`` may be set before ``run``) ---
    @property
    def backend(self) -> str | None:
        return self._state.backend

    @property
    def rank(self) -> int:
        return self._state.rank

    @property
    def world_size(self) -> int:
        return self._state.world_size

    @property
    def local_rank(self) -> int:
        return self._state.local_rank

    @property
    def generation(self) -> int:
        return self._state.generation

    @property
    def joined(self) -> bool:
        """True on a spare that took over a rank."""
        return self._state.joined

    @property
    def swaps(self) -> int:
        return self._state.swaps

    @property
    def step(self) -> int:
        return self._state.step

    @step.setter
    def step(self, value: int) -> None:
        self._state.step = value

    # --- the hook protocol ---
    def track(self, **objects: Any) -> "Session":
        """Register objects with ``state_dict()``/``load_state_dict()`` to carry across a swap."""
        st = self._state
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"tpassrun: {name!r} has no state_dict()/load_state_dict()")
            st.tracked[name] = obj
            if not _is_replicated(obj):
                st.per_rank.add(name)
            self._txn.hook_commit_point(obj)
            self._apply_pending_to(name, obj)
        return self

    def track_replicated(self, **objects: Any) -> "Session":
        """Like :meth:`track`, for objects every data-parallel replica holds identically (sent only at a
        handoff, never in the per-step light snapshot), whatever their type."""
        self.track(**objects)
        self._state.per_rank.difference_update(objects)
        return self

    def track_per_rank(self, **objects: Any) -> "Session":
        """Like :meth:`track`, for objects that differ between ranks even if they look like models."""
        self.track(**objects)
        self._state.per_rank.update(objects)
        return self

    def declare_replicas(self, ranks: Iterable[int], alone: str = "") -> tuple[int, ...]:
        """Framework adapters: the ranks, this one included, holding exactly this rank's model and optimizer
        state (HSDP: the ranks with the same shard coordinates in the other replica groups; pure FSDP, ZeRO >= 1:
        this rank alone, and ``alone`` says why). An unplanned recovery of this rank then takes its state from a
        live one of them, or restarts the group at once saying why. Without a declaration every rank is taken to
        hold the same state (plain data parallelism)."""
        st = self._state
        group = tuple(sorted({int(r) for r in ranks}))
        if st.rank not in group:
            raise ValueError(f"tpassrun: rank {st.rank}'s replica group {list(group)} does not contain it")
        if st.link is not None:
            st.link.send(Replicas(ranks=group, alone=alone[:300]))
        st.replica_group = group
        self._sharded.retarget()              # sharded state with replicas needs no mirror (tpassrun/worker/sharded.py)
        return group

    def track_sharded(self, **objects: Any) -> "Session":
        """Like :meth:`track`, for state of which this rank holds its own shard only (a ZeRO optimizer
        partition, FSDP2's local shards, a hand-sharded optimizer's state): no other rank holds it, so tpassrun
        keeps a copy in the memory of a buddy agent on another node (in a job of one node, in the agent's own),
        refreshed every ``--shard-mirror-interval`` steps in the background, and an unplanned failure of this
        rank is recovered from there (see :mod:`tpassrun.worker.shards`). Objects may expose ``commit_optimizers()``:
        the torch optimizers whose ``step()`` starts changing them (where the background copy must be done), and
        ``copy_at_start`` (true: their ``state_dict()`` changes nothing before the first optimizer step, so step 0
        is copied too and a death in the first step or accumulation window is recovered live).
        The rest of the heavy state (``track``) must be identical on every rank of its declared replica group.
        Launched without tpassrun, the same as :meth:`track`."""
        self.track(**objects)
        self._sharded.add(objects)
        return self

    def ddp(self, module: Any, **kwargs: Any) -> "ReconfigurableDDP":
        """``DistributedDataParallel(module, **kwargs)`` that rebuilds itself after every re-formed world.

        Track ``module`` before calling this, so that a joiner holds the right weights before DDP
        broadcasts rank 0's parameters (the joiner may be rank 0).
        """
        # The bucket layout travels with the replicated state (a joiner loads it here, before building)
        st = self._state
        layout = BucketLayout()
        self.track_replicated(**{f"tpassrun.ddp{st.ddps}.buckets": layout})
        st.ddps += 1
        proxy = ReconfigurableDDP(module, kwargs, synced=st.joined, layout=layout)
        self._watch_first_grad(module)
        self.on_reconfigure(proxy.rebuild)
        return proxy

    def _watch_first_grad(self, module: Any) -> None:
        # A synchronous job's step time is the same on every rank (the all-reduce waits for the slowest);
        # the time until the first gradient, before any collective, is what shows which rank is slow.
        st = self._state

        def hook(grad: Any) -> None:
            if not st.first_grad_ns:
                st.first_grad_ns = time.monotonic_ns()

        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(hook)

    def on_reconfigure(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """Run ``fn()`` after each re-formed world on every surviving rank (rebuild DDP, new_group()s)."""
        self._state.callbacks.append(fn)
        return fn

    @property
    def managed(self) -> bool:
        return self._state.link is not None

    def mirror_target(self) -> Any:
        """Where this rank's redundant copies go: its node's buddy mirror (a :class:`tpassrun.mirror.MirrorTarget`,
        whose ``client()`` puts copies there), asked from the agent over the private socket; None when not
        launched by tpassrun or when no other node can hold them. Call it from the main thread while running
        (not from a helper thread), again after a re-formed world: the ring may have changed."""
        st = self._state
        if st.link is None:
            return None
        from tpassrun.mirror import MirrorTarget

        answer = st.link.request(MirrorInfoRequest(), MirrorInfo)
        buddy = answer.buddy if isinstance(answer, MirrorInfo) else None
        return MirrorTarget.from_json(buddy) if buddy else None

    # --- the step loop ---
    def run(self, step_fn: Callable[[int], Any], total_steps: int) -> int:
        """Call ``step_fn(step)`` from the current step up to ``total_steps``; swaps happen in between."""
        self._apply_pending()
        st, txn, commands, sharded = self._state, self._txn, self._commands, self._sharded
        link = st.link
        if link is None:
            while st.step < total_steps:
                step_fn(st.step)
                st.step += 1
            return st.step
        link.set(Field.RUN_FROM, st.step + 1)
        link.set(Field.TOTAL, max(0, int(total_steps)))
        link.set(Field.PHASE, WorkerPhase.RUNNING)
        st.window = st.step
        st.window_marks = txn.replicated_marks()
        while st.step < total_steps:
            step = st.step
            start = time.monotonic_ns()
            link.set(Field.HEARTBEAT_NS, start)
            run_until = link.get(Field.RUN_UNTIL)
            if run_until <= step and (run_until < 0 or st.window == step):
                link.set(Field.PHASE, WorkerPhase.PAUSING)   # never "running step B" while it parks before B
                link.set(Field.STEP, step)
                commands.at_boundary(step)
                if st.step != step:     # a recovery moved us (never forward past work not done)
                    continue
                start = time.monotonic_ns()
            # (published after the boundary check: an agent never sees "running step B" from a rank about to
            # pause at B)
            link.set(Field.STEP, step)
            if st.light_retarget_due:
                txn.light_retarget()
            if st.light_enabled:
                txn.snapshot_light(step)
            if st.replicas_due is not None and commands.check_replicas(step):
                continue    # a peer died in the check, or no replica can be trusted: a recovery or restart moved us
            if st.window == step:    # (inside an accumulation window no step start is a resume point)
                self._catchup.begin_txn(step)
                sharded.begin(step, st.rollback_light)
            link.set(Field.PHASE, WorkerPhase.RUNNING)
            st.first_grad_ns = 0
            st.in_step = step
            try:
                step_fn(step)
            except Exception as exc:  # classified right below
                st.in_step = -1
                kind = classify_failure(exc)
                if not kind.distributed:
                    kind = commands.ask_cause(step, exc)   # a casualty of a peer's failure, or its own error
                if not kind.distributed:
                    link.set(Field.PHASE, WorkerPhase.RAISED)   # a user error: torchrun's path, not a spare
                    raise
                note_interrupted(st.rank, f"step {step}", kind, exc)
                commands.after_failure(step, exc, kind)
                continue
            st.in_step = -1
            st.step = step + 1
            sharded.fence()    # a step without a commit point (no tracked optimizer): its copy ends here
            if not (st.commit_hooks and st.committed != step):
                st.window = step + 1   # else no commit: its gradients carry over (accumulation), the window stays open
                if st.committed == step:
                    txn.window_closed()
            end = time.monotonic_ns()
            link.set(Field.LAST_STEP_NS, end - start)
            link.set(Field.LAST_COMPUTE_NS, (st.first_grad_ns or end) - start)
            if not st.size_published:   # once: after a step, so the optimizer's state exists
                st.size_published = True
                link.set(Field.STATE_BYTES, self._tracked_nbytes())
        link.set(Field.STEP, st.step)
        sharded.close()
        link.set(Field.PHASE, WorkerPhase.DONE)
        link.send(Done(step=st.step))
        return st.step

    def _tracked_nbytes(self) -> int:
        """Tensor bytes a handoff of this rank streams (capture copies nothing; 0 if it cannot travel)."""
        from tpassrun.transfer import handoff

        st = self._state
        if any(callable(getattr(obj, "handover_refused", None)) and obj.handover_refused()
               for obj in st.tracked.values()):
            return 0          # an adapter's configuration tpassrun cannot hand over (runs as under torchrun)
        try:
            return handoff.capture(st.tracked, step=st.step).nbytes
        except handoff.HandoffError:
            return 0

    def _apply_pending_to(self, name: str, obj: Any) -> None:
        """On a joiner, load ``name``'s received state as soon as the script tracks it, so that a model is
        right before DDP broadcasts from rank 0 and an optimizer before anything reads it."""
        st = self._state
        for bundle in (st.pending_bundle, st.pending_light_bundle, st.pending_shard_bundle):
            if bundle is not None and _has_object(bundle, name):
                _apply_one(bundle, name, obj)

    def _apply_pending(self) -> None:
        """At the start of :meth:`run` on a joiner: everything not applied yet, then RNG and step."""
        from tpassrun.transfer import handoff

        st = self._state
        for bundle in (st.pending_bundle, st.pending_light_bundle, st.pending_shard_bundle):
            if bundle is None:
                continue
            missing = [n for n in _object_names(bundle) if n not in st.tracked]
            if missing:
                raise RuntimeError(f"tpassrun: the joiner received state for {missing} but the script did not "
                                   "track objects with those names before run()")
        light, bundle = st.pending_light_bundle, st.pending_bundle
        rng_source = light if light is not None else bundle
        if rng_source is not None:
            rng = _bundle_rng(rng_source)
            if rng is not None:
                handoff.restore_rng(rng)
            st.step = _bundle_step(rng_source)
        st.pending_bundle = st.pending_light_bundle = st.pending_shard_bundle = None
