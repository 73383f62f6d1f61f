"""The shared-memory file of the agent <-> worker channel: one fixed slot per local worker slot (the fields and the
phases a worker reports), and the double-buffered light area of each slot (see :mod:`tpassrun.channel`)."""

from __future__ import annotations

import enum
import mmap
import os
import struct

INT64_MAX = (1 << 63) - 1

SLOT_FIELDS = 32                  # 0-29 used; room to grow
SLOT_BYTES = SLOT_FIELDS * 8
LIGHT_BYTES = 256 * 1024          # per buffer; two buffers per slot
_LIGHT_HEADER = struct.Struct("<q")  # payload length


class Field(enum.IntEnum):
    RUN_UNTIL = 0      # agent: pause before executing any step >= this
    CTL_SEQ = 1        # agent: bumped whenever a socket message is waiting
    STEP = 2           # worker: the step being executed, or about to be
    PHASE = 3          # worker: WorkerPhase
    HEARTBEAT_NS = 4   # worker: time.monotonic_ns() at the last step start (CLOCK_MONOTONIC is system-wide)
    PID = 5            # worker
    LAST_STEP_NS = 6   # worker: duration of the last completed step
    LIGHT_SEQ = 7      # worker: number of light snapshots written; the newest is in buffer LIGHT_SEQ % 2
    LAST_COMPUTE_NS = 8  # worker: last step's time from its start to its first gradient (before any collective)
    STATE_BYTES = 9    # worker: bytes of its tracked state, once known (after its first step): spares pre-fault as much
    COMMITTED = 10     # worker: 1 + the last step that reached its commit point (a tracked optimizer's step)
    LIGHT_STEP_0 = 11  # worker: the step light buffer 0 resumes at (-1 while being written)
    LIGHT_STEP_1 = 12  # worker: the same for light buffer 1
    # sharded state (``sess.track_sharded``, tpassrun/worker/shards.py); versions are 1 + the step, 0 = none
    SHARD_V0 = 13      # worker: a step whose local pre-step copy is complete (oldest first; three at most)
    SHARD_V1 = 14      # worker: the next one
    SHARD_HELD = 15    # worker: host bytes its local copies hold
    SHARD_BYTES = 16   # worker: bytes of one mirrored version (what a refresh sends)
    SHARD_PUSHED = 17  # worker: 1 + the newest step its buddy's mirror holds complete
    SHARD_SENT = 18    # worker: total bytes pushed to the mirror
    SHARD_V2 = 19      # worker: the newest local copy (SHARD_V0/V1/V2)
    OFFER = 22         # worker, set before it parks (PAUSED/FAILED): 1 + the step it can resume at exactly, 0: none
    LIGHT_MIRRORED = 21  # worker: 1 while it pushes its light snapshots to the buddy's mirror itself
                         # (tpassrun/worker/light_mirror.py)
    LIGHT_WRITES = 20  # worker: light snapshots written or rewritten in place (LIGHT_SEQ counts new ones only)
    WANT_NUDGE = 23    # agent: 1 while it copies light snapshots to a buddy (the worker then nudges it per write)
    # worker, set with OFFER (a mixed commit, tpassrun/plan/catchup.py): 1 + the start of the transaction before the one it
    # offers, which it can go back to given a peer's replicated state of that step (it kept its own per-rank state
    # of it), 0: none
    ALT_BACK = 24
    SHARD_INTERVAL = 25  # worker: the refresh interval K of its sharded state once fixed
                         # (tpassrun/settings/shard_interval.py), 0: not yet
    RUN_FROM = 26      # worker: 1 + the step its run() started at (a restarted script's resume point), 0: not yet
    TOTAL = 27         # worker: the total_steps its run() was given (progress and ETA), 0: not known
    VERDICT = 28       # agent: its answer to a worker parked PENDING (Verdict); the worker clears it before it parks
    SHARD_TRACKED = 29  # worker: 1 from ``sess.track_sharded`` on, before any copy: its agent and the planner count
                        # it as a rank with sharded state from then on (a death inside step 0 included)


