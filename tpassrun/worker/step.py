"""The step as a transaction (the worker's side of recovery at any instant): per-rank light snapshots taken at
each step's start, the seal at the end of its backward pass, the commit point when a tracked optimizer starts
changing the model. A mixin of :class:`tpassrun.worker.session.Session`, whose state it reads and writes.
"""

from __future__ import annotations

import logging
from typing import Any

from tpassrun.channel import Field

log = logging.getLogger("tpassrun.worker")

# A seal is trusted as the next step's start snapshot once this many were found equal to it, and checked again
# on every this-many-th step after: user code that changes per-rank state after the optimizer step does so in
# every step (a prefetch, random draws in its logging) and is caught at once, at no per-step cost otherwise.
_SEALS_VERIFIED_FIRST = 2
# Asking where light snapshots go (tpassrun/worker/light_mirror.py): _light_retarget_due is one of these, 0 when settled.
_RETARGET_FRESH, _RETARGET_RETRY, _RETARGET_ASKED = 2, 1, 3
_ANSWER_WAIT_S = 0.2       # a (re)started rank waits this long at most for the agent's answer ...
_CONNECT_WAIT_S = 0.25     # ... and this long for its push stream to the buddy
_MAX_POLLS = 1000          # step starts to look for an answer before giving up (the agent then copies them)
_VERIFY_SEAL_EVERY = 8


