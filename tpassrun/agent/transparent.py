"""The transparent mode on the agent's side (``--snapshot-interval S``, docs/transparent.md): a script that does not
use the worker API survives a death or a taint through whole-job process snapshots (CRIU, through
:mod:`tpassrun.snapshot`). A part of :class:`tpassrun.agent.Agent`.

* every S seconds: every rank's process group stopped, each rank's tree dumped (``--leave-running``), all continued;
* a rank dies: every rank killed, every rank restored from the last snapshot on its slot, all continued;
* a rank is tainted: every rank stopped and dumped now, every rank restored, the tainted one on a spare slot.

Invariants: no rank runs while another is being dumped, and a restore is of every rank from one snapshot (see
tpassrun/snapshot/plan.py); one restore or snapshot at a time (``_lock``); anything that fails here ends in
torchrun's whole-group restart with one line saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tpassrun.agent.state import AgentState
from tpassrun.channel import LocalSlots, Slot, SlotState
from tpassrun.launch import StdioSpec, adopt_worker
from tpassrun.records import (
    SnapshotFailed,
    SnapshotMigrated,
    SnapshotRestored,
    SnapshotTaken,
    TransparentFallback,
    TransparentOff,
    TransparentOn,
    emit,
)
from tpassrun.settings import envnames as E
from tpassrun.snapshot import (
    WORKER_ENV,
    Availability,
    Move,
    NetworkLock,
    SnapshotError,
    continue_groups,
    dump,
    on_death,
    on_taint,
    probe,
    restore,
    signal_groups,
    snapshot_due,
    stdio_pipes,
    stop_groups,
    tcp_ports,
    wait_gone,
    wait_stopped,
)

log = logging.getLogger("tpassrun.agent")
KILL_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class RankImage:
    """One rank's part of a snapshot: where its images are and what its restored process needs."""

    rank: int
    slot: int
    local_rank: int
    pid: int
    pipes: dict[int, str]          # its stdout/stderr fd -> the dumped "pipe:[ino]"
    stdio: StdioSpec
    argv: list[str]
    images: str


@dataclasses.dataclass(frozen=True)
class Snapshot:
    seq: int
    path: str
    taken_at: float                # monotonic
    ranks: tuple[RankImage, ...]
    seconds: float                 # the pause: first stop to last continue
    ports: tuple[int, ...]         # the local ports of the ranks' TCP sockets: the job's network lock


