"""The worker API: ``sess = tpassrun.init()``, ``sess.track(...)``, ``sess.on_reconfigure(fn)``, ``sess.run(step_fn, n)``.

A healthy rank pays one shared-memory read per step (``run_until``) and a local light-state snapshot; it never
talks to the network for tpassrun's sake. Everything else happens only when the agent stops the world at a
step boundary:

* **survivor**: paused before step B; on ``reform`` it destroys its process group, joins the new world (same
  rank, same size, the joiner in the leaver's place), runs the ``on_reconfigure`` callbacks, carries on at B.
* **leaver** (planned swap): paused before step B; streams everything it tracks straight to the joiner, exits 0.
* **joiner** (a warm spare): blocked in :func:`init` until assigned a rank; receives the state, joins the new
  world; :meth:`Session.run` applies the state and starts at B.
* **unplanned**: a step that raises a distributed error (a peer died) parks the worker; the agent picks a
  donor (any survivor: under DDP every rank holds the model and optimizer) and a spare; survivors roll their
  light state back to the snapshot taken at the start of the failed step and everyone re-executes it.

Launched without tpassrun (plain ``torchrun`` or ``python``), :func:`init` just calls
``init_process_group`` and :meth:`Session.run` is a plain loop, so the same script runs anywhere.
"""

from __future__ import annotations

import base64
import enum
import logging
import os
import select
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Callable

from . import envnames as E
from .channel import INT64_MAX, ChannelFile, Field, WorkerPhase, decode_msg, encode_msg
from .world import (BucketLayout, ReconfigurableDDP, abort_process_groups, init_world, join_world, leave_process_group,
                    set_rank_env)

log = logging.getLogger("tpassrun.worker")

class StepFailure(str, enum.Enum):
    """Where an exception in a step came from, read from its type and its raising frame (never its message).

    Only the distributed kinds park the worker for a recovery; a ``USER`` error takes torchrun's failure
    path at once (a swap cannot fix a bug in the script).
    """

    DIST_ERROR = "dist_error"      # torch.distributed.DistError or a subclass (typed by torch itself)
    COLLECTIVE = "collective"      # raised inside torch.distributed or DDP's own code (gloo raises RuntimeError)
    BACKWARD = "backward"          # raised by autograd's engine in a distributed job: DDP all-reduces in its hooks
    USER = "user"                  # anything else

    @property
    def distributed(self) -> bool:
        return self is not StepFailure.USER


_COLLECTIVE_DIRS = (os.sep.join(("torch", "distributed", "")), os.sep.join(("torch", "nn", "parallel", "")))
_AUTOGRAD_DIR = os.sep.join(("torch", "autograd", ""))


def classify_failure(exc: BaseException) -> StepFailure:
    """Classify ``exc`` raised by a step: by type first, then by the innermost frame that raised it."""
    import traceback

    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return StepFailure.DIST_ERROR
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not frames:
        return StepFailure.USER
    innermost = frames[-1].filename
    if any(d in innermost for d in _COLLECTIVE_DIRS):
        return StepFailure.COLLECTIVE
    if _AUTOGRAD_DIR in innermost and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return StepFailure.BACKWARD
    return StepFailure.USER


def is_distributed_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (a peer may have gone away), not out of the user's code."""
    return classify_failure(exc).distributed


def _is_replicated(obj: Any) -> bool:
    """Model, optimizer, scheduler and scaler are identical on every data-parallel replica; the rest
    (samplers, loaders, user counters) is per rank and goes into the per-step light snapshot."""
    import torch

    replicated = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is not None:
        replicated = replicated + (scaler,)
    return isinstance(obj, replicated)


# A seal is trusted as the next step's start snapshot once this many were found equal to it, and checked again
# on every this-many-th step after: user code that changes per-rank state after the optimizer step does so in
# every step (a prefetch, random draws in its logging) and is caught at once, at no per-step cost otherwise.
_SEALS_VERIFIED_FIRST = 2
_VERIFY_SEAL_EVERY = 8