class StepTransaction:
    """Session's seal, commit point and light snapshots (see the note below)."""

    def _hook_commit_point(self, obj: Any) -> None:
        import torch

        if self._link is None or id(obj) in self._hooked:
            return
        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if isinstance(obj, torch.optim.Optimizer):
            self._hooked.add(id(obj))
            self._commit_hooks += 1
            obj.register_step_pre_hook(lambda _opt, _args, _kwargs: self._commit_point())
        elif scaler is not None and isinstance(obj, scaler):
            # A step whose gradients overflowed skips the optimizer step but still changes the scale: update()
            # is a commit point too. (An instance attribute: GradScaler's state_dict lists its keys by name.)
            self._hooked.add(id(obj))
            self._commit_hooks += 1
            update = obj.update

            def committing_update(*args: Any, **kwargs: Any) -> Any:
                self._commit_point()
                self._scaler_updates[id(obj)] = self._scaler_updates.get(id(obj), 0) + 1
                return update(*args, **kwargs)

            obj.update = committing_update
        elif callable(getattr(obj, "commit_optimizers", None)) or callable(getattr(obj, "seal_modules", None)):
            # a framework adapter's view: the optimizers whose step commits a step (e.g. the torch optimizers
            # inside torchtitan's OptimizersContainer or a DeepSpeed engine), the modules whose backward pass
            # seals it (the real nn.Modules under a framework's wrapper: Megatron's model chunks)
            self._hooked.add(id(obj))
            for opt in getattr(obj, "commit_optimizers", list)():
                self._hook_commit_point(opt)
            for module in getattr(obj, "seal_modules", list)():
                self._hook_commit_point(module)
        elif isinstance(obj, torch.nn.Module):
            param = next((p for p in obj.parameters() if p.requires_grad), None)
            if param is not None:
                self._hooked.add(id(obj))
                param.register_hook(self._seal_in_backward)

    # A step is a transaction. Its per-rank state (RNG, data position) is *sealed* in each backward pass, when
    # the gradient of the tracked model's first parameter is computed, and, as a backstop, when a tracked
    # optimizer starts stepping: from then on the survivors of this rank's death may finish the step and stop at
    # the next one, and what this rank's state would be there is what it is now, unless user code after the step
    # changes it (the next step's start checks, and stops sealing if so). The seal goes to shared memory labelled
    # with the next step; the step's start snapshot stays in the other buffer, for the survivors that do not
    # finish the step. The step *commits* when a tracked optimizer starts changing the model.
    #
    # Why in the backward pass and not after it: the seal is written before that gradient reaches DDP, so before
    # this rank has contributed the last bucket of the step's all-reduce; no survivor can complete the step
    # without this rank having sealed it, however late in the all-reduce this rank dies. (Sealed after the
    # all-reduce, a rank dying in its last instants, its part delivered, left no state for the step the
    # survivors had completed.) Nothing is copied but the light state: every survivor holds model and optimizer.

    def _seal_in_backward(self, grad: Any) -> None:
        if self._in_step >= 0 and self._commit_snapshots and self._light_enabled:
            self._seal(self._in_step)

    def _seal(self, step: int) -> None:
        if not (self._light_enabled and self._commit_snapshots):
            return
        if self._light is None:
            from tpassrun.transfer.light import LightSnapshotter

            self._light = LightSnapshotter()
        data = self._light.take(self._light_objects(), step + 1)
        link = self._link
        assert link is not None
        # A second backward in the same step (micro-batches) re-seals in place: the other buffer keeps the step's
        # start. Inside an open window the start to keep is the window's: never overwrite that buffer.
        if self._sealed == step or (self._window < step and link.ch.light_step(link.slot) != self._window):
            fits = link.ch.rewrite_light(link.slot, data, step + 1)
        else:
            fits = link.ch.write_light(link.slot, data, step + 1)
        if not fits:
            self._light_enabled = False
            return
        self._mirror_light(step + 1, data)    # the seal is what a death from here on needs: at the buddy now
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

    # --- after the commit point ---
    # A survivor that fails in a collective after its commit point (a logging all-reduce, a barrier after
    # opt.step()) holds the step's model update; it can resume at the next step from its seal if nothing else
    # the step changes in the replicated state is missing. What it checks: every tracked LR scheduler and
    # GradScaler has stepped as often since the window's start as in the last complete window (other replicated
    # objects are taken to change only before the commit point).

    def _replicated_marks(self) -> dict[str, int]:
        key = (len(self._tracked), len(self._per_rank))
        if self._mark_sources is None or self._mark_sources[0] != key:
            self._mark_sources = (key, self._find_mark_sources())
        return {name: (self._scaler_updates.get(id(obj), 0) if scaler else
                       int(getattr(obj, "_step_count", getattr(obj, "last_epoch", 0)) or 0))
                for name, obj, scaler in self._mark_sources[1]}

    def _find_mark_sources(self) -> list[tuple[str, Any, bool]]:
        """(name, object, is a GradScaler) of the tracked replicated schedulers and scalers."""
        import torch

        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        out = []
        for name, obj in sorted(self._tracked.items()):
            if name in self._per_rank:
                continue
            if scaler is not None and isinstance(obj, scaler):
                out.append((name, obj, True))
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or hasattr(obj, "last_epoch"):
                out.append((name, obj, False))
        return out

    def _window_closed(self) -> None:
        """At the end of a step that committed: how the replicated state moved in this window."""
        self._last_window_marks, self._window_marks = self._window_marks, self._replicated_marks()

    def _complete_after_commit(self) -> bool:
        """Whether this (committed, failed) step changed the replicated state as much as the last window did."""
        if self._last_window_marks is None or self._window_marks is None:
            return False
        return (_delta(self._replicated_marks(), self._window_marks)
                == _delta(self._window_marks, self._last_window_marks))

    # --- light state ---
    def _light_objects(self) -> dict[str, Any]:
        # In the order tracked, never the set's (hash-seeded, so it differs between processes): a survivor rolled
        # back loads its per-rank objects in the order a joiner loads them as the script tracks them, and an
        # object rebuilt from another (a data iterator from the progress counters) finds it loaded first.
        return {k: v for k, v in self._tracked.items() if k in self._per_rank}

    def _snapshot_light(self, step: int) -> None:
        """The step-start snapshot: what a failed step rolls back to, and what a joiner starts from."""
        if self._light is None:
            from tpassrun.transfer.light import LightSnapshotter

            self._light = LightSnapshotter()
        commit, self._commit_light = self._commit_light, None
        verify = commit is not None and self._sealed == step - 1 and not (
            self._seals_verified >= _SEALS_VERIFIED_FIRST and step % _VERIFY_SEAL_EVERY)
        if self._window < step:
            # Inside an open accumulation window a rollback goes back to the window's start (its snapshot stays
            # where it is); this step's start is never resumed at. Only check the seal now and then.
            if verify:
                self._check_seal(self._light.take(self._light_objects(), step), commit, step)
            return
        if commit is not None and self._sealed == step - 1 and not verify:
            # The seal already is this step's start snapshot (published, labelled with this step): taking it
            # again would double the per-step cost. Checked on the first seals and on every few steps after.
            self._rollback_light = commit
            return
        if commit is not None:
            data = self._light.take(self._light_objects(), step)
            self._rollback_light = data
            if self._check_seal(data, commit, step):
                # Already published at the commit point; not writing it again keeps the previous step's start
                # snapshot in the other buffer, for a death inside a collective that only this rank completed.
                return
            self._write_light(data, step)
            return
        self._rollback_light = self._publish_light(step)

    def _check_seal(self, data: bytes, seal: bytes | None, step: int) -> bool:
        """Whether the seal taken after step - 1's backward pass is this step's start ``data``; turns sealing off
        (and says so) when user code after the backward pass changed per-rank state."""
        if data == seal:
            self._seals_verified += 1
            return True
        if self._commit_snapshots:
            self._commit_snapshots = False
            log.warning("rank %d: the per-rank state (RNG, data position) changed after the backward pass of "
                        "step %d (user code after it draws random numbers or reads data); a death between "
                        "the optimizer step and the next step cannot be recovered live", self.rank, step - 1)
        return False

    def _publish_light(self, step: int) -> bytes | None:
        if self._light is None:
            from tpassrun.transfer.light import LightSnapshotter

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
        self._mirror_light(step, data)

    def _mirror_light(self, step: int, data: bytes) -> None:
        """Hand a snapshot just written to the buddy's mirror: the worker pushes it itself when its connection is
        up (one non-blocking send, no answer awaited; delivered even if this process dies next), else it nudges
        its agent to copy it now."""
        mirror = self._light_mirror
        if mirror is None or not mirror.push(step, data):
            self._link.nudge()

    def _light_retarget(self) -> None:
        """Where this rank's light snapshots go (its node's buddy, :mod:`tpassrun.worker.light_mirror`): asked at the
        run's start, after each re-formed world (the ring may have changed) and after a failed connection; one
        question over the private socket, never per step. A fresh start waits briefly for the answer and the
        connection, so that its first seal goes out this way too; otherwise the answer is picked up at a later
        step start (one ``select`` per step until it is in)."""
        from tpassrun.channel.protocol import MirrorInfo, MirrorInfoRequest

        due, link = self._light_retarget_due, self._link
        assert link is not None
        if not self._light_enabled:
            self._light_retarget_due = 0
            return
        if due in (_RETARGET_FRESH, _RETARGET_RETRY):
            link.send(MirrorInfoRequest())
            self._light_retarget_due, self._light_polls = _RETARGET_ASKED, 0
        answer = link.poll(MirrorInfo, _ANSWER_WAIT_S if due == _RETARGET_FRESH else 0.0)
        if answer is None:
            self._light_polls += 1
            if self._light_polls > _MAX_POLLS:        # an agent that never answers: the agent copies them
                self._light_retarget_due = 0
            return
        self._light_retarget_due = 0
        if self._light_mirror is None:
            from tpassrun.worker.light_mirror import LightMirror

            self._light_mirror = LightMirror(self.rank, link, on_retry=self._want_light_retarget)
        from tpassrun.mirror import MirrorTarget

        assert isinstance(answer, MirrorInfo)
        target = MirrorTarget.from_json(answer.buddy) if answer.buddy else None
        self._light_mirror.retarget(target, self.rank)
        if due == _RETARGET_FRESH and target is not None:
            self._light_mirror.wait_up(_CONNECT_WAIT_S)

    def _want_light_retarget(self) -> None:
        if not self._light_retarget_due:
            self._light_retarget_due = _RETARGET_RETRY

    def _restore_light(self, data: bytes) -> int:
        from tpassrun.transfer import handoff
        from tpassrun.transfer import light

        return handoff.apply(light.decode(data), self._light_objects(), restore_rng_state=True)


def _delta(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {k: now.get(k, 0) - then.get(k, 0) for k in sorted(set(now) | set(then))}
