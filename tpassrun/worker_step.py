"""The step as a transaction (the worker's side of recovery at any instant): per-rank light snapshots taken at
each step's start, the seal at the end of its backward pass, the commit point when a tracked optimizer starts
changing the model. A mixin of :class:`tpassrun.worker_session.Session`, whose state it reads and writes.
"""

from __future__ import annotations

import logging
from typing import Any

from .channel import Field

log = logging.getLogger("tpassrun.worker")

# A seal is trusted as the next step's start snapshot once this many were found equal to it, and checked again
# on every this-many-th step after: user code that changes per-rank state after the optimizer step does so in
# every step (a prefetch, random draws in its logging) and is caught at once, at no per-step cost otherwise.
_SEALS_VERIFIED_FIRST = 2
_VERIFY_SEAL_EVERY = 8


class StepTransaction:
    """Session's seal, commit point and light snapshots (see the note below)."""

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
        self._link.nudge()     # the seal is what a death from here on needs: have it mirrored at once
        self._sealed, self._commit_light = step, data

    def _commit_point(self) -> None:
        """A tracked optimizer is about to step: the model changes from here on (see the note above)."""
        step = self._in_step
        if step < 0 or self._committed == step:
            return               # outside run(), or a second optimizer in the same step
        self._committed = step
        self._shard_fence()      # the step's pre-step copy must have read the state the optimizer now changes
        if self._sealed != step:
            self._seal(step)     # no backward seen (or none through a tracked model)
        assert self._link is not None
        self._link.set(Field.COMMITTED, step + 1)

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
            return
        self._link.nudge()

    def _restore_light(self, data: bytes) -> int:
        from . import handoff, light

        return handoff.apply(light.decode(data), self._light_objects(), restore_rng_state=True)
