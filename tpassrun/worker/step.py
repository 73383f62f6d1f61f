"""The step as a transaction (the worker's side of recovery at any instant): per-rank light snapshots taken at
each step's start, the seal at the end of its backward pass, the commit point when a tracked optimizer starts
changing the model; and what a rolled-back step consumed, dropped (``drop_grads``). A part of
:class:`tpassrun.worker.session.Session`: it reads and writes the session's :class:`~tpassrun.worker.state.WorkerState`.
"""

from __future__ import annotations

import logging
from typing import Any

from tpassrun.channel import Field
from tpassrun.worker.state import WorkerState

log = logging.getLogger("tpassrun.worker")

# A seal is trusted as the next step's start snapshot once this many were found equal to it, and checked again
# on every this-many-th step after: user code that changes per-rank state after the optimizer step does so in
# every step (a prefetch, random draws in its logging) and is caught at once, at no per-step cost otherwise.
_SEALS_VERIFIED_FIRST = 2
# Asking where light snapshots go (tpassrun/worker/light_mirror.py): WorkerState.light_retarget_due is one of these,
# 0 when settled.
_RETARGET_FRESH, _RETARGET_RETRY, _RETARGET_ASKED = 2, 1, 3
_ANSWER_WAIT_S = 0.2       # a (re)started rank waits this long at most for the agent's answer ...
_CONNECT_WAIT_S = 0.25     # ... and this long for its push stream to the buddy
_MAX_POLLS = 1000          # step starts to look for an answer before giving up (the agent then copies them)
_VERIFY_SEAL_EVERY = 8


