"""The agent's local worker slots: processes, the shared-memory channel and the unix socket.

A node has ``nproc`` active slots and ``--spares-per-node`` spare slots. A slot is a device (a GPU on real
hardware); a worker process runs in it. After a swap a spare slot holds a rank and the leaver's slot is
quarantined, so "local rank" and "slot" are different things: this module keeps the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable

from tpassrun.channel.protocol import Break, Command, Hello, Message, ProtocolError, Replicas, Reply, Watch, decode_reply, encode
from tpassrun.channel.shm import INT64_MAX, ChannelFile, Field, WorkerPhase
from tpassrun.records import WorkerRow

log = logging.getLogger(__name__)


class SlotState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"          # holds a rank
    SPARE = "spare"              # warm spare, waiting in tpassrun.init()
    LEAVING = "leaving"          # handed its rank over; about to exit 0
    DONE = "done"                # exited 0 after finishing
    DEAD = "dead"
    QUARANTINED = "quarantined"  # tainted or failed; not used until untainted


_S = SlotState
# The one table of a slot's transitions (who takes each: agent_workers spawns, resets and stops; agent_supervise
# reaps exits and fences; the swapper hands a spare its rank and retires a leaver). Staying put is always
# allowed. A transition not in the table is a bug: it is logged (the agent carries on, as it did).
SLOT_TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    _S.IDLE: frozenset({_S.RUNNING, _S.SPARE, _S.DEAD, _S.QUARANTINED}),   # spawn (DEAD: it failed); restart taint
    _S.RUNNING: frozenset({_S.DONE, _S.DEAD, _S.LEAVING, _S.QUARANTINED, _S.IDLE}),   # exit; leaver; retired; stopped
    _S.SPARE: frozenset({_S.RUNNING, _S.DEAD, _S.IDLE}),                  # a joiner takes its rank; lost; stopped
    _S.LEAVING: frozenset({_S.QUARANTINED, _S.IDLE}),                     # the leaver exited; stopped
    _S.DONE: frozenset({_S.IDLE, _S.QUARANTINED}),                        # next generation; restart taint
    _S.DEAD: frozenset({_S.QUARANTINED, _S.IDLE}),                        # an unplanned swap's leaver; reset
    _S.QUARANTINED: frozenset({_S.SPARE, _S.IDLE}),                       # untainted: a spare again; reset
}


@dataclasses.dataclass
class Slot:
    index: int
    rank: int | None = None
    local_rank: int = 0
    state: SlotState = SlotState.IDLE
    proc: Any = None                      # procs.WorkerProcess
    managed: bool = False                 # said hello through tpassrun.init()
    writer: asyncio.StreamWriter | None = None
    inbox: asyncio.Queue[Message] = dataclasses.field(default_factory=asyncio.Queue)   # the worker's protocol Replies
    exit_code: int | None = None
    quarantine_reason: str | None = None
    home_rank: int | None = None          # the rank that left this slot because of a taint (migrate-back)
    release_after_exit: bool = False      # a migrate-back leaver: its slot is healthy, back to the pool
    started_at: float = 0.0
    reserved: int = 0                     # a spare: receive arena size it was told to pre-fault
    replicas: tuple[int, ...] | None = None   # the worker's declared replica group (protocol.Replicas)
    watch: asyncio.StreamWriter | None = None  # the worker's watch connection (protocol.Watch): Break goes there
    alone: str = ""                       # ... and why no other rank holds its state, if it is alone
    finished_pid: int | None = None       # the worker that said Done: its sess.run() returned

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state":
            value = SlotState(value)
            old = self.__dict__.get("state")
            if old is not None and value != old and value not in SLOT_TRANSITIONS[old]:
                log.warning("slot %s: illegal state transition %s -> %s", self.__dict__.get("index"), old.value,
                            value.value)
        object.__setattr__(self, name, value)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class LocalSlots:
    """Slot table + channel. ``open()`` does the I/O; the constructor does none."""

    def __init__(self, n_active: int, n_spares: int, *,
                 on_message: Callable[[Slot, Reply], None], on_nudge: Callable[[], None] | None = None) -> None:
        self.n_active = n_active
        self.n_spares = n_spares
        self.slots = [Slot(index=i, local_rank=i) for i in range(n_active + n_spares)]
        self._on_message = on_message
        self.on_nudge = on_nudge     # a worker wrote a light snapshot (a bare newline on its socket)
        self._dir: str | None = None
        self.channel: ChannelFile | None = None
        self.sock_path = ""
        self.channel_path = ""
        self._server: asyncio.base_events.Server | None = None

    async def open(self) -> "LocalSlots":
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        await asyncio.to_thread(reap_leftovers, shm)
        self._dir = tempfile.mkdtemp(prefix="tpr-", dir="/tmp")
        with open(os.path.join(self._dir, _OWNER_FILE), "w") as fh:
            fh.write(str(os.getpid()))
        self.channel_path = os.path.join(shm or self._dir, f"tpassrun-{os.getpid()}-{id(self):x}.chan")
        self.channel = ChannelFile.create(self.channel_path, len(self.slots))
        self.sock_path = os.path.join(self._dir, "agent.sock")
        self._server = await asyncio.start_unix_server(self._serve, path=self.sock_path)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)
            self._server = None
        for s in self.slots:
            for writer in (s.writer, s.watch):
                if writer is not None:
                    writer.close()
            s.writer = s.watch = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        with contextlib.suppress(OSError):
            os.unlink(self.channel_path)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    # --- socket ---
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        slot: Slot | None = None
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                if line == b"\n":
                    if self.on_nudge is not None:
                        self.on_nudge()
                    continue
                try:
                    msg, idx = decode_reply(line)
                except ProtocolError as exc:
                    log.warning("bad channel message: %s", exc)
                    continue
                if isinstance(msg, Watch):
                    # a worker's second connection: its watcher thread waits there for a Break
                    if slot is None and idx is not None and 0 <= idx < len(self.slots):
                        watched = self.slots[idx]
                        watched.watch = writer
                    continue
                if slot is None and idx is not None and 0 <= idx < len(self.slots):
                    slot = self.slots[idx]
                    slot.writer = writer
                if slot is None:
                    continue
                if isinstance(msg, Hello):
                    slot.managed = True
                if isinstance(msg, Replicas):     # a declaration, kept with the slot (no one awaits it)
                    slot.replicas, slot.alone = msg.ranks, msg.alone[:300]
                    continue
                slot.inbox.put_nowait(msg)
                self._on_message(slot, msg)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if slot is not None and slot.writer is writer:
                slot.writer = None
            for s in self.slots:
                if s.watch is writer:
                    s.watch = None
            writer.close()

    def send(self, slot: Slot, msg: Command) -> bool:
        """Send ``slot``'s worker a command (False if it is not connected)."""
        if slot.writer is None:
            return False
        try:
            slot.writer.write(encode(msg))
        except (ConnectionError, RuntimeError):
            return False
        assert self.channel is not None
        self.channel.set(slot.index, Field.CTL_SEQ, self.channel.get(slot.index, Field.CTL_SEQ) + 1)
        return True

    def break_collectives(self, slot: Slot, reason: str) -> bool:
        """Have ``slot``'s worker shut its process-group sockets down now (its watch connection; False if it has
        none): a collective it is blocked in with a lost node fails at once instead of at its timeout."""
        if slot.watch is None:
            return False
        try:
            slot.watch.write(encode(Break(reason=reason[:300])))
        except (ConnectionError, RuntimeError):
            return False
        return True

    async def expect(self, slot: Slot, kinds: tuple[type[Message], ...], timeout: float,
                     match: Callable[[Message], bool] | None = None) -> Any:
        """Next message of one of the types ``kinds`` from ``slot`` (others are dropped, and those ``match``
        refuses: a late reply to an earlier request), or None on timeout/exit."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if not slot.alive and slot.inbox.empty():
                return None
            try:
                msg = await asyncio.wait_for(slot.inbox.get(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                continue
            if isinstance(msg, kinds) and (match is None or match(msg)):
                return msg

    async def wait_ready(self, slot: Slot, timeout: float) -> bool:
        """Wait until ``slot``'s worker has said hello (a freshly started spare is still importing torch)."""
        deadline = time.monotonic() + timeout
        while not (slot.managed and slot.writer is not None):
            if not slot.alive or time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def drain(self, slot: Slot) -> None:
        while not slot.inbox.empty():
            slot.inbox.get_nowait()

    # --- shared memory ---
    def field(self, slot: Slot, f: Field) -> int:
        assert self.channel is not None
        return self.channel.get(slot.index, f)

    def set_run_until(self, slot: Slot, step: int) -> None:
        assert self.channel is not None
        self.channel.set(slot.index, Field.RUN_UNTIL, step)

    def phase(self, slot: Slot) -> WorkerPhase:
        try:
            return WorkerPhase(self.field(slot, Field.PHASE))
        except ValueError:
            return WorkerPhase.STARTING

    def position(self, slot: Slot) -> tuple[WorkerPhase, int]:
        """A worker's phase and step, read together (ChannelFile.position)."""
        assert self.channel is not None
        phase, step = self.channel.position(slot.index)
        try:
            return WorkerPhase(phase), step
        except ValueError:
            return WorkerPhase.STARTING, step

    def reset(self, slot: Slot) -> None:
        assert self.channel is not None
        self.channel.reset_slot(slot.index)
        slot.managed = False
        slot.replicas, slot.alone = None, ""
        slot.reserved = 0
        self.drain(slot)

    def release_all(self) -> None:
        for s in self.slots:
            self.set_run_until(s, INT64_MAX)

    # --- views ---
    def active(self) -> list[Slot]:
        return [s for s in self.slots if s.state == SlotState.RUNNING]

    def spares(self) -> list[Slot]:
        return [s for s in self.slots if s.state == SlotState.SPARE and s.alive]

    def by_rank(self, rank: int) -> Slot | None:
        for s in self.slots:
            if s.rank == rank and s.state in (SlotState.RUNNING, SlotState.DONE):
                return s
        return None

    def usable_for_start(self) -> list[Slot]:
        """Slots for a fresh generation: quarantined ones are skipped (health-aware restart)."""
        return [s for s in self.slots if s.state != SlotState.QUARANTINED]

    def table(self) -> tuple[WorkerRow, ...]:
        out = []
        for s in self.slots:
            step = self.field(s, Field.STEP) if self.channel is not None else 0
            last = self.field(s, Field.LAST_STEP_NS) if self.channel is not None else 0
            shard: dict[str, Any] = {}
            if self.channel is not None and s.state != SlotState.SPARE and self.field(s, Field.SHARD_TRACKED):
                shard["sharded"] = True
            if self.channel is not None and self.field(s, Field.SHARD_HELD) and s.state != SlotState.SPARE:
                pushed = self.field(s, Field.SHARD_PUSHED)
                shard |= {"shard_held": self.field(s, Field.SHARD_HELD), "shard_bytes": self.field(s, Field.SHARD_BYTES),
                         "shard_mirrored": pushed - 1 if pushed > 0 else None,
                         "shard_sent": self.field(s, Field.SHARD_SENT),
                         "shard_interval": self.field(s, Field.SHARD_INTERVAL)}
            out.append(WorkerRow(slot=s.index, rank=s.rank, local_rank=s.local_rank, pid=s.pid,
                                 state=str(getattr(s.state, "value", s.state)), step=step, managed=s.managed,
                                 spare=s.state == SlotState.SPARE, last_step_ms=round(last / 1e6, 3),
                                 total=self.field(s, Field.TOTAL) if self.channel is not None else 0,
                                 quarantine_reason=s.quarantine_reason, replicas=s.replicas, **shard))
        return tuple(out)


_OWNER_FILE = "owner.pid"


def reap_leftovers(shm: str | None, tmp: str = "/tmp") -> list[str]:
    """Remove what a SIGKILLed agent of this user left behind (its channel file in shared memory, its socket
    directory): the next agent on the machine cleans up. Only paths whose owning agent pid is gone."""
    import re

    removed: list[str] = []

    from tpassrun.rendezvous import pid_alive

    for directory, pattern in ((shm, re.compile(r"tpassrun-(\d+)-[0-9a-f]+\.chan$")), (tmp, re.compile(r"tpr-"))):
        if not directory:
            continue
        with contextlib.suppress(OSError):
            for name in os.listdir(directory):
                match = pattern.match(name)
                if match is None:
                    continue
                path = os.path.join(directory, name)
                try:
                    info = os.lstat(path)
                    if info.st_uid != os.getuid():
                        continue
                    if match.groups():
                        pid = int(match.group(1))
                    else:
                        with open(os.path.join(path, _OWNER_FILE)) as fh:
                            pid = int(fh.read().strip() or 0)
                except (OSError, ValueError):
                    continue
                if pid <= 0 or pid_alive(pid):
                    continue
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                removed.append(path)
    return removed