# RUN_UNTIL: pause before any step >= this one, at the end of an open gradient-accumulation window (a boundary
# inside one would drop the leaver's accumulated gradients); STOP_NOW pauses at the next step start whatever the
# window (an unplanned recovery rolls the window back anyway).
STOP_NOW = -1


class WorkerPhase(enum.IntEnum):
    STARTING = 0
    RUNNING = 1        # executing step STEP
    PAUSED = 2         # stopped before executing step STEP, waiting for a command
    RECONFIGURING = 3
    SPARE = 4          # a warm spare blocked in tpassrun.init()
    DONE = 5           # left the step loop normally
    FAILED = 6         # step STEP raised (e.g. a peer died in a collective); waiting for a command
    TRANSFERRING = 7
    RAISED = 8         # step STEP raised an ordinary exception (a user error): the worker is exiting
    PAUSING = 9        # between two steps, parking before step STEP: neither running it nor paused yet (a
    #                    transient: without it the step number of the next step would show as "running" for a
    #                    moment, and an agent waiting at a boundary would move the boundary past it)
    PENDING = 10       # step STEP raised an exception the worker cannot prove distributed: its collectives still
    #                    open, it waits for the agent's Verdict (a peer's casualty: FAILED; its own error: RAISED)


class Verdict(enum.IntEnum):
    """The agent's answer in VERDICT to a worker parked PENDING (:func:`tpassrun.plan.failkind.cause_of`)."""

    NONE = 0
    CASUALTY = 1       # a peer of its world failed first: park FAILED, wait for the recovery
    ROOT_CAUSE = 2     # nothing failed around it: re-raise (RAISED), torchrun's path