class StepTransaction:
    """Session's seal, commit point and light snapshots (see the note below)."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def hook_commit_point(self, obj: Any) -> None:
        import torch

        st = self.state
        if st.link is None or id(obj) in st.hooked:
            return
        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if isinstance(obj, torch.optim.Optimizer):
            st.hooked.add(id(obj))
            st.commit_hooks += 1
            obj.register_step_pre_hook(lambda _opt, _args, _kwargs: self.commit_point())
        elif scaler is not None and isinstance(obj, scaler):
            # A step whose gradients overflowed skips the optimizer step but still changes the scale: update()
            # is a commit point too. (An instance attribute: GradScaler's state_dict lists its keys by name.)
            st.hooked.add(id(obj))
            st.commit_hooks += 1
            update = obj.update

            def committing_update(*args: Any, **kwargs: Any) -> Any:
                self.commit_point()
                st.scaler_updates[id(obj)] = st.scaler_updates.get(id(obj), 0) + 1
                return update(*args, **kwargs)

            obj.update = committing_update
        elif callable(getattr(obj, "commit_optimizers", None)) or callable(getattr(obj, "seal_modules", None)):
            # a framework adapter's view: the optimizers whose step commits a step (e.g. the torch optimizers
            # inside torchtitan's OptimizersContainer or a DeepSpeed engine), the modules whose backward pass
            # seals it (the real nn.Modules under a framework's wrapper: Megatron's model chunks)
            st.hooked.add(id(obj))
            for opt in getattr(obj, "commit_optimizers", list)():
                self.hook_commit_point(opt)
            for module in getattr(obj, "seal_modules", list)():
                self.hook_commit_point(module)
        elif isinstance(obj, torch.nn.Module):
            param = next((p for p in obj.parameters() if p.requires_grad), None)
            if param is not None:
                st.hooked.add(id(obj))
                param.register_hook(self.seal_in_backward)

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

    def seal_in_backward(self, grad: Any) -> None:
        st = self.state
        if st.in_step >= 0 and st.commit_snapshots and st.light_enabled:
            self.seal(st.in_step)

    def seal(self, step: int) -> None:
        st = self.state
        if not (st.light_enabled and st.commit_snapshots):
            return
        if st.light is None:
            from tpassrun.transfer import LightSnapshotter

            st.light = LightSnapshotter()
        data = st.light.take(self.light_objects(), step + 1)
        link = st.link
        assert link is not None
        # A second backward in the same step (micro-batches) re-seals in place: the other buffer keeps the step's
        # start. Inside an open window the start to keep is the window's: never overwrite that buffer.
        if st.sealed == step or (st.window < step and link.ch.light_step(link.slot) != st.window):
            fits = link.ch.rewrite_light(link.slot, data, step + 1)
        else:
            fits = link.ch.write_light(link.slot, data, step + 1)
        if not fits:
            st.light_enabled = False
            return
        self._mirror_light(step + 1, data)    # the seal is what a death from here on needs: at the buddy now
        st.sealed, st.commit_light = step, data

    def commit_point(self) -> None:
        """A tracked optimizer is about to step: the model changes from here on (see the note above)."""
        st = self.state
        step = st.in_step
        if step < 0 or st.committed == step:
            return               # outside run(), or a second optimizer in the same step
        st.committed = step
        if st.shards is not None:
            st.shards.fence()    # the step's pre-step copy must have read the state the optimizer now changes
        if st.sealed != step:
            self.seal(step)     # no backward seen (or none through a tracked model)
        assert st.link is not None
        st.link.set(Field.COMMITTED, step + 1)

    # --- after the commit point ---
    # A survivor that fails in a collective after its commit point (a logging all-reduce, a barrier after
    # opt.step()) holds the step's model update; it can resume at the next step from its seal if nothing else
    # the step changes in the replicated state is missing. What it checks: every tracked LR scheduler and
    # GradScaler has stepped as often since the window's start as in the last complete window (other replicated
    # objects are taken to change only before the commit point).

    def replicated_marks(self) -> dict[str, int]:
        st = self.state
        key = (len(st.tracked), len(st.per_rank))
        if st.mark_sources is None or st.mark_sources[0] != key:
            st.mark_sources = (key, self._find_mark_sources())
        return {name: (st.scaler_updates.get(id(obj), 0) if scaler else
                       int(getattr(obj, "_step_count", getattr(obj, "last_epoch", 0)) or 0))
                for name, obj, scaler in st.mark_sources[1]}

    def _find_mark_sources(self) -> list[tuple[str, Any, bool]]:
        """(name, object, is a GradScaler) of the tracked replicated schedulers and scalers."""
        import torch

        st = self.state
        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        out = []
        for name, obj in sorted(st.tracked.items()):
            if name in st.per_rank:
                continue
            if scaler is not None and isinstance(obj, scaler):
                out.append((name, obj, True))
            elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or hasattr(obj, "last_epoch"):
                out.append((name, obj, False))
        return out

    def window_closed(self) -> None:
        """At the end of a step that committed: how the replicated state moved in this window."""
        st = self.state
        st.last_window_marks, st.window_marks = st.window_marks, self.replicated_marks()

    def complete_after_commit(self) -> bool:
        """Whether this (committed, failed) step changed the replicated state as much as the last window did."""
        st = self.state
        if st.last_window_marks is None or st.window_marks is None:
            return False
        return (_delta(self.replicated_marks(), st.window_marks)
                == _delta(st.window_marks, st.last_window_marks))

    # --- light state ---
    def light_objects(self) -> dict[str, Any]:
        # In the order tracked, never the set's (hash-seeded, so it differs between processes): a survivor rolled
        # back loads its per-rank objects in the order a joiner loads them as the script tracks them, and an
        # object rebuilt from another (a data iterator from the progress counters) finds it loaded first.
        st = self.state
        return {k: v for k, v in st.tracked.items() if k in st.per_rank}

    def snapshot_light(self, step: int) -> None:
        """The step-start snapshot: what a failed step rolls back to, and what a joiner starts from."""
        st = self.state
        if st.light is None:
            from tpassrun.transfer import LightSnapshotter

            st.light = LightSnapshotter()
        commit, st.commit_light = st.commit_light, None
        verify = commit is not None and st.sealed == step - 1 and not (
            st.seals_verified >= _SEALS_VERIFIED_FIRST and step % _VERIFY_SEAL_EVERY)
        if st.window < step:
            # Inside an open accumulation window a rollback goes back to the window's start (its snapshot stays
            # where it is); this step's start is never resumed at. Only check the seal now and then.
            if verify:
                self._check_seal(st.light.take(self.light_objects(), step), commit, step)
            return
        if commit is not None and st.sealed == step - 1 and not verify:
            # The seal already is this step's start snapshot (published, labelled with this step): taking it
            # again would double the per-step cost. Checked on the first seals and on every few steps after.
            st.rollback_light = commit
            return
        if commit is not None:
            data = st.light.take(self.light_objects(), step)
            st.rollback_light = data
            if self._check_seal(data, commit, step):
                # Already published at the commit point; not writing it again keeps the previous step's start
                # snapshot in the other buffer, for a death inside a collective that only this rank completed.
                return
            self._write_light(data, step)
            return
        st.rollback_light = self.publish_light(step)

    def _check_seal(self, data: bytes, seal: bytes | None, step: int) -> bool:
        """Whether the seal taken after step - 1's backward pass is this step's start ``data``; turns sealing off
        (and says so) when user code after the backward pass changed per-rank state."""
        st = self.state
        if data == seal:
            st.seals_verified += 1
            return True
        if st.commit_snapshots:
            st.commit_snapshots = False
            log.warning("rank %d: the per-rank state (RNG, data position) changed after the backward pass of "
                        "step %d (user code after it draws random numbers or reads data); a death between "
                        "the optimizer step and the next step cannot be recovered live", st.rank, step - 1)
        return False

    def publish_light(self, step: int) -> bytes | None:
        st = self.state
        if st.light is None:
            from tpassrun.transfer import LightSnapshotter

            st.light = LightSnapshotter()
        data = st.light.take(self.light_objects(), step)
        self._write_light(data, step)
        return data

    def _write_light(self, data: bytes, step: int) -> None:
        st = self.state
        assert st.link is not None
        if not st.link.ch.write_light(st.link.slot, data, step):
            log.warning("light state of %d bytes does not fit the channel; unplanned recovery will not be exact",
                        len(data))
            st.light_enabled = False
            return
        self._mirror_light(step, data)

    def _mirror_light(self, step: int, data: bytes) -> None:
        """Hand a snapshot just written to the buddy's mirror: the worker pushes it itself when its connection is
        up (one non-blocking send, no answer awaited; delivered even if this process dies next), else it nudges
        its agent to copy it now."""
        st = self.state
        mirror = st.light_mirror
        if mirror is None or not mirror.push(step, data):
            link = st.link
            assert link is not None
            link.nudge()

    def light_retarget(self) -> None:
        """Where this rank's light snapshots go (its node's buddy, :mod:`tpassrun.worker.light_mirror`): asked at the
        run's start, after each re-formed world (the ring may have changed) and after a failed connection; one
        question over the private socket, never per step. A fresh start waits briefly for the answer and the
        connection, so that its first seal goes out this way too; otherwise the answer is picked up at a later
        step start (one ``select`` per step until it is in)."""
        from tpassrun.channel import MirrorInfo, MirrorInfoRequest

        st = self.state
        due, link = st.light_retarget_due, st.link
        assert link is not None
        if not st.light_enabled:
            st.light_retarget_due = 0
            return
        if due in (_RETARGET_FRESH, _RETARGET_RETRY):
            link.send(MirrorInfoRequest())
            st.light_retarget_due, st.light_polls = _RETARGET_ASKED, 0
        answer = link.poll(MirrorInfo, _ANSWER_WAIT_S if due == _RETARGET_FRESH else 0.0)
        if answer is None:
            st.light_polls += 1
            if st.light_polls > _MAX_POLLS:        # an agent that never answers: the agent copies them
                st.light_retarget_due = 0
            return
        st.light_retarget_due = 0
        if st.light_mirror is None:
            from tpassrun.worker.light_mirror import LightMirror

            st.light_mirror = LightMirror(st.rank, link, on_retry=self._want_light_retarget)
        from tpassrun.mirror import MirrorTarget

        assert isinstance(answer, MirrorInfo)
        target = MirrorTarget.from_json(answer.buddy) if answer.buddy else None
        st.light_mirror.retarget(target, st.rank)
        if due == _RETARGET_FRESH and target is not None:
            st.light_mirror.wait_up(_CONNECT_WAIT_S)

    def _want_light_retarget(self) -> None:
        st = self.state
        if not st.light_retarget_due:
            st.light_retarget_due = _RETARGET_RETRY

    def restore_light(self, data: bytes) -> int:
        from tpassrun.transfer import handoff, light

        return handoff.apply(light.decode(data), self.light_objects(), restore_rng_state=True)

    def drop_grads(self) -> None:
        """Drop the gradients a rolled-back step accumulated (it runs again from its start)."""
        import torch

        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        for obj in self.state.tracked.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
            elif isinstance(obj, torch.nn.Module):
                obj.zero_grad(set_to_none=True)
            elif scaler is not None and isinstance(obj, scaler):
                _reset_scaler_step(obj)
            elif callable(getattr(obj, "drop_grads", None)):
                obj.drop_grads()   # a framework adapter's view (e.g. a DeepSpeed engine's gradient buffers)


def _reset_scaler_step(scaler: Any) -> None:
    """Forget a re-executed step's ``unscale_``/``step`` on a GradScaler (as its ``update`` does, without
    touching the scale): the step runs again from its start."""
    try:
        from collections import defaultdict

        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
    except (ImportError, AttributeError) as exc:  # another torch: nothing of the kind to forget
        log.debug("GradScaler per-step state not reset: %s", exc)


def _delta(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {k: now.get(k, 0) - then.get(k, 0) for k in sorted(set(now) | set(then))}