class _AgentLink:
    """The worker's end of the channel: the shared-memory slot and the unix socket."""

    def __init__(self, channel_path: str, slot: int, sock_path: str) -> None:
        self.slot = slot
        self.ch = ChannelFile.open(channel_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock_path)
        self._buf = bytearray()  # our own line buffer, so that waiting() can tell what is already here
        self._held: list[dict[str, Any]] = []   # commands read while waiting for an answer (request())

    def send(self, kind: str, **fields: Any) -> None:
        self.sock.sendall(encode_msg(kind, slot=self.slot, **fields))

    def request(self, kind: str, timeout: float = 10.0) -> dict[str, Any] | None:
        """Ask the agent something and wait for its answer (a message of the same kind); a command that
        arrives meanwhile is kept for :meth:`recv`. None if no answer came within ``timeout``."""
        self.send(kind)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable(remaining):
                return None
            msg = self._read_one()
            if msg["kind"] == kind:
                return msg
            self._held.append(msg)

    def _readable(self, timeout: float) -> bool:
        if b"\n" in self._buf:
            return True
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(readable)

    def recv(self) -> dict[str, Any]:
        if self._held:
            return self._held.pop(0)
        return self._read_one()

    def _read_one(self) -> dict[str, Any]:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end + 1])
                del self._buf[:end + 1]
                return decode_msg(line)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                # The agent is gone: a worker must never outlive it (PDEATHSIG normally gets here first).
                os._exit(1)
            self._buf += chunk

    def waiting(self, timeout: float = 0.0) -> bool:
        """True once a message (or the agent's end of the socket) is there to be read by :meth:`recv`."""
        if self._held or b"\n" in self._buf:
            return True
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(readable)

    def set(self, field: Field, value: int) -> None:
        self.ch.set(self.slot, field, value)

    def get(self, field: Field) -> int:
        return self.ch.get(self.slot, field)


