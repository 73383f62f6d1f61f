"""The worker's one command dispatcher, and what a worker holding a rank does for the agent: the commands it
obeys paused at a step boundary or after a failed step (resume, send its state, reform the world, exit,
raise), and the state transfer to a joiner. A spare is a session without a rank: the same dispatcher serves
it with the spare's commands (:mod:`tpassrun.worker.spare`), a table of message type -> bound method per role.
Also the replica check's place in the step loop (what a failed or refused check does). A part of
:class:`tpassrun.worker.session.Session`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from typing import Any, Callable

from tpassrun.channel import (
    STOP_NOW,
    AbortJoin,
    CatchUp,
    Exit,
    Failed,
    Field,
    Message,
    Raise,
    Raised,
    Reform,
    Reformed,
    Resume,
    SendState,
    ShardRollback,
    ShardRolledBack,
    StepFailure,
    Verdict,
    WorkerPhase,
)
from tpassrun.worker.catchup import CatchUpCommand
from tpassrun.worker.failure import note_interrupted
from tpassrun.worker.receive import _transfer_auth
from tpassrun.worker.replicas import CheckFailed, ReplicaCheck
from tpassrun.worker.sharded import ShardedState
from tpassrun.worker.state import WorkerState
from tpassrun.worker.step import StepTransaction
from tpassrun.worker.world import JoinAborted, abort_process_groups, join_world, leave_process_group, set_rank_env

log = logging.getLogger("tpassrun.worker")

#: A backstop only: the agent answers a worker parked PENDING within its grace (failkind.CAUSE_GRACE_S), or the
#: lease of a node that does not answer more. An agent that never answers leaves the exception the script's own.
VERDICT_WAIT_S = 120.0

#: A command's handler, a bound method of a Session's part: (the message, the step the worker stands at, the exception its step
#: failed with, if any) -> True once the worker is released (it carries on, or leaves).
Handler = Callable[[Any, int, "BaseException | None"], bool]


class BoundaryCommands:
    """Session's command dispatcher (both roles) and the commands of a worker that holds a rank."""

    def __init__(self, state: WorkerState, txn: StepTransaction, sharded: ShardedState, catchup: CatchUpCommand,
                 replicas: ReplicaCheck) -> None:
        self.state = state
        self.txn = txn
        self.sharded = sharded
        self.catchup = catchup
        self.replicas = replicas
        #: The commands a rank obeys, by type.
        self.rank_table: dict[type[Message], Handler] = {
            Resume: self.on_resume, SendState: self.on_send_state, ShardRollback: self.on_shard_rollback,
            Reform: self.on_reform, Exit: self.on_exit, Raise: self.on_raise,
            CatchUp: catchup.on_catch_up}   # (tpassrun/worker/catchup.py)
        #: A spare's, registered by its Session (``SpareCommands.table``, tpassrun/worker/spare.py).
        self.spare_table: dict[type[Message], Handler] = {}

    def at_boundary(self, step: int) -> None:
        st = self.state
        link = st.managed_link()
        if link.get(Field.RUN_UNTIL) == STOP_NOW:
            # A rank died (STOP_NOW is an unplanned recovery's): this world is over. A peer that started this
            # step before the stop may be blocked in a collective with *us* alone (a sub-group: HSDP's replicate
            # all-reduce, a tensor-parallel pair), not with the dead rank, and would wait for us until the phase
            # timeout: tear our end down, so that it fails at once and the pause completes.
            abort_process_groups()
        link.set(Field.OFFER, st.window + 1)     # the open window's start (this step outside a window)
        self.catchup.publish_back(st.window)             # and the one before it (a mixed commit, tpassrun/worker/catchup.py)
        link.set(Field.PHASE, WorkerPhase.PAUSED)
        self.serve(step)

    def after_failure(self, step: int, exc: BaseException, kind: StepFailure) -> None:
        st = self.state
        link = st.managed_link()
        committed = st.committed == step
        # The step is re-executed from its window's start, or (failed after its commit point) the next one starts
        # from its seal, if the step had made all its changes to the replicated state (else: no exact step).
        st.failed_seal = st.commit_light if committed and st.sealed == step else None
        st.commit_light = None
        if not committed:
            link.set(Field.OFFER, st.window + 1)
            self.catchup.publish_back(st.window)
        else:
            complete = st.failed_seal is not None and self.txn.complete_after_commit()
            link.set(Field.OFFER, step + 2 if complete else 0)
            self.catchup.publish_back(step + 1)     # the start of this step's window: before its optimizer step
        self.sharded.fence()         # its local copies' steps are published before the agent reads them
        # Tear our end of every collective down now: a peer blocked on *us* (not on the dead rank) only
        # learns of the failure when our sockets close, so aborting here cascades the error to every
        # survivor instead of leaving some blocked until gloo's 30-minute timeout.
        abort_process_groups()
        link.set(Field.PHASE, WorkerPhase.FAILED)
        link.send(Failed(step=step, error=f"{type(exc).__name__}: {exc}"[:500],
                         error_type=f"{type(exc).__module__}.{type(exc).__qualname__}", failure=kind.value))
        self.serve(step, failed=exc)

    def ask_cause(self, step: int, exc: BaseException) -> StepFailure:
        """``exc`` came from no code of torch.distributed's (the script's, a framework's, torch's ops): in a world of
        several ranks, ask the agent whether a peer's failure came first (:mod:`tpassrun.agent.cause`). Parked
        PENDING with every collective left open, so that nothing this rank does can make a peer fail meanwhile:
        the agent's answer is about failures that came first. One rank alone has no peer to blame."""
        st = self.state
        link = st.managed_link()
        if st.world_size <= 1:
            return StepFailure.USER
        link.set(Field.VERDICT, Verdict.NONE)
        link.set(Field.PHASE, WorkerPhase.PENDING)
        link.send(Raised(step=step, error=f"{type(exc).__name__}: {exc}"[:500],
                         error_type=f"{type(exc).__module__}.{type(exc).__qualname__}"))
        deadline = time.monotonic() + VERDICT_WAIT_S
        verdict: int = Verdict.NONE
        while verdict == Verdict.NONE and time.monotonic() < deadline:
            time.sleep(0.01)
            verdict = link.get(Field.VERDICT)
        link.set(Field.VERDICT, Verdict.NONE)
        return StepFailure.CASUALTY if verdict == Verdict.CASUALTY else StepFailure.USER

    def check_replicas(self, step: int) -> bool:
        """The replica check at a step start (:mod:`tpassrun.worker.replicas`). True when this rank went through a
        recovery or waited for a restart instead (a collective of the check failed; no replica could be trusted):
        the caller starts the loop over."""
        st = self.state
        link = st.managed_link()
        loaded, st.replicas_due = bool(st.replicas_due), None
        try:
            restart = self.replicas.rounds(step, loaded)
        except CheckFailed as exc:
            cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            note_interrupted(st.rank, f"the replica check at step {step}", StepFailure.COLLECTIVE, cause)
            st.replicas_due = loaded          # and checked again in the world the recovery re-forms
            self.after_failure(step, cause, StepFailure.COLLECTIVE)
            return True
        if not restart:
            return False
        # the agent restarts the group (rank 0 said why): wait here, never train on state known to differ
        st.replicas_due = loaded
        link.set(Field.PHASE, WorkerPhase.PAUSED)
        self.serve(step)
        return True

    def serve(self, step: int, failed: BaseException | None = None) -> None:
        """Obey the agent until it releases this worker: a rank carries on at ``step`` (or leaves), a spare
        has become a rank. Commands that came while a spare waited for its sender are obeyed first. A handler
        that moves the rank to another step (a shard rollback) sets ``serve_step``."""
        st = self.state
        link = st.managed_link()
        spare = st.spare is not None
        table = self.spare_table if spare else self.rank_table
        st.serve_step = step
        while True:
            msg = st.pending.pop(0) if st.pending else link.recv()
            handler = table.get(type(msg))
            if handler is None:
                if spare:
                    log.warning("spare ignoring unexpected command %r", msg.KIND)
                else:
                    log.warning("ignoring unexpected command %r at step %d", msg.KIND, st.serve_step)
                continue
            if handler(msg, st.serve_step, failed):
                return

    # --- a rank's commands ---
    def on_resume(self, msg: Resume, step: int, failed: BaseException | None) -> bool:
        link = self.state.managed_link()
        if failed is None and link.get(Field.RUN_UNTIL) <= step:
            link.set(Field.PHASE, WorkerPhase.PAUSED)
            return False  # still held at this boundary; wait for the next command
        link.set(Field.PHASE, WorkerPhase.RUNNING)
        return True

    def on_send_state(self, msg: SendState, step: int, failed: BaseException | None) -> bool:
        from tpassrun.transfer import handoff
        from tpassrun.worker import faultpoints as testing

        st = self.state
        link = st.managed_link()
        link.set(Field.PHASE, WorkerPhase.TRANSFERRING)
        if testing.ENABLED:
            testing.fault_point(st.rank, step, "send")   # tests: the sender dies mid-handoff
        objs = {k: v for k, v in st.tracked.items() if not (msg.replicated_only and k in st.per_rank)
                and not (msg.without_sharded and k in st.sharded)}   # those: from the mirror
        unique = _not_replicated(objs) if msg.replicated_only else []
        unique += _refused(objs)   # an adapter's configuration tpassrun cannot hand over: never, planned or not
        if st.shard_restore_due is not None and set(objs) & st.sharded:
            # rolled back to an earlier step's copy, whose sharded part is loaded only in the re-formed world:
            # the live shards are a later step's, never the resume step's (worker_shards._shard_rollback)
            unique.append(f"its sharded state is past step {st.shard_restore_due}, the recovery's resume step")
        if unique:
            # e.g. a ZeRO optimizer partition: this rank's copy is not the dead rank's. Refuse (the joiner sees
            # the connection close at once) rather than hand over the wrong state.
            log.warning("rank %d cannot hand its state over%s: %s", st.rank,
                        " for an unplanned recovery" if msg.replicated_only else "", "; ".join(unique))
            _refuse_send(msg)
            return False
        rng = handoff.capture_rng() if msg.rng else None
        # a donor's replicated state is that of the step it offers to resume at (its window's start, or the next
        # step after a complete step that failed past its commit point), which a survivor catching up checks
        offer = link.get(Field.OFFER) - 1
        at = offer if msg.replicated_only and offer >= 0 else step
        bundle = handoff.capture(objs, step=at, rng=rng, extra={"objects": sorted(objs), "swap_id": msg.swap_id})
        try:
            _send_state(msg, bundle,
                        corrupt=lambda: testing.ENABLED and testing.wants(st.rank, step, "send", "corrupt"),
                        cut=testing.ENABLED and testing.wants(st.rank, step, "send", "cut_handshake"),
                        give_up=link.waiting)
        except (OSError, handoff.HandoffError) as exc:
            # the joiner reports the failed transfer; this rank waits for the next command (resume, exit)
            log.debug("rank %d: sending its state failed: %s", st.rank, exc)
        return False

    def on_shard_rollback(self, msg: ShardRollback, step: int, failed: BaseException | None) -> bool:
        # the whole state back to this rank's own copy of an earlier step's start (tpassrun/worker/sharded.py)
        st = self.state
        link = st.managed_link()
        target = msg.step
        try:
            self.sharded.rollback(target)
        except Exception as exc:  # reported: the recovery aborts, nothing half-applied runs
            log.exception("rank %d: rolling back to its copy of step %d failed", st.rank, target)
            link.send(ShardRolledBack(ok=False, step=target, error=f"{type(exc).__name__}: {exc}"[:300]))
            return False
        st.serve_step = target
        link.set(Field.STEP, target)
        link.send(ShardRolledBack(ok=True, step=target))
        return False

    def on_reform(self, msg: Reform, step: int, failed: BaseException | None) -> bool:
        st = self.state
        link = st.managed_link()
        loaded = st.caught_up is not None or st.shard_restore_due is not None   # its state moved: a suspect
        if msg.rollback and not (st.stands_at == step and msg.resume in (None, step)):
            self.roll_back(step, msg.resume, failed is not None)
        try:
            self._reform(msg)
        except JoinAborted as exc:
            self.join_aborted(st.step, str(exc))
            return False
        st.stands_at = None
        self.replicas.after_recovery(loaded)    # the replicas compare digests at the next step (tpassrun/worker/replicas.py)
        times = st.reform_times
        link.send(Reformed(rank=st.rank, world_size=st.world_size, generation=st.generation,
                           leave_s=times.get("leave_s"), join_s=times.get("join_s"),
                           callbacks_s=times.get("callbacks_s")))
        link.set(Field.PHASE, WorkerPhase.RUNNING)
        return True

    def join_interrupted(self, prefix: str) -> bool:
        """While waiting for the other ranks to arrive in the world under ``prefix``: True once the agent gave it
        up (:class:`AbortJoin`); a late one, for a world given up before, is dropped; any other command is kept
        for the dispatcher."""
        st = self.state
        link = st.managed_link()
        while link.waiting():
            msg = link.recv()
            if isinstance(msg, AbortJoin):
                if msg.prefix in ("", prefix):
                    return True
                continue
            st.pending.append(msg)
        return False

    def join_aborted(self, step: int, why: str) -> None:
        """The world being re-formed was given up (a rank died on its way into it): stay paused at ``step``,
        the step this worker resumes at (already rolled back to it), without a process group, until the
        recovery that replaces the dead rank re-forms the world again (then nothing is rolled back twice)."""
        st = self.state
        link = st.managed_link()
        st.stands_at = st.serve_step = step
        link.set(Field.STEP, step)
        link.set(Field.OFFER, step + 1)
        link.set(Field.ALT_BACK, 0)
        link.set(Field.PHASE, WorkerPhase.PAUSED)
        who = f"rank {st.rank}" if st.spare is None else "joiner"
        log.warning("%s: the world being re-formed was given up (%s); waiting at step %d", who, why, step)
        link.send(Reformed(ok=False, rank=st.rank, error=f"join given up: {why}"[:300]))

    def on_exit(self, msg: Exit, step: int, failed: BaseException | None) -> bool:
        self.state.managed_link().set(Field.PHASE, WorkerPhase.DONE)
        leave_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(msg.code)

    def on_raise(self, msg: Raise, step: int, failed: BaseException | None) -> bool:
        if failed is not None:
            raise failed
        raise RuntimeError(msg.reason or "tpassrun agent asked this worker to fail")

    def roll_back(self, step: int, resume: int | None, failed: bool) -> None:
        """An unplanned recovery resumes everyone at ``resume``: put this rank's per-rank state (RNG, data
        position) where it was then. Model and optimizer are already there: nothing changes them before the
        commit point, and a step that failed after it resumes at the next one."""
        st = self.state
        if resume is None:                      # an agent that does not say: the failed step, as before
            resume = st.window if failed or st.window < step else step
        caught_up, st.caught_up = st.caught_up, None
        back, st.back_txn = st.back_txn, None
        if caught_up is not None and back is not None and caught_up[0] == resume <= step:
            # a mixed commit, the other way: this rank committed a step other survivors did not; it took the
            # replicated state of its start from one of them (CatchUp), and its own snapshot of it is kept
            self.catchup.go_back(resume, caught_up[1], back)
        elif resume == step + 1 and failed and st.failed_seal is not None:
            self.txn.restore_light(st.failed_seal)     # failed after its commit point: the seal is step + 1's start
            self.txn.drop_grads()
            self.txn.window_closed()
        elif resume == step + 1 and failed and caught_up is not None and caught_up[0] == resume:
            # a mixed commit: the replicated state of step + 1 came from a survivor that completed this step
            # (CatchUp); the per-rank state is this rank's own seal of it
            self.txn.restore_light(caught_up[1])
            self.txn.drop_grads()
            self.txn.window_closed()
        elif resume == st.window and (failed or st.window < step):
            # the failed step, or the open accumulation window, is re-executed from its start: put back what it
            # consumed (the gradients it accumulated go too)
            if st.rollback_light is not None:
                self.txn.restore_light(st.rollback_light)
            self.txn.drop_grads()
        elif resume != step:
            raise RuntimeError(f"tpassrun: cannot resume at step {resume}: this rank stopped at step {step} "
                               f"(window from {st.window}, {'failed' if failed else 'paused'})")
        st.failed_seal = st.commit_light = None
        # A step from ``resume`` on runs again: its seal and its commit point are to be taken again. A stale seal
        # made the re-executed step re-seal in place over the buffer that had just received its start snapshot,
        # so a second death in that step found no snapshot of its start (yoco --double: a recovery, then a kill
        # in the first step after it, fell back to a group restart).
        if st.sealed >= resume:
            st.sealed = -1
        if st.committed >= resume:
            st.committed = -1
        st.step = st.window = resume

    def _reform(self, msg: Reform) -> None:
        from tpassrun.worker import faultpoints as testing

        st = self.state
        link = st.managed_link()
        link.set(Field.PHASE, WorkerPhase.RECONFIGURING)
        t0 = time.perf_counter()
        leave_process_group()
        world = msg.world
        st.rank = world.rank
        st.world_size = world.world_size
        st.generation = world.generation if world.generation is not None else st.generation
        set_rank_env(world)
        t1 = time.perf_counter()
        if testing.ENABLED:
            testing.fault_point(st.rank, st.step, "reform")   # tests: a rank dies while the world re-forms
        join_world(st.backend, world, st.timeout, lambda: self.join_interrupted(str(world.prefix)))
        t2 = time.perf_counter()
        try:
            for fn in st.callbacks:
                fn()        # (a DDP rebuilt on the new world: its first collectives)
        except Exception as exc:  # a rank that died after it arrived fails them: given up too
            log.warning("rank %s: the re-formed world failed before it was ready: %s", st.rank, exc)
            abort_process_groups()     # peers blocked on this rank fail at once too
            raise JoinAborted(f"the re-formed world failed before it was ready: {type(exc).__name__}: {exc}"[:300]) \
                from exc
        st.swaps += 1
        self.sharded.after_reform()   # a rolled-back survivor loads its sharded copy in the new world
        st.light_retarget_due = 2  # the buddy ring may have changed with the world: ask at the next step start
        st.reform_times = {"leave_s": round(t1 - t0, 4), "join_s": round(t2 - t1, 4),
                              "callbacks_s": round(time.perf_counter() - t2, 4)}


