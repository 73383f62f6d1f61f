"""A survivor moved across a mixed commit (:mod:`tpassrun.plan.catchup`): the ``CatchUp`` command. Forward: a rank that
failed inside a step other survivors completed takes their replicated state of the next step and keeps its own
seal of it. Back: a rank that committed a step other survivors did not takes their replicated state of that step's
start and keeps its own start snapshot of it, which it holds as the start of its previous transaction (kept here at
each transaction's start: a reference to bytes the step transaction took anyway, no per-step cost). A part of
:class:`tpassrun.worker.session.Session`; the rank's dispatcher (:mod:`tpassrun.worker.commands`) names the
handler, the receive path is the joiner's (:mod:`tpassrun.worker.spare`), and ``BoundaryCommands.roll_back``
restores the per-rank state at ``Reform``.
"""

from __future__ import annotations

import logging

from tpassrun.channel import CatchUp, Field, Listening, Received, WorkerPhase
from tpassrun.worker.receive import _apply_one, _bundle_step, _receive_state, _transfer_auth
from tpassrun.worker.state import Txn, WorkerState
from tpassrun.worker.step import StepTransaction

log = logging.getLogger("tpassrun.worker")

class CatchUpCommand:
    """Session's ``CatchUp`` command and the transactions it may go back to (see the module doc)."""

    def __init__(self, state: WorkerState, txn: StepTransaction) -> None:
        self.state = state
        self.txn = txn

    # --- the transactions a rank keeps (Session.run calls begin_txn at each transaction's first step) ---
    def begin_txn(self, step: int) -> None:
        st = self.state
        txn = st.txn
        if txn is None or txn[0] != step:
            st.prev_txn = txn
            st.txn = (step, st.rollback_light, st.window_marks, st.last_window_marks)

    def txn_before(self, step: int) -> Txn | None:
        """The newest transaction that began before ``step`` whose start snapshot this rank holds."""
        st = self.state
        for txn in (st.txn, st.prev_txn):
            if txn is not None and txn[0] < step and txn[1] is not None:
                return txn
        return None

    def publish_back(self, own: int) -> None:
        """Stopping (paused, or failed at step ``own - 1`` or before): the start this rank can go back to, next to
        its own offer (``Field.ALT_BACK``). Under plain data parallelism only: sharded state rolls back its way."""
        st = self.state
        link = st.managed_link()
        txn = self.txn_before(own) if st.light_enabled and not st.sharded else None
        link.set(Field.ALT_BACK, txn[0] + 1 if txn is not None else 0)

    def go_back(self, step: int, light: bytes, txn: Txn) -> None:
        """At ``Reform``: the replicated state of ``step`` came from a survivor standing there (CatchUp); put this
        rank's own per-rank state and transaction bookkeeping back to that step's start."""
        st = self.state
        self.txn.restore_light(light)
        self.txn.drop_grads()
        st.window_marks, st.last_window_marks = txn[2], txn[3]
        st.txn, st.prev_txn = txn, None
        st.sealed = st.committed = step - 1

    # --- the command ---
    def on_catch_up(self, msg: CatchUp, step: int, failed: BaseException | None) -> bool:
        """A mixed commit: take the replicated state of ``msg.step`` (model, optimizer, schedulers, scaler) from a
        survivor that stands there; this rank's own per-rank state of it is its seal (forward: it failed inside
        step ``msg.step - 1`` before committing it, the seal was written in that step's backward pass before this
        rank contributed to its all-reduce) or its previous transaction's start (back: it committed a step the
        others did not). Restored at ``Reform``; from the moment the state is loaded the rank offers ``msg.step``."""
        from tpassrun.transfer import handoff

        st = self.state
        link = st.managed_link()
        back = None
        light = self._own_seal(msg.step) if failed is not None and msg.step == step + 1 else None
        if light is None:
            back = self.txn_before(msg.step + 1)
            if back is not None and back[0] == msg.step and msg.step <= step:
                light = back[1]
        if light is None:
            link.send(Received(ok=False, swap_id=msg.swap_id, attempt=msg.attempt,
                               error=f"rank {st.rank} (stopped at step {step}) holds "
                               f"no seal of step {msg.step} and no snapshot of its start: it cannot move there"))
            return False
        try:
            listener, port = handoff.listen_for_bundle(msg.listen_host or "127.0.0.1")
        except (OSError, handoff.HandoffError) as exc:
            link.send(Received(ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=msg.swap_id,
                               attempt=msg.attempt))
            return False
        phase = link.get(Field.PHASE)
        link.set(Field.PHASE, WorkerPhase.TRANSFERRING)
        link.send(Listening(port=port, swap_id=msg.swap_id, attempt=msg.attempt))
        try:
            received = _receive_state(listener, link, msg, _transfer_auth(msg.key, msg.swap_id, msg.rank),
                                      st.pending, reply=False)
        finally:
            listener.close()
            link.set(Field.PHASE, phase)
        if received is None:
            return False                      # said why (or a command came first: it is served next)
        bundle, stats = received
        names = [n for n in bundle.meta.get("objects", {})]
        missing = [n for n in names if n not in st.tracked or n in st.per_rank]
        if _bundle_step(bundle) != msg.step or missing:
            link.send(Received(ok=False, swap_id=msg.swap_id, attempt=msg.attempt,
                               error=f"the state sent is of step {_bundle_step(bundle)} "
                               f"(not {msg.step}), or for objects this rank does not hold alike: {missing}"))
            return False
        for name in names:
            _apply_one(bundle, name, st.tracked[name])
        st.caught_up, st.back_txn = (msg.step, light), back if back is not None and light is back[1] else None
        # it stands at msg.step now (its per-rank state follows at Reform): a plan that supersedes this one (a second
        # fault) must see that, not the step whose model it no longer holds
        link.set(Field.OFFER, msg.step + 1)
        link.set(Field.ALT_BACK, 0)
        log.warning("rank %d: a mixed commit: took the replicated state of step %d from another survivor (%s)",
                    st.rank, msg.step, "back to its start" if st.back_txn is not None else "catching up")
        link.send(Received(ok=True, swap_id=msg.swap_id, attempt=msg.attempt, nbytes=stats.nbytes,
                           seconds=stats.seconds,
                           checksum=stats.checksum, step=msg.step))
        return False

    def _own_seal(self, step: int) -> bytes | None:
        """This rank's light snapshot labelled ``step`` (its seal of ``step - 1``), from its shared-memory slot."""
        link = self.state.managed_link()
        for previous in (False, True):
            if link.ch.light_step(link.slot, previous) == step:
                return link.ch.read_light(link.slot, previous)
        return None


__all__ = ["CatchUpCommand"]