class ChannelFile:
    """The shared-memory file. The agent creates it; workers open it by path."""

    def __init__(self, path: str, n_slots: int) -> None:
        self.path = path
        self.n_slots = n_slots
        self._mm: mmap.mmap | None = None
        self._ints: memoryview | None = None

    @staticmethod
    def size_for(n_slots: int) -> int:
        return n_slots * (SLOT_BYTES + 2 * LIGHT_BYTES)

    @classmethod
    def create(cls, path: str, n_slots: int) -> "ChannelFile":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, cls.size_for(n_slots))
            ch = cls(path, n_slots)
            ch._map(fd)
        finally:
            os.close(fd)
        for slot in range(n_slots):
            ch.set(slot, Field.RUN_UNTIL, INT64_MAX)
        return ch

    @classmethod
    def open(cls, path: str) -> "ChannelFile":
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            per_slot = SLOT_BYTES + 2 * LIGHT_BYTES
            ch = cls(path, size // per_slot)
            ch._map(fd)
        finally:
            os.close(fd)
        return ch

    def _map(self, fd: int) -> None:
        self._mm = mmap.mmap(fd, self.size_for(self.n_slots))
        # The int64 header of every slot is at the start of the file, contiguous, so one cast covers them.
        self._ints = memoryview(self._mm)[: self.n_slots * SLOT_BYTES].cast("q")

    def close(self) -> None:
        if self._ints is not None:
            self._ints.release()
            self._ints = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    # --- the int64 fields ---
    def get(self, slot: int, field: Field) -> int:
        return self._ints[slot * SLOT_FIELDS + field]  # type: ignore[index]

    def set(self, slot: int, field: Field, value: int) -> None:
        self._ints[slot * SLOT_FIELDS + field] = value  # type: ignore[index]

    def position(self, slot: int) -> tuple[int, int]:
        """(PHASE, STEP) as one reading. The worker writes them one after the other; STEP read on both sides of
        PHASE, and equal, means the step did not move in between (else a reading could pair the phase of one step
        with the number of the next)."""
        while True:
            step = self.get(slot, Field.STEP)
            phase = self.get(slot, Field.PHASE)
            if self.get(slot, Field.STEP) == step:
                return phase, step

    def snapshot(self, slot: int) -> dict[str, int]:
        return {f.name.lower(): self.get(slot, f) for f in Field}

    # --- light-state buffers ---
    def _light_offset(self, slot: int, buf: int) -> int:
        return self.n_slots * SLOT_BYTES + (slot * 2 + buf) * LIGHT_BYTES

    def write_light(self, slot: int, payload: bytes, step: int = -1) -> bool:
        """Write a light snapshot into the buffer not holding the newest one, then publish it.

        A worker killed half-way through leaves the previous snapshot intact, because LIGHT_SEQ moves only
        after the bytes are in place. Returns False if the payload does not fit (it is then not kept).
        """
        if len(payload) + _LIGHT_HEADER.size > LIGHT_BYTES:
            return False
        seq = self.get(slot, Field.LIGHT_SEQ)
        buf = (seq + 1) % 2
        off = self._light_offset(slot, buf)
        mm = self._mm
        assert mm is not None
        step_field = Field.LIGHT_STEP_1 if buf else Field.LIGHT_STEP_0
        self.set(slot, step_field, -1)
        _LIGHT_HEADER.pack_into(mm, off, len(payload))
        mm[off + _LIGHT_HEADER.size: off + _LIGHT_HEADER.size + len(payload)] = payload
        self.set(slot, step_field, step)
        self.set(slot, Field.LIGHT_SEQ, seq + 1)
        self.set(slot, Field.LIGHT_WRITES, self.get(slot, Field.LIGHT_WRITES) + 1)
        return True

    def rewrite_light(self, slot: int, payload: bytes, step: int) -> bool:
        """Replace the newest light snapshot in place (the previous one stays). While the bytes are written its
        step reads -1, so a worker killed half-way leaves a buffer nobody uses, never a torn one that looks whole."""
        seq = self.get(slot, Field.LIGHT_SEQ)
        if seq <= 0:
            return self.write_light(slot, payload, step)
        if len(payload) + _LIGHT_HEADER.size > LIGHT_BYTES:
            return False
        off = self._light_offset(slot, seq % 2)
        mm = self._mm
        assert mm is not None
        step_field = Field.LIGHT_STEP_1 if seq % 2 else Field.LIGHT_STEP_0
        self.set(slot, step_field, -1)
        _LIGHT_HEADER.pack_into(mm, off, len(payload))
        mm[off + _LIGHT_HEADER.size: off + _LIGHT_HEADER.size + len(payload)] = payload
        self.set(slot, step_field, step)
        self.set(slot, Field.LIGHT_WRITES, self.get(slot, Field.LIGHT_WRITES) + 1)
        return True

    def read_light(self, slot: int, previous: bool = False) -> bytes | None:
        """The newest light snapshot of ``slot`` (or, ``previous``, the one before it), None if there is none."""
        seq = self.get(slot, Field.LIGHT_SEQ) - (1 if previous else 0)
        if seq <= 0:
            return None
        off = self._light_offset(slot, seq % 2)
        mm = self._mm
        assert mm is not None
        (n,) = _LIGHT_HEADER.unpack_from(mm, off)
        if n < 0 or n > LIGHT_BYTES - _LIGHT_HEADER.size:
            return None
        return bytes(mm[off + _LIGHT_HEADER.size: off + _LIGHT_HEADER.size + n])

    def light_step(self, slot: int, previous: bool = False) -> int | None:
        """The step the newest (``previous``: the older) light snapshot was taken for; None if none or torn."""
        seq = self.get(slot, Field.LIGHT_SEQ) - (1 if previous else 0)
        if seq <= 0:
            return None
        step = self.get(slot, Field.LIGHT_STEP_1 if seq % 2 else Field.LIGHT_STEP_0)
        return None if step < 0 else step

    def copy_light(self, src: int, dst: int) -> bool:
        data = self.read_light(src)
        step = self.light_step(src)
        return data is not None and self.write_light(dst, data, -1 if step is None else step)

    def reset_slot(self, slot: int) -> None:
        for f in Field:
            self.set(slot, f, 0)
        self.set(slot, Field.RUN_UNTIL, INT64_MAX)