def _not_replicated(objs: dict[str, Any]) -> list[str]:
    """Why each object that declares ``replicated = False`` (a framework adapter's sharded state) cannot be
    taken from a data-parallel peer."""
    out = []
    for name, obj in objs.items():
        if getattr(obj, "replicated", True) is False:
            why = getattr(obj, "why_not_replicated", None)
            out.append(f"{name}: {why() if callable(why) else 'not replicated on other ranks'}")
    return out


def _refused(objs: dict[str, Any]) -> list[str]:
    """Why each object whose adapter cannot hand it over at all (``handover_refused()``: e.g. a DeepSpeed
    configuration it does not support; the job runs as under torchrun) refuses to travel."""
    out = []
    for name, obj in objs.items():
        refused = getattr(obj, "handover_refused", None)
        why = refused() if callable(refused) else None
        if why:
            out.append(f"{name}: {why}")
    return out


def _refuse_send(msg: SendState) -> None:
    """Tell the waiting joiner at once that no state comes from here: authenticate (so it is not taken for a
    stranger and ignored), then close before the first byte of state; it reports the transfer failed."""
    from tpassrun.transfer import handoff
    from tpassrun.transfer import wire as handoff_wire

    try:
        with socket.create_connection((msg.addr, msg.port), timeout=5) as sock:
            handoff_wire._sender_handshake(sock, _transfer_auth(msg.key, msg.swap_id, msg.rank))
    except (OSError, handoff.HandoffError):
        pass


def _send_state(msg: SendState, bundle: Any, *, corrupt: Callable[[], bool], cut: bool = False,
                give_up: Callable[[], bool] | None = None) -> Any:
    """Stream ``bundle`` to the joiner named in ``msg``; a connection lost before the joiner proved the key is
    tried again at once (:func:`~tpassrun.transfer.wire.connect_and_send`) until ``msg.timeout`` or ``give_up()``
    (the agent sent a command). ``corrupt`` and ``cut`` are the tests' fault hooks: ``corrupt`` is asked only
    once the joiner proved the key, so a fault meant for a transfer is not used up by a joiner that is already
    gone; ``cut`` drops the first connection after 18 of the proof's 68 bytes."""
    from tpassrun.transfer import handoff

    return handoff.connect_and_send(msg.addr, msg.port, bundle, timeout=msg.timeout,
                                    auth=_transfer_auth(msg.key, msg.swap_id, msg.rank), give_up=give_up,
                                    _corrupt_byte_at=lambda: 4096 if corrupt() else None,
                                    _cut_first_handshake_at=18 if cut else None)