class Transparent:
    """The agent's snapshots of its workers; ``active`` only once ``criu check`` passed (see :meth:`start`)."""

    def __init__(self, state: AgentState, slots: LocalSlots, watch: Callable[[Slot, Any], object]) -> None:
        self._state = state
        self._slots = slots
        self._watch = watch          # called with each restored worker: its exit reaches the supervisor
        self.availability: Availability | None = None
        self._dir: str | None = None
        self._owns_dir = False
        self._seq = 0
        self.last: Snapshot | None = None
        self._lock = asyncio.Lock()
        self._started = time.monotonic()

    @property
    def requested(self) -> bool:
        return self._state.cfg.snapshot_interval > 0

    @property
    def active(self) -> bool:
        return self.availability is not None and self.availability.usable

    async def start(self) -> None:
        """Decide once, at start, whether the mode runs: one console line when it cannot (the job then runs exactly
        as under torchrun)."""
        st = self._state
        if not self.requested:
            return
        why = self._unsupported()
        self.availability = await probe(st.environ) if why is None else None
        if self.availability is not None and not self.availability.usable:
            why = self.availability.reason
        if why is not None:
            self.availability = None
            log.warning("tpassrun: transparent mode off (%s): the job runs as under torchrun, a failure restarts the "
                        "whole group", why)
            emit(st.events, TransparentOff(reason=why))
            return
        given = st.environ.get(E.TPASSRUN_SNAPSHOT_DIR)
        self._dir = given or tempfile.mkdtemp(prefix="tpassrun-snapshots-")
        self._owns_dir = not given
        os.makedirs(self._dir, exist_ok=True)
        assert self.availability is not None
        emit(st.events, TransparentOn(criu=self.availability.criu, version=self.availability.version,
                                      interval=st.cfg.snapshot_interval, dir=self._dir))

    def _unsupported(self) -> str | None:
        cfg = self._state.cfg
        if cfg.max_nodes > 1 or cfg.spare_node:
            return "it moves processes within one node in this version (--nnodes 1)"
        return None

    def close(self) -> None:
        if self._dir is not None and self._owns_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def worker_env(self) -> dict[str, str]:
        return dict(WORKER_ENV) if self.active else {}

    def generation_started(self) -> None:
        """A new group of workers (a restart): snapshots of the previous one are worth nothing."""
        self._started = time.monotonic()
        self._drop_older_than(None)

    # ------------------------------------------------------------------ periodic snapshots
    async def run(self) -> None:
        """The generation's snapshot task: one whole-job snapshot every ``--snapshot-interval`` seconds."""
        interval = self._state.cfg.snapshot_interval
        while True:
            now = time.monotonic()
            if snapshot_due(now, self.last.taken_at if self.last else None, self._started, interval):
                with contextlib.suppress(SnapshotError):
                    await self.snapshot()
                if self.last is None or time.monotonic() - self.last.taken_at > interval:
                    self._started = time.monotonic()   # failed (a rank starting or ending): next interval
            await asyncio.sleep(min(0.5, interval / 4))

    def _running(self) -> list[Slot]:
        return [s for s in self._slots.slots if s.state == SlotState.RUNNING and s.rank is not None and s.alive]

    def _whole_job(self) -> list[Slot] | None:
        """Every rank's slot when every rank of the generation runs here (none finished, none dead) and none uses the
        worker API (its own live swaps cover it; its channel to the agent is not the kind of thing to snapshot)."""
        gen = self._state.generation
        running = self._running()
        if gen is None or len(running) != gen.world_size or any(s.managed for s in running):
            return None
        return running

    async def snapshot(self, *, leave_running: bool = True) -> Snapshot:
        async with self._lock:
            return await self._snapshot(leave_running)

    async def _snapshot(self, leave_running: bool) -> Snapshot:
        st = self._state
        assert self.availability is not None and self._dir is not None
        running = self._whole_job()
        if running is None:
            raise SnapshotError("not every rank is running")
        self._seq += 1
        path = os.path.join(self._dir, f"{self._seq:06d}.partial")
        pids = [s.pid for s in running if s.pid is not None]
        t0 = time.monotonic()
        stop_groups(pids)
        try:
            await wait_stopped(pids)
            images = [RankImage(rank=s.rank, slot=s.index, local_rank=s.local_rank, pid=s.proc.pid,  # type: ignore[arg-type]
                                pipes=stdio_pipes(s.proc.pid), stdio=s.proc.stdio, argv=list(s.proc.argv),
                                images=os.path.join(path, f"rank{s.rank}")) for s in running]
            ports = tuple(tcp_ports(pids))
            async with NetworkLock(ports):
                await asyncio.gather(*(dump(self.availability.criu, im.pid, im.images, leave_running=leave_running)
                                       for im in images))
        except BaseException as exc:
            shutil.rmtree(path, ignore_errors=True)
            continue_groups(pids)     # never leave a rank stopped (a failed move then restarts the group)
            emit(st.events, SnapshotFailed(seq=self._seq, reason=str(exc)[:300]))
            raise
        if leave_running:
            continue_groups(pids)
        seconds = time.monotonic() - t0
        done = path[: -len(".partial")]
        os.rename(path, done)
        snap = Snapshot(self._seq, done, t0, tuple(dataclasses.replace(im, images=os.path.join(done, f"rank{im.rank}"))
                                                   for im in images), seconds, ports)
        self._drop_older_than(snap)
        self.last = snap
        emit(st.events, SnapshotTaken(seq=snap.seq, seconds=round(seconds, 3), ranks=len(images), bytes=_du(done)))
        return snap

    def _drop_older_than(self, keep: Snapshot | None) -> None:
        if self._dir is None:
            return
        for name in os.listdir(self._dir):
            if keep is None or os.path.join(self._dir, name) != keep.path:
                shutil.rmtree(os.path.join(self._dir, name), ignore_errors=True)
        if keep is None:
            self.last = None

    # ------------------------------------------------------------------ a death
    async def on_death(self, slot: Slot, code: int) -> bool:
        """A rank's process died: every rank back from the last snapshot. False: not handled (torchrun's restart)."""
        if not self.active or slot.rank is None:
            return False
        async with self._lock:
            snap = self.last
            ranks = {im.rank: im.slot for im in snap.ranks} if snap is not None else {}
            decision = on_death(slot.rank, snap is not None and slot.rank in ranks, ranks)
            if decision.move is not Move.RESTORE or snap is None:
                return self._fallback(decision.reason)
            t0 = time.monotonic()
            try:
                await self._kill_all([s for s in self._slots.slots if s.rank is not None])
                await self._restore(snap, dict(decision.slots or {}))
            except (SnapshotError, OSError) as exc:
                return self._fallback(f"the restore failed: {exc}")
            seconds = time.monotonic() - t0
            age = t0 - snap.taken_at
            log.warning("tpassrun: rank %s died (exit code %s): every rank restored from the snapshot of %.1f s ago in "
                        "%.2f s (transparent mode)", slot.rank, code, age, seconds)
            emit(self._state.events, SnapshotRestored(rank=slot.rank, code=code, seq=snap.seq, snapshot_age=round(age, 3),
                                                      seconds=round(seconds, 3)))
            return True

    # ------------------------------------------------------------------ a taint
    async def on_taint(self, rank: int, reason: str) -> bool:
        """A tainted rank: snapshot every rank now, restore them all, the tainted one on a free spare slot (its old
        slot quarantined). False: not handled (torchrun's health-aware restart)."""
        st = self._state
        if not self.active:
            return False
        async with self._lock:
            running = self._whole_job()
            if running is None:
                return self._fallback("not every rank is running")
            spares = [s for s in self._slots.slots if s.state == SlotState.SPARE]
            decision = on_taint(rank, {s.rank: s.index for s in running if s.rank is not None}, [s.index for s in spares])
            if decision.move is not Move.MIGRATE or decision.slots is None:
                return self._fallback(decision.reason)
            old = self._slots.slots[next(s.index for s in running if s.rank == rank)]
            target = self._slots.slots[decision.slots[rank]]
            t0 = time.monotonic()
            try:
                snap = await self._snapshot(leave_running=False)      # criu ends every rank once it is dumped
                spare_proc, target.proc = target.proc, None            # the parked spare's exit is nobody's failure
                if spare_proc is not None:
                    spare_proc.signal_group(signal.SIGKILL)
                await self._kill_all(running)
                await self._restore(snap, dict(decision.slots))
            except (SnapshotError, OSError) as exc:
                return self._fallback(f"the move failed: {exc}")
            # a death from now on restores the moved rank where it runs now
            self.last = dataclasses.replace(snap, ranks=tuple(dataclasses.replace(im, slot=decision.slots[im.rank])
                                                              for im in snap.ranks))
            old.state, old.rank, old.proc = SlotState.QUARANTINED, None, None
            old.quarantine_reason = reason or "tainted"
            seconds = time.monotonic() - t0
            log.warning("tpassrun: rank %d moved from slot %d to slot %d in %.2f s, no step lost (transparent mode: "
                        "every rank snapshotted and restored)", rank, old.index, target.index, seconds)
            emit(st.events, SnapshotMigrated(rank=rank, from_slot=old.index, to_slot=target.index, seconds=round(seconds, 3),
                                             seq=snap.seq))
            return True

    # ------------------------------------------------------------------ effects shared by both
    async def _kill_all(self, slots: list[Slot]) -> None:
        """SIGKILL every rank's process group and wait until each one's PIDs are gone (criu restores the same)."""
        procs = [s.proc for s in slots if s.proc is not None]
        signal_groups([p.pid for p in procs], signal.SIGKILL)
        waits = [asyncio.ensure_future(p.wait()) for p in procs]
        if waits:
            await asyncio.wait(waits, timeout=KILL_WAIT_S)
        if not await wait_gone([p.pid for p in procs], KILL_WAIT_S):
            raise SnapshotError("a rank's process did not go away")
        for p in procs:
            with contextlib.suppress(Exception):
                await p.aclose()

    async def _restore(self, snap: Snapshot, slots_of: dict[int, int]) -> None:
        """Every rank of ``snap`` restored (stopped, as dumped) onto its slot in ``slots_of``, then all continued."""
        st = self._state
        assert self.availability is not None
        async def one(im: RankImage) -> tuple[RankImage, Any]:
            fds: dict[str, int] = {}
            reads: dict[int, int] = {}
            try:
                for fd, what in im.pipes.items():
                    r, w = os.pipe()
                    fds[what], reads[fd] = w, r
                pid = await restore(self.availability.criu, im.images, fds)   # type: ignore[union-attr]
            except BaseException:
                for fd in list(fds.values()) + list(reads.values()):
                    os.close(fd)
                raise
            for w in fds.values():
                os.close(w)
            proc = await adopt_worker(pid, im.stdio, reads.get(1), reads.get(2), local_rank=im.local_rank,
                                      role=st.cfg.role, argv=im.argv)
            return im, proc

        for im in snap.ranks:
            slot = self._slots.slots[slots_of.get(im.rank, im.slot)]
            slot.proc = None         # the old process's exit (queued) is not this slot's worker's any more
        async with NetworkLock(snap.ports):      # until every rank is back: none may reset a connection to a peer
            results = await asyncio.gather(*(one(im) for im in snap.ranks), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        restored = [r for r in results if not isinstance(r, BaseException)]
        if failed:
            signal_groups([p.pid for _im, p in restored], signal.SIGKILL)
            raise SnapshotError(str(failed[0]))
        for im, proc in restored:
            slot = self._slots.slots[slots_of.get(im.rank, im.slot)]
            slot.rank, slot.local_rank, slot.proc, slot.exit_code = im.rank, im.local_rank, proc, None
            slot.state = SlotState.RUNNING
            slot.started_at = time.monotonic()
            self._watch(slot, proc)
        continue_groups([p.pid for _im, p in restored])

    def _fallback(self, why: str) -> bool:
        log.warning("tpassrun: transparent mode cannot help here (%s): torchrun's whole-group restart", why)
        emit(self._state.events, TransparentFallback(reason=why))
        return False


def _du(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total
