"""A survivor catching up after a mixed commit (:mod:`tpassrun.catchup`): the ``CatchUp`` command of a rank that
failed inside a step other survivors completed. A mixin of :class:`tpassrun.worker_session.Session`; the rank's
dispatcher (:mod:`tpassrun.worker_commands`) names the handler, the receive path is the joiner's
(:mod:`tpassrun.worker_spare`), and ``_roll_back`` restores the seal at ``Reform``.
"""

from __future__ import annotations

import logging
from typing import Any

from .channel import Field, WorkerPhase
from .protocol import CatchUp, Listening, Received
from .worker_commands import _transfer_auth
from .worker_spare import _apply_one, _bundle_step, _receive_state

log = logging.getLogger("tpassrun.worker")


class CatchUpCommand:
    """Session's ``_on_catch_up`` (see the module doc)."""

    _link: Any
    _tracked: dict[str, Any]
    _per_rank: set[str]
    _pending: list[Any]
    _caught_up: tuple[int, bytes] | None
    rank: int

    def _on_catch_up(self, msg: CatchUp, step: int, failed: BaseException | None) -> bool:
        """A mixed commit: this rank failed inside step ``msg.step - 1``, which other survivors completed. Take
        their replicated state (the model, optimizer and schedulers of ``msg.step``'s start) from one of them;
        the per-rank state of ``msg.step`` is this rank's own seal of it (written in the step's backward pass,
        before this rank contributed to its all-reduce), restored at ``Reform``."""
        from . import handoff

        link = self._link
        seal = self._own_seal(msg.step) if failed is not None and msg.step == step + 1 else None
        if seal is None:
            link.send(Received(ok=False, swap_id=msg.swap_id, error=f"rank {self.rank} (stopped at step {step}) holds "
                               f"no seal of step {msg.step}: it cannot catch up"))
            return False
        try:
            listener, port = handoff.listen_for_bundle(msg.listen_host or "127.0.0.1")
        except (OSError, handoff.HandoffError) as exc:
            link.send(Received(ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=msg.swap_id))
            return False
        link.set(Field.PHASE, WorkerPhase.TRANSFERRING)
        link.send(Listening(port=port, swap_id=msg.swap_id))
        try:
            received = _receive_state(listener, link, msg, _transfer_auth(msg.key, msg.swap_id, msg.rank),
                                      self._pending, reply=False)
        finally:
            listener.close()
            link.set(Field.PHASE, WorkerPhase.FAILED)
        if received is None:
            return False                      # said why (or a command came first: it is served next)
        bundle, stats = received
        names = [n for n in bundle.meta.get("objects", {})]
        missing = [n for n in names if n not in self._tracked or n in self._per_rank]
        if _bundle_step(bundle) != msg.step or missing:
            link.send(Received(ok=False, swap_id=msg.swap_id, error=f"the state sent is of step {_bundle_step(bundle)} "
                               f"(not {msg.step}), or for objects this rank does not hold alike: {missing}"))
            return False
        for name in names:
            _apply_one(bundle, name, self._tracked[name])
        self._caught_up = (msg.step, seal)
        link.send(Received(ok=True, swap_id=msg.swap_id, nbytes=stats.nbytes, seconds=stats.seconds,
                           checksum=stats.checksum, step=msg.step))
        return False

    def _own_seal(self, step: int) -> bytes | None:
        """This rank's light snapshot labelled ``step`` (its seal of ``step - 1``), from its shared-memory slot."""
        link = self._link
        for previous in (False, True):
            if link.ch.light_step(link.slot, previous) == step:
                return link.ch.read_light(link.slot, previous)
        return None


__all__ = ["CatchUpCommand"]