class Session:
    """What :func:`init` returns. Create through :func:`init`, not directly."""

    def __init__(self, *, backend: str | None, link: _AgentLink | None, rank: int, world_size: int,
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
        self._last_light: bytes | None = None
        self._light: Any = None                   # light.LightSnapshotter, made at the first snapshot
        self._size_published = False
        self._reform_times: dict[str, float] = {}
        self._light_enabled = link is not None
        self._first_grad_ns = 0
        self._ddps = 0                  # sess.ddp() calls so far: names their bucket layouts
        # The step as a transaction (see _seal and _commit_point): sealed when its collectives are done,
        # committed when a tracked optimizer starts changing the model.
        self._in_step = -1                        # the step step_fn is executing, -1 outside it
        self._sealed = -1                         # the last step whose per-rank state was sealed
        self._seal_queued = False
        self._committed = -1                      # the last step that reached its commit point
        self._commit_light: bytes | None = None   # the sealed snapshot, labelled with the next step
        self._commit_snapshots = True             # off once user code after the seal changed per-rank state
        self._seals_verified = 0                  # seals found equal to the next step's start snapshot
        self._hooked: set[int] = set()

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

    def _hook_commit_point(self, obj: Any) -> None:
        import torch

        if self._link is None or id(obj) in self._hooked:
            return
        if isinstance(obj, torch.optim.Optimizer):
            self._hooked.add(id(obj))
            obj.register_step_pre_hook(lambda _opt, _args, _kwargs: self._commit_point())
        elif callable(getattr(obj, "commit_optimizers", None)):
            # a framework adapter's view: the optimizers whose step commits a step (e.g. the torch optimizers
            # inside torchtitan's OptimizersContainer or a DeepSpeed engine)
            self._hooked.add(id(obj))
            for opt in obj.commit_optimizers():
                self._hook_commit_point(opt)
        elif isinstance(obj, torch.nn.Module):
            param = next((p for p in obj.parameters() if p.requires_grad), None)
            if param is not None:
                self._hooked.add(id(obj))
                param.register_hook(self._queue_seal)

    # A step is a transaction. Its per-rank state (RNG, data position) is *sealed* at the end of each backward
    # pass (after DDP's all-reduce, which autograd runs in a callback queued before ours) and, as a backstop,
    # when a tracked optimizer starts stepping: from then on the survivors of this rank's death finish the step
    # and stop at the next one, and what this rank's state would be there is what it is now, unless user code
    # after the step changes it (the next step's start checks, and stops sealing if so). The seal goes to
    # shared memory labelled with the next step; the step's start snapshot stays in the other buffer, for the
    # survivors that do not finish the step. The step *commits* when a tracked optimizer starts changing the
    # model: a survivor that fails after that can no longer re-execute the step. Nothing is copied but the
    # light state: the model and optimizer are held by every survivor.

    def _queue_seal(self, grad: Any) -> None:
        if self._in_step < 0 or self._seal_queued or not self._commit_snapshots or not self._light_enabled:
            return
        from torch.autograd import Variable

        self._seal_queued = True
        # twice: our callback then runs after every callback queued during this backward (DDP's finalize)
        Variable._execution_engine.queue_callback(
            lambda: Variable._execution_engine.queue_callback(self._seal_now))

    def _seal_now(self) -> None:
        self._seal_queued = False
        if self._in_step >= 0:
            self._seal(self._in_step)

    def _seal(self, step: int) -> None:
        if not (self._light_enabled and self._commit_snapshots):
            return
        if self._light is None:
            from .light import LightSnapshotter

            self._light = LightSnapshotter()
        data = self._light.take(self._light_objects(), step + 1)
        assert self._link is not None
        # a second backward in the same step (gradient accumulation) re-seals in place: keep the start snapshot
        fits = (self._link.ch.rewrite_light(self._link.slot, data, step + 1) if self._sealed == step
                else self._link.ch.write_light(self._link.slot, data, step + 1))
        if not fits:
            self._light_enabled = False
            return
        self._sealed, self._commit_light = step, data

    def _commit_point(self) -> None:
        """A tracked optimizer is about to step: the model changes from here on (see the note above)."""
        step = self._in_step
        if step < 0 or self._committed == step:
            return               # outside run(), or a second optimizer in the same step
        self._committed = step
        if self._sealed != step:
            self._seal(step)     # no backward seen (or none through a tracked model)
        assert self._link is not None
        self._link.set(Field.COMMITTED, step + 1)

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
        from .mirror import MirrorTarget

        answer = self._link.request("mirror_info")
        buddy = (answer or {}).get("buddy")
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
        link.set(Field.PHASE, WorkerPhase.RUNNING)
        while self.step < total_steps:
            step = self.step
            link.set(Field.STEP, step)
            start = time.monotonic_ns()
            link.set(Field.HEARTBEAT_NS, start)
            if link.get(Field.RUN_UNTIL) <= step:
                self._at_boundary(step)
                if self.step != step:     # a recovery moved us (never forward past work not done)
                    continue
                start = time.monotonic_ns()
            if self._light_enabled:
                self._snapshot_light(step)
            link.set(Field.PHASE, WorkerPhase.RUNNING)
            self._first_grad_ns = 0
            self._in_step = step
            try:
                step_fn(step)
            except Exception as exc:  # noqa: BLE001 - classified right below
                self._in_step = -1
                kind = classify_failure(exc)
                if not kind.distributed:
                    link.set(Field.PHASE, WorkerPhase.RAISED)   # a user error: torchrun's path, not a spare
                    raise
                log.warning("rank %d: step %d failed in a collective (%s: %s); waiting for recovery",
                            self.rank, step, type(exc).__name__, exc)
                self._after_failure(step, exc, kind)
                continue
            self._in_step = -1
            self.step = step + 1
            end = time.monotonic_ns()
            link.set(Field.LAST_STEP_NS, end - start)
            link.set(Field.LAST_COMPUTE_NS, (self._first_grad_ns or end) - start)
            if not self._size_published:   # once: after a step, so the optimizer's state exists
                self._size_published = True
                link.set(Field.STATE_BYTES, self._tracked_nbytes())
        link.set(Field.STEP, self.step)
        link.set(Field.PHASE, WorkerPhase.DONE)
        link.send("done", step=self.step)
        return self.step

    def _tracked_nbytes(self) -> int:
        """Tensor bytes a handoff of this rank streams (capture copies nothing; 0 if it cannot travel)."""
        from . import handoff

        try:
            return handoff.capture(self._tracked, step=self.step).nbytes
        except handoff.HandoffError:
            return 0

    # --- light state ---
    def _light_objects(self) -> dict[str, Any]:
        return {k: self._tracked[k] for k in self._per_rank}

    def _snapshot_light(self, step: int) -> None:
        """The step-start snapshot: what a failed step rolls back to, and what a joiner starts from."""
        if self._light is None:
            from .light import LightSnapshotter

            self._light = LightSnapshotter()
        commit, self._commit_light = self._commit_light, None
        if commit is not None and self._sealed == step - 1 and self._seals_verified >= _SEALS_VERIFIED_FIRST \
                and step % _VERIFY_SEAL_EVERY:
            # The seal already is this step's start snapshot (published, labelled with this step): taking it
            # again would double the per-step cost. Checked on the first seals and on every few steps after.
            self._last_light = commit
            return
        if commit is not None:
            data = self._light.take(self._light_objects(), step)
            self._last_light = data
            if data == commit:
                self._seals_verified += 1
                # Already published at the commit point; not writing it again keeps the previous step's start
                # snapshot in the other buffer, for a death inside a collective that only this rank completed.
                return
            if self._commit_snapshots:
                self._commit_snapshots = False
                log.warning("rank %d: the per-rank state (RNG, data position) changed after the backward pass of "
                            "step %d (user code after it draws random numbers or reads data); a death between "
                            "the optimizer step and the next step cannot be recovered live", self.rank, step - 1)
            self._write_light(data, step)
            return
        self._last_light = self._publish_light(step)

    def _publish_light(self, step: int) -> bytes | None:
        if self._light is None:
            from .light import LightSnapshotter

            self._light = LightSnapshotter()
        data = self._light.take(self._light_objects(), step)
        self._write_light(data, step)
        return data

    def _write_light(self, data: bytes, step: int) -> None:
        assert self._link is not None
        if not self._link.ch.write_light(self._link.slot, data, step):
            log.warning("light state of %d bytes does not fit the channel; unplanned recovery will not be exact",
                        len(data))
            self._light_enabled = False

    def _restore_light(self, data: bytes) -> int:
        from . import handoff, light

        return handoff.apply(light.decode(data), self._light_objects(), restore_rng_state=True)

    def _apply_pending_to(self, name: str, obj: Any) -> None:
        """On a joiner, load ``name``'s received state as soon as the script tracks it, so that a model is
        right before DDP broadcasts from rank 0 and an optimizer before anything reads it."""
        for attr in ("_pending_bundle", "_pending_light_bundle"):
            bundle = getattr(self, attr)
            if bundle is not None and _has_object(bundle, name):
                _apply_one(bundle, name, obj)

    def _apply_pending(self) -> None:
        """At the start of :meth:`run` on a joiner: everything not applied yet, then RNG and step."""
        from . import handoff

        for attr in ("_pending_bundle", "_pending_light_bundle"):
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
        self._pending_bundle = self._pending_light_bundle = None

    # --- commands from the agent ---
    def _at_boundary(self, step: int) -> None:
        link = self._link
        assert link is not None
        link.set(Field.PHASE, WorkerPhase.PAUSED)
        link.send("paused", step=step)
        self._serve(step)

    def _after_failure(self, step: int, exc: BaseException, kind: StepFailure) -> None:
        link = self._link
        assert link is not None
        self._commit_light = None   # the step is either re-executed from its start or not resumed at all
        # Tear our end of every collective down now: a peer blocked on *us* (not on the dead rank) only
        # learns of the failure when our sockets close, so aborting here cascades the error to every
        # survivor instead of leaving some blocked until gloo's 30-minute timeout.
        abort_process_groups()
        link.set(Field.PHASE, WorkerPhase.FAILED)
        link.send("failed", step=step, error=f"{type(exc).__name__}: {exc}"[:500], failure=kind.value,
                  distributed=kind.distributed, exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                  committed=self._committed == step)
        self._serve(step, failed=exc)

    def _serve(self, step: int, failed: BaseException | None = None) -> None:
        """Obey the agent until it lets this worker carry on (or tells it to leave)."""
        from . import handoff, testing

        link = self._link
        assert link is not None
        while True:
            msg = link.recv()
            kind = msg["kind"]
            if kind == "resume":
                if failed is None and link.get(Field.RUN_UNTIL) <= step:
                    link.set(Field.PHASE, WorkerPhase.PAUSED)
                    continue  # still held at this boundary; wait for the next command
                link.set(Field.PHASE, WorkerPhase.RUNNING)
                return
            if kind == "send_state":
                link.set(Field.PHASE, WorkerPhase.TRANSFERRING)
                testing.fault_point(self.rank, step, "send")   # tests: the sender dies mid-handoff
                objs = {k: v for k, v in self._tracked.items()
                        if not (msg.get("replicated_only") and k in self._per_rank)}
                unique = _not_replicated(objs) if msg.get("replicated_only") else []
                if unique:
                    # e.g. a ZeRO optimizer partition: this rank's copy is not the dead rank's. Refuse (the
                    # joiner sees the connection close at once) rather than hand over the wrong state.
                    log.warning("rank %d cannot donate state for an unplanned recovery: %s", self.rank,
                                "; ".join(unique))
                    _refuse_send(msg)
                    link.send("sent", ok=False, error="; ".join(unique)[:300], swap_id=msg.get("swap_id"))
                    continue
                rng = handoff.capture_rng() if msg.get("rng", True) else None
                bundle = handoff.capture(objs, step=step, rng=rng,
                                         extra={"objects": sorted(objs), "swap_id": msg.get("swap_id")})
                try:
                    stats = _send_state(msg, bundle,
                                        corrupt=lambda: testing.wants(self.rank, step, "send", "corrupt"))
                    link.send("sent", ok=True, nbytes=stats.nbytes, seconds=stats.seconds,
                              checksum=stats.checksum, swap_id=msg.get("swap_id"))
                except (OSError, handoff.HandoffError) as exc:
                    link.send("sent", ok=False, error=str(exc)[:300], swap_id=msg.get("swap_id"))
                continue
            if kind == "rollback":
                if self._last_light is not None:
                    self._restore_light(self._last_light)
                self._drop_grads()
                link.send("rolled_back", step=step)
                continue
            if kind == "reform":
                if msg.get("rollback") and failed is not None:
                    # The failed step is re-executed by everyone: put back what it consumed (RNG, data
                    # position) from the snapshot taken when it started. Model and optimizer were not touched.
                    if self._last_light is not None:
                        self._restore_light(self._last_light)
                    self._drop_grads()
                self._reform(msg)
                link.send("reformed", rank=self.rank, world_size=self.world_size, generation=self.generation,
                          **self._reform_times)
                link.set(Field.PHASE, WorkerPhase.RUNNING)
                return
            if kind == "exit":
                link.set(Field.PHASE, WorkerPhase.DONE)
                leave_process_group()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(int(msg.get("code", 0)))
            if kind == "raise":
                if failed is not None:
                    raise failed
                raise RuntimeError(msg.get("reason", "tpassrun agent asked this worker to fail"))
            log.warning("ignoring unexpected command %r at step %d", kind, step)

    def _drop_grads(self) -> None:
        import torch

        for obj in self._tracked.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
            elif isinstance(obj, torch.nn.Module):
                obj.zero_grad(set_to_none=True)
            elif callable(getattr(obj, "drop_grads", None)):
                obj.drop_grads()   # a framework adapter's view (e.g. a DeepSpeed engine's gradient buffers)

    def _reform(self, msg: dict[str, Any]) -> None:
        link = self._link
        assert link is not None
        link.set(Field.PHASE, WorkerPhase.RECONFIGURING)
        t0 = time.perf_counter()
        leave_process_group()
        self.rank = int(msg["rank"])
        self.world_size = int(msg["world_size"])
        self.generation = int(msg.get("generation", self.generation))
        set_rank_env(msg)
        t1 = time.perf_counter()
        join_world(self.backend, msg, self._timeout)
        t2 = time.perf_counter()
        self.swaps += 1
        for fn in self._callbacks:
            fn()
        self._reform_times = {"leave_s": round(t1 - t0, 4), "join_s": round(t2 - t1, 4),
                              "callbacks_s": round(time.perf_counter() - t2, 4)}


# --- reading a received bundle piece by piece (the joiner loads each object as the script tracks it) ---

def _object_names(bundle: Any) -> list[str]:
    return sorted(bundle.meta.get("objects", {}))


def _has_object(bundle: Any, name: str) -> bool:
    return name in bundle.meta.get("objects", {})


def _apply_one(bundle: Any, name: str, obj: Any) -> None:
    from .handoff_codec import decode_tree

    obj.load_state_dict(decode_tree(bundle.meta["objects"].pop(name), bundle.tensors))


def _bundle_rng(bundle: Any) -> Any:
    from .handoff_codec import decode_tree

    tree = bundle.meta.get("rng")
    return None if tree is None else decode_tree(tree, bundle.tensors)


def _bundle_step(bundle: Any) -> int:
    return int(bundle.meta.get("step", 0)) if bundle is not None else 0


def _not_replicated(objs: dict[str, Any]) -> list[str]:
    """Why each object that declares ``replicated = False`` (a framework adapter's sharded state) cannot be
    taken from a data-parallel peer."""
    out = []
    for name, obj in objs.items():
        if getattr(obj, "replicated", True) is False:
            why = getattr(obj, "why_not_replicated", None)
            out.append(f"{name}: {why() if callable(why) else 'not replicated on other ranks'}")
    return out


def _refuse_send(msg: dict[str, Any]) -> None:
    """Tell the waiting joiner at once that no state comes from here: authenticate (so it is not taken for a
    stranger and ignored), then close before the first byte of state; it reports the transfer failed."""
    from . import handoff, handoff_wire

    try:
        with socket.create_connection((msg["addr"], int(msg["port"])), timeout=5) as sock:
            handoff_wire._sender_handshake(sock, _transfer_auth(msg))
    except (OSError, handoff.HandoffError):
        pass


def _send_state(msg: dict[str, Any], bundle: Any, *, corrupt: Callable[[], bool]) -> Any:
    """Stream ``bundle`` to the joiner named in ``msg``. ``corrupt`` is the tests' fault hook: asked only
    once connected, so a fault meant for a transfer is not used up by a joiner that is already gone."""
    from . import handoff

    auth = _transfer_auth(msg)
    timeout = float(msg.get("timeout", 60))
    try:
        sock = socket.create_connection((msg["addr"], int(msg["port"])), timeout=timeout)
    except OSError as exc:
        raise handoff.HandoffError(f"cannot connect to the joiner at {msg['addr']}:{msg['port']}: {exc}") from exc
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return handoff.send_bundle(sock, bundle, auth=auth, _corrupt_byte_at=4096 if corrupt() else None)


def _transfer_auth(msg: dict[str, Any]) -> Any:
    """The swap's transfer key and identity from the agent's command (never from the network): a transfer
    without one is refused on both ends."""
    from . import handoff

    try:
        return handoff.TransferAuth(bytes.fromhex(str(msg["key"])), str(msg["swap_id"]), int(msg["rank"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise handoff.HandoffError(f"the agent gave no usable transfer key for this swap ({exc})") from exc


def init(backend: str | None = None, *, timeout: timedelta | None = None) -> Session:
    """Join the job. Active ranks return at once; a warm spare blocks here until it is given a rank.

    Args:
        backend: passed to ``init_process_group`` (None lets torch choose, as it does).
        timeout: process-group timeout (torch's default if None).
    """
    import torch.distributed as dist

    env = os.environ
    channel, sock = env.get(E.TPASSRUN_CHANNEL), env.get(E.TPASSRUN_AGENT_SOCK)
    local_rank = int(env.get(E.LOCAL_RANK, "0"))
    if not channel or not sock:
        # Not launched by tpassrun: behave like a plain torchrun script.
        if not dist.is_initialized():
            kwargs = {"timeout": timeout} if timeout is not None else {}
            dist.init_process_group(backend, **kwargs)
        return Session(backend=backend, link=None, rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank, generation=0, joined=False, timeout=timeout)

    spare = env.get(E.TPASSRUN_SPARE) == "1"
    if spare:
        _prewarm()
    link = _AgentLink(channel, int(env[E.TPASSRUN_SLOT]), sock)
    link.set(Field.PID, os.getpid())
    link.send("hello", pid=os.getpid(), spare=spare)
    generation = int(env.get(E.TPASSRUN_GENERATION, "0"))
    if not spare:
        if not dist.is_initialized():
            kwargs = {"timeout": timeout} if timeout is not None else {}
            init_world(backend, **kwargs)
        link.set(Field.PHASE, WorkerPhase.STARTING)
        return Session(backend=backend, link=link, rank=dist.get_rank(), world_size=dist.get_world_size(),
                       local_rank=local_rank, generation=generation, joined=False, timeout=timeout)
    return _wait_as_spare(backend, link, local_rank, timeout)


def _prewarm() -> None:
    """What a joiner would otherwise import on the critical path of a swap: DDP's constructor imports
    ``torch._dynamo`` on first use (seconds), and the handoff codec pulls in numpy. A spare pays it before it
    says hello, so "ready" means warm."""
    import importlib

    for name in ("torch._dynamo", "torch.nn.parallel.distributed", "tpassrun.handoff"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a missing optional piece only costs time later
            log.debug("prewarm %s: %s", name, exc)


def _wait_for_sender(listener: socket.socket, link: _AgentLink, timeout: float,
                     pending: list[dict[str, Any]]) -> bool:
    """Wait until a sender connects (True), or until the agent sends a command other than the unplanned
    swap's ``light`` snapshot (False; the command is appended to ``pending``), or the timeout (False).

    An assigned spare may wait a while (it is assigned while the survivors finish their step), so it
    must stay responsive: an abort or a new assignment must not wait for the accept timeout.
    ``light`` arrives while the donor streams; it is kept in ``pending`` and answered after the
    state, in the order the agent expects."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if link.waiting():
            msg = link.recv()
            if msg["kind"] == "reserve":
                continue   # too late to pre-fault for this transfer
            pending.append(msg)
            if msg["kind"] != "light":
                return False
            continue
        readable, _, _ = select.select([listener, link.sock], [], [], remaining)
        if listener in readable:
            return True


def _receive_state(listener: socket.socket, link: _AgentLink, msg: dict[str, Any], auth: Any,
                   pending: list[dict[str, Any]]) -> Any:
    """Wait for the sender the agent announced and receive its state (None if none came, or it failed).
    Connections that do not prove the swap key are dropped and the wait goes on: a stranger that connects
    first neither delays the swap past its timeout nor gets anything applied."""
    from . import handoff
    from .handoff_wire import accept_one

    swap_id = msg.get("swap_id")
    wait_s = float(msg.get("timeout", 120))
    accept_s = float(msg.get("accept_timeout", wait_s))
    max_bytes = int(msg["max_bytes"]) if msg.get("max_bytes") else None
    deadline = time.monotonic() + accept_s
    strangers = 0
    while True:
        if not _wait_for_sender(listener, link, deadline - time.monotonic(), pending):
            if not pending or pending[-1]["kind"] == "light":   # timed out (not interrupted)
                link.send("received", ok=False, swap_id=swap_id, error=f"HandoffError: no sender connected "
                          f"within {accept_s} s" + (f" ({strangers} unauthenticated connections dropped)"
                                                     if strangers else ""))
            return None   # an abort or a new assignment came first: the main loop handles it
        try:
            conn = accept_one(listener, 1.0)
        except handoff.HandoffError:
            continue
        with conn:
            conn.settimeout(wait_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                bundle, stats = handoff.recv_bundle(conn, auth=auth, max_bytes=max_bytes)
            except handoff.AuthError as exc:
                strangers += 1
                log.warning("spare: dropped a connection that did not prove the swap key: %s", exc)
                link.send("stranger", swap_id=swap_id, error=str(exc)[:200])
                continue
            except (OSError, handoff.HandoffError) as exc:
                link.send("received", ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=swap_id)
                return None
        extra = bundle.meta.get("extra")
        sent_for = extra.get("swap_id") if isinstance(extra, dict) else None
        if sent_for != swap_id:   # authenticated, so a bug rather than an attack: still never apply it
            link.send("received", ok=False, swap_id=swap_id,
                      error=f"HandoffError: the state is for swap {sent_for!r}, not {swap_id!r}")
            return None
        link.send("received", ok=True, nbytes=stats.nbytes, seconds=stats.seconds, checksum=stats.checksum,
                  swap_id=swap_id, step=_bundle_step(bundle))
        return bundle


def _wait_as_spare(backend: str | None, link: _AgentLink, local_rank: int,
                   timeout: timedelta | None) -> Session:
    """Block until the agent hands this spare a rank, receive that rank's state, join the world."""
    from . import handoff, testing
    from .light import decode as decode_light

    link.set(Field.PHASE, WorkerPhase.SPARE)
    bundle = None
    light: bytes | None = None
    listener = None
    assign: dict[str, Any] | None = None
    pending: list[dict[str, Any]] = []    # commands that came while waiting for the sender
    while True:
        msg = pending.pop(0) if pending else link.recv()
        kind = msg["kind"]
        if kind == "assign":
            assign = msg
            if listener is not None:
                listener.close()
            listener = None
            try:
                auth = _transfer_auth(msg)
                listener, port = handoff.listen_for_bundle(str(msg.get("listen_host") or "127.0.0.1"))
            except (OSError, handoff.HandoffError) as exc:
                bundle = None
                link.send("received", ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=msg.get("swap_id"))
                continue
            link.set(Field.PHASE, WorkerPhase.TRANSFERRING)
            link.send("listening", port=port, swap_id=msg.get("swap_id"))
            testing.fault_point(int(msg.get("rank", -1)), 0, "receive")  # tests: the joiner dies mid-transfer
            bundle = _receive_state(listener, link, msg, auth, pending)
            continue
        if kind == "light":
            light = base64.b64decode(msg["data"])
            step = _bundle_step(decode_light(light))
            ok = msg.get("step") is None or step == int(msg["step"])
            link.send("light_ok", ok=ok, nbytes=len(light), step=step)
            if not ok:
                light = None
            continue
        if kind == "reserve":
            # The agent says how big a rank's state is: fault in that much now, while idle, so the transfer
            # does not pay the kernel for fresh pages (see handoff_wire._Arena).
            from .handoff_wire import reserve_receive_arena

            got = reserve_receive_arena(int(msg["nbytes"]))
            link.send("reserved", nbytes=got)
            continue
        if kind == "abort":
            bundle, light, assign = None, None, None
            link.set(Field.PHASE, WorkerPhase.SPARE)
            continue
        if kind == "reform":
            if assign is None or bundle is None:
                link.send("reformed", ok=False, error="no state received")
                continue
            if listener is not None:
                listener.close()
            link.set(Field.PHASE, WorkerPhase.RECONFIGURING)
            set_rank_env(msg)
            os.environ.pop(E.TPASSRUN_SPARE, None)
            join_world(backend, msg, timeout)
            sess = Session(backend=backend, link=link, rank=int(msg["rank"]), world_size=int(msg["world_size"]),
                           local_rank=local_rank, generation=int(msg.get("generation", 0)), joined=True,
                           timeout=timeout)
            sess._pending_bundle = bundle
            sess._pending_light_bundle = decode_light(light) if light is not None else None
            sess.step = _bundle_step(sess._pending_light_bundle or bundle)
            link.set(Field.STEP, sess.step)
            link.send("reformed", ok=True, rank=sess.rank, world_size=sess.world_size, generation=sess.generation)
            return sess
        if kind == "exit":
            os._exit(int(msg.get("code", 0)))
        log.warning("spare ignoring unexpected command %r", kind)


__all__ = ["StepFailure", "Session", "classify_failure", "init", "is_distributed_failure", "INT64_MAX"]
