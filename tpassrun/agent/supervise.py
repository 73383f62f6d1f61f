"""The agent's supervision: every event of a generation (a worker exited or said it failed, the rendezvous
changed, a fallback or a health restart was asked for, the lease was lost, a signal) handled one at a time,
and what each one ends in (:class:`Outcome`). A part of :class:`tpassrun.agent.Agent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

from tpassrun.agent.state import AgentState, Started
from tpassrun.channel import Done, Failed, Raised, Slot, SlotState
from tpassrun.launch import ProcessFailure, stop_workers
from tpassrun.records import (
    EtcdConnectionLost,
    EtcdConnectionOverdue,
    EtcdConnectionRestored,
    FallbackRestart,
    Fenced,
    HandBackRefused,
    HandedBackHere,
    LeaseLostNoted,
    MembershipChange,
    Signal,
    SpareLost,
    SpareNodeJoined,
    SpareReturned,
    UnmanagedDeath,
    WorkerExit,
    emit,
)
from tpassrun.rendezvous import EtcdRendezvous, Generation, Link, RendezvousError, one_line
from tpassrun.swapper import (
    FallbackRequested,
    HandedBack,
    HealthRestartRequested,
    LeaseLost,
    RendezvousChanged,
    SignalReceived,
    SpawnFailed,
    WorkerExited,
    WorkerSaid,
)

if TYPE_CHECKING:
    from tpassrun.agent.cause import CauseJudge
    from tpassrun.agent.store import WorkersStore
    from tpassrun.agent.transparent import Transparent
    from tpassrun.agent.workers import WorkerSpawning

log = logging.getLogger("tpassrun.agent")


def etcd_link_said(st: AgentState, rdzv: EtcdRendezvous) -> Callable[[Link, Any], None]:
    """A listener of ``rdzv``'s etcd connection: each etcd outage and recovery, said once (the workers keep running
    through it; Supervision fences them when the lease may be gone)."""
    def said(link: Link, detail: Any) -> None:
        if link is Link.LOST:
            emit(st.events, EtcdConnectionLost(reason=one_line(detail)))
        elif link is Link.OVERDUE:
            emit(st.events, EtcdConnectionOverdue(seconds=rdzv.store.config.reconnect_timeout, reason=one_line(detail)))
        else:
            emit(st.events, EtcdConnectionRestored(seconds=round(float(detail), 2)))
    return said


class Outcome:
    SUCCEEDED = "succeeded"
    FAILED = "failed"            # local workers failed: consumes a restart
    MEMBERSHIP = "membership"    # someone else asked for a new generation: free
    CLOSED = "closed"
    SIGNALLED = "signalled"


class Supervision:
    """Agent's event handling within one generation (the generation loop is :class:`tpassrun.agent.Agent`)."""

    def __init__(self, state: AgentState, node: Started, cause: CauseJudge, workers: WorkerSpawning,
                 store: WorkersStore, transparent: Transparent | None = None) -> None:
        self._state = state
        self._node = node
        self._transparent = transparent
        self._cause = cause
        self._workers = workers
        self._store = store
        self._fenced_in: Generation | None = None   # the generation a fence happened in

    async def supervise(self, gen: Generation) -> tuple[str, str]:
        """One event at a time, so the agent's decisions never race each other."""
        st = self._state
        while True:
            ev = await st.queue.get()
            log.debug("supervisor event: %s", type(ev).__name__)
            if isinstance(ev, SignalReceived):
                emit(st.events, Signal(signal=signal.Signals(ev.signal).name))
                return Outcome.SIGNALLED, f"signal {ev.signal}"
            if isinstance(ev, SpawnFailed):
                print(f"tpassrun: error: cannot start worker: {ev.error}", file=sys.stderr, flush=True)
                return Outcome.FAILED, f"cannot start worker: {ev.error}"
            result: tuple[str, str] | None = None
            if isinstance(ev, WorkerExited):
                result = await self._on_exit(gen, ev.slot, ev.proc, ev.code)
            elif isinstance(ev, WorkerSaid):
                if isinstance(ev.message, Done):
                    ev.slot.finished_pid = ev.slot.pid
                if isinstance(ev.message, Failed):
                    self._node.swapper.on_worker_failed_step(ev.slot, ev.message)
                    self._cause.on_failed(gen, ev.slot, ev.message)         # its console line (tpassrun/agent/cause.py)
                    await self._store.standby()
                if isinstance(ev.message, Raised) and ev.slot.proc is not None:
                    self._cause.on_raised(gen, ev.slot, ev.message)      # a casualty, or the root cause (tpassrun/agent/cause.py)
            elif isinstance(ev, RendezvousChanged):
                result = await self._on_rdzv_event(gen, ev.event)
            elif isinstance(ev, FallbackRequested):
                if ev.free and st.free_fallbacks > 0:
                    st.free_fallbacks -= 1
                    log.warning("tpassrun: %s; restarting the whole group (this does not spend --max-restarts; "
                                "%d such restart(s) left on this node)", ev.reason, st.free_fallbacks)
                    emit(st.events, FallbackRestart(reason=ev.reason, spends_restart=False))
                    with contextlib.suppress(RendezvousError):
                        await st.until_signal(self._node.rdzv.request_restart(st.generation or gen, ev.reason))
                    continue
                nxt = ("restarting the whole group (spends one of --max-restarts)" if st.remaining_restarts > 0
                       else "no restart left (--max-restarts): the job fails")
                log.warning("tpassrun: %s; %s", ev.reason, nxt)
                emit(st.events, FallbackRestart(reason=ev.reason, spends_restart=True))
                self._record_failures(ev.slot)
                return Outcome.FAILED, ev.reason
            elif isinstance(ev, HealthRestartRequested):
                if (ev.rank is not None and self._transparent is not None
                        and await self._transparent.on_taint(ev.rank, ev.reason)):
                    continue     # moved live by process snapshots (tpassrun/agent/transparent.py)
                emit(st.events, FallbackRestart(reason=ev.reason))
                with contextlib.suppress(RendezvousError):
                    await st.until_signal(self._node.rdzv.request_restart(st.generation or gen, ev.reason))
            elif isinstance(ev, LeaseLost):
                result = await self._fence(gen, ev.reason)
            elif isinstance(ev, HandedBack):
                running = sorted(s.rank for s in self._node.slots.slots
                                 if s.state == SlotState.RUNNING and s.rank is not None)
                if running:     # the leader asks only of a node its ranks left: never take a rank down with it
                    if not st.handed_back:
                        emit(st.events, HandBackRefused(reason=ev.reason, ranks=running))
                    continue
                st.handed_back = ev.reason
                emit(st.events, HandedBackHere(reason=ev.reason))
                return Outcome.SIGNALLED, f"handed back to the scheduler: {ev.reason}"
            if result is not None:
                return result

    async def _on_exit(self, gen: Generation, slot: Slot, proc: Any, code: int) -> tuple[str, str] | None:
        st = self._state
        if slot.proc is not proc:
            return None  # an old worker of this slot
        slot.exit_code = code
        emit(st.events, WorkerExit(slot=slot.index, rank=slot.rank, pid=proc.pid, code=code, state=slot.state))
        if slot.state == SlotState.SPARE:
            slot.state = SlotState.DEAD
            emit(st.events, SpareLost(slot=slot.index, code=code))
            self._node.swapper.on_spare_lost(slot)
            return None
        if slot.state == SlotState.LEAVING:
            slot.state = SlotState.QUARANTINED
            if slot.release_after_exit:   # migrate-back: the slot it leaves was never sick
                slot.release_after_exit = False
                slot.quarantine_reason = None
                await self._workers.spawn(gen, slot, local_rank=slot.index, rank=-1, master=st.master, spare=True)
                emit(st.events, SpareReturned(slot=slot.index, reason="migrate-back released it"))
            return None
        if slot.state != SlotState.RUNNING:
            return None
        if code == 0:
            slot.state = SlotState.DONE
            if all(s.state == SlotState.DONE for s in self._node.slots.slots if s.rank is not None
                   and s.state in (SlotState.RUNNING, SlotState.DONE)):
                return Outcome.SUCCEEDED, "all workers succeeded"
            return None
        if not slot.managed and self._transparent is not None and await self._transparent.on_death(slot, code):
            return None     # every rank restored from the last snapshot (tpassrun/agent/transparent.py)
        slot.state = SlotState.DEAD
        self._cause.note_death(gen, slot, code)   # a worker of its world waiting for its exception's cause is a casualty
        proc.kill_leftovers()      # its forked children hold its sockets: the survivors must see them close now
        if slot.finished_pid == proc.pid:
            # Its sess.run() had returned (it died in the script's own code after the training loop: a final
            # save, an evaluation): a spare has no step left to take over, and the code it was running is the
            # script's, not ours to replay. torchrun's path: the failure is reported (a restart, if any left).
            log.warning("tpassrun: rank %s died after its training loop (exit code %s): no live recovery",
                        slot.rank, code)
            self._record_failures(slot)
            return Outcome.FAILED, f"rank {slot.rank} (local {slot.local_rank}) exited with {code} after its training loop"
        if await self._node.swapper.on_worker_death(slot, code):
            return None
        if not slot.managed:
            self._unmanaged_death(slot, code)
        self._record_failures(slot)
        return Outcome.FAILED, f"rank {slot.rank} (local {slot.local_rank}) exited with {code}"

    def _unmanaged_death(self, slot: Slot, code: int) -> None:
        """A rank of a script that does not use the worker API died: no spare can take it live (nothing told
        tpassrun the step it was in, nor what state to move). With a spare slot free and a restart left, the
        restart moves the rank onto the spare (the dead slot sits out, as a tainted one does); either way, one
        line says why the spare did not take it live and what would."""
        st = self._state
        if not st.cfg.spares_per_node:
            return
        api = "the script does not use tpassrun's worker API (README: 'The worker API'), so no spare can take it live"
        onto_spare = st.remaining_restarts > 0 and len(self._node.slots.usable_for_start()) > st.cfg.nproc_per_node
        if onto_spare:
            slot.state = SlotState.QUARANTINED
            slot.quarantine_reason = f"rank {slot.rank} died here (exit code {code})"
            then = f"the whole-group restart puts rank {slot.rank} on a spare slot"
        elif st.remaining_restarts > 0:
            then = f"no spare slot is free, the restart reuses slot {slot.index}"
        else:
            then = "--max-restarts N would restart the group onto the spare"
        emit(st.events, UnmanagedDeath(slot=slot.index, rank=slot.rank, code=code, restart_onto_spare=onto_spare,
                                       reason=f"{api}; {then}"))

    def _record_failures(self, first: Slot | None) -> None:
        """torchrun's report lists the failed worker and the ones it then had to stop."""
        st = self._state
        now = time.time()
        for s in self._node.slots.slots:
            if s.proc is None or s.rank is None:
                continue
            if s is first or (s.state in (SlotState.DEAD,) and s.exit_code not in (None, 0)):
                st.failures.append(ProcessFailure.from_exit(
                    local_rank=s.local_rank, rank=s.rank, pid=s.proc.pid, exitcode=s.exit_code or 1,
                    error_file=s.proc.error_file, now=lambda: now))

    def record_stopped(self) -> None:
        """torchrun re-polls after SIGTERMing the rest of the group: the workers that died of it (exit -15, or
        whatever they exited with but 0) are the report's "other failures", after the first ones (torchrun's
        failures dict keeps that insertion order; on a timestamp tie the first one is the root cause)."""
        st = self._state
        seen = {f.pid for f in st.failures}
        for s in self._node.slots.slots:
            proc = s.proc
            if proc is None or s.rank is None or s.rank < 0 or proc.pid in seen or proc.returncode in (None, 0):
                continue
            st.failures.append(ProcessFailure.from_exit(local_rank=s.local_rank, rank=s.rank, pid=proc.pid,
                                                        exitcode=proc.returncode, error_file=proc.error_file))

    async def _on_rdzv_event(self, gen: Generation, ev: Any) -> tuple[str, str] | None:
        st = self._state
        kind = getattr(ev.kind, "value", ev.kind)
        if kind == "closed":
            reason = getattr(ev, "reason", "") or ""
            if reason.startswith("succeeded"):
                if self._holds_no_rank(gen):
                    # A spare node never promoted, or a member whose ranks all moved elsewhere, has no workers whose
                    # exit would end it: without this it waited forever after the job succeeded.
                    return Outcome.SUCCEEDED, self._idle_success(gen)
                return None  # another node finished first; ours finish on their own (torchrun: same)
            if any(s.state == SlotState.RUNNING for s in self._node.slots.slots):
                return Outcome.CLOSED, f"the run was closed by another agent: {reason}"
            return None
        if kind == "generation_changed":
            new = ev.generation
            if new is None or new.number == gen.number:
                return None
            if getattr(new.state, "value", new.state) == "closed":
                if (new.reason or "").startswith("succeeded"):
                    if self._holds_no_rank(gen):   # an idle node: see "closed" above
                        return Outcome.SUCCEEDED, self._idle_success(gen)
                    return None
                return Outcome.CLOSED, new.reason
            if new.swap_id and getattr(new.state, "value", new.state) == "active":
                self._node.swapper.on_generation_committed(new)
                st.generation = new
                return None
            return Outcome.MEMBERSHIP, f"generation {new.number} requested: {new.reason}"
        if kind == "node_lost" and ev.node_id == st.node_id:
            # Our lease expired during an etcd outage, and we are alive: we fenced ourselves if anyone else
            # could hold our ranks; otherwise nobody can, and the lost mark goes with the next generation.
            return None
        if kind == "spare_node_joined" and self._node.rdzv.is_leader:
            # a spare node added to the running job: one started later, or a node lost earlier whose link came
            # back (it fenced its workers, its ranks live elsewhere now): the pool has its slots again
            emit(st.events, SpareNodeJoined(joined=ev.node_id))
            return None
        if kind in ("node_lost", "node_waiting") and self._node.rdzv.is_leader:
            reason = f"{kind.replace('_', ' ')}: {ev.node_id}"
            if kind == "node_lost" and await self._node.swapper.on_node_lost(ev.node_id):
                return None
            emit(st.events, MembershipChange(reason=reason))
            with contextlib.suppress(RendezvousError):
                await st.until_signal(self._node.rdzv.request_restart(st.generation or gen, reason))
            return None
        return None

    def _idle_success(self, gen: Generation) -> str:
        st = self._state
        if (st.generation or gen).member(st.node_id) is None:
            return "the run succeeded (this spare node was not needed)"
        return "the run succeeded (no rank runs here any more: swaps moved this node's ranks to other nodes)"

    def _holds_no_rank(self, gen: Generation) -> bool:
        """No rank runs here: a spare node never promoted, or a member whose ranks all moved to other nodes by
        swaps (taints, recoveries), even while the record still lists it as a member: its slots are all spares, so
        the job's success ends it, not its own workers. Only workers running a rank end a node on their own."""
        return not any(s.state == SlotState.RUNNING and s.rank is not None for s in self._node.slots.slots)

    # ------------------------------------------------------------------ fencing
    async def join(self) -> Generation:
        """Join the next generation once etcd has acknowledged our lease again, if it looks lost. A node
        that just fenced joined at once, spawned its workers and fenced them again as soon as its new
        generation's lease watch started, at every generation until a refresh got through (8 generations in
        3 s, each restarting the job). Bounded by ``reconnect_timeout``: past it the join says etcd is gone."""
        store = self._node.rdzv.store
        if not store.lease_sure():
            log.info("waiting for etcd to acknowledge this node's lease before joining again")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._node.rdzv.lease_held(), store.config.reconnect_timeout)
        return await self._node.rdzv.join()

    async def watch_lease(self, gen: Generation) -> None:
        """Fence from this task, at once, not through the supervision queue: the supervisor may be inside a
        handler that waits for etcd (a failure record, a swap step) for as long as the outage lasts, and a fence
        handled only then would leave a partitioned node's workers running past its lease."""
        st = self._state
        while True:
            reason = await self._node.rdzv.lease_lost()
            if await self._fence_workers(st.generation or gen, reason):
                st.queue.put_nowait(LeaseLost(reason))   # the rest (a new generation) once etcd answers
            await self._node.rdzv.lease_held()   # not fenced (nobody else could hold our ranks): watch the next one

    async def _fence_workers(self, gen: Generation, reason: str) -> bool:
        """Our etcd lease may have expired (etcd unreachable from here, or refreshes too late): the leader may
        already have declared this node lost and started our ranks elsewhere. Kill our workers at once, so no
        rank is ever held by two live processes (then :meth:`_fence` asks for a new generation and re-joins).

        Only when another node could take our ranks: a job of one node with no spare node keeps running
        through an etcd hiccup (nobody else can hold its ranks)."""
        st = self._state
        others = [m for m in gen.members if m.node_id != st.node_id] + [n for n in gen.spare_nodes
                                                                           if n != st.node_id]
        procs = [s.proc for s in self._node.slots.slots if s.proc is not None and s.proc.returncode is None]
        if not others or not procs:
            emit(st.events, LeaseLostNoted(reason=reason, fenced=False))
            return False
        self._fenced_in = gen
        for s in self._node.slots.slots:   # their deaths are ours to cause: not failures, not swaps
            if s.state in (SlotState.RUNNING, SlotState.SPARE, SlotState.LEAVING):
                s.state = SlotState.IDLE
        await stop_workers(procs, signal.SIGKILL, 5.0)
        emit(st.events, Fenced(reason=reason, pids=[p.pid for p in procs]))
        log.warning("fenced: %s; stopped %d workers", reason, len(procs))
        return True

    async def _fence(self, gen: Generation, reason: str) -> tuple[str, str]:
        """After :meth:`_fence_workers`: ask for a new generation (a no-op if the leader already moved past the
        one we fenced in, e.g. our ranks were recovered live elsewhere) and end this one."""
        st = self._state
        fenced_in, self._fenced_in = self._fenced_in or gen, None
        with contextlib.suppress(RendezvousError):
            await st.until_signal(self._node.rdzv.request_restart(fenced_in, f"node {st.node_id} fenced: {reason}"))
        return Outcome.MEMBERSHIP, f"fenced: {reason}"
