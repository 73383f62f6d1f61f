"""The agent's side of the mirror (:mod:`tpassrun.mirror`): its store and server, its buddy, the light mirror.

One :class:`MirrorPlane` per agent, for the agent's life (``async with``): it draws or reads the run's mirror
key from etcd, serves this node's :class:`~tpassrun.mirror.MirrorStore` on the advertised address, and, in every
generation (:meth:`MirrorPlane.run`):

* follows the buddy ring (:func:`tpassrun.mirror.buddy_ring` over the generation's nodes that hold ranks): the
  buddy is where this node's copies go; it is re-planned whenever a swap or a restart changes the generation;
* mirrors the light snapshots its workers leave in shared memory (RNG, data position, step: the two buffers
  per slot of :mod:`tpassrun.channel`) to the buddy, in the background, for the workers that do not push them
  there themselves (:mod:`tpassrun.worker.light_mirror`: a worker does, once its own connection to the buddy is up,
  and says so in its slot; this copy is the backstop while it is not). Every few milliseconds it looks at
  the channel's sequence numbers (a memory read per slot, no syscall), and pushes only what changed since
  (normally two ~10 KB frames per rank per step: the commit-point seal and, if user code changed the state
  after it, the step-start snapshot), in one batch through one connection, from a thread. A healthy worker
  never waits for any of it, and nothing goes through etcd;
* answers its workers' ``mirror_info`` (where their own copies go, and the key) over their private socket.

A recovery reads the copies back with :meth:`MirrorPlane.held` (what this node holds for some ranks) and
:meth:`MirrorPlane.fetch_light` (one rank's frame from any node's mirror).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import zlib
from typing import TYPE_CHECKING, Any, Iterable

from tpassrun.channel import Field, MirrorInfo
from tpassrun.mirror import (
    DEFAULT_MAX_BYTES,
    MirrorClient,
    MirrorError,
    MirrorServer,
    MirrorStore,
    MirrorTarget,
    copies_of,
    ensure_mirror_key,
    ring_nodes,
)
from tpassrun.records import Keys, MirrorBuddy, MirrorPushFailed, MirrorPushRestored, emit, load, node_info

if TYPE_CHECKING:
    from tpassrun.channel import Slot
    from tpassrun.rendezvous import Generation
    from tpassrun.swapper.agentport import AgentPort

log = logging.getLogger(__name__)

LIGHT = "light"
PUSH_EVERY_S = 0.005          # how often the agent looks for new snapshots when no worker nudged it
RETRY_AFTER_S = 0.5           # a buddy that did not answer is tried again after this
_END = b"TPLE"                # a light frame ends with "TPLE" | u32 crc32 of everything before (tpassrun.transfer.light)


def light_frame_ok(data: bytes) -> bool:
    """Whether ``data`` is one complete light frame (its own crc32 trailer checks), without decoding it: the
    agent never imports torch. A frame read while the worker rewrote it fails this and is read again later."""
    return (len(data) >= 16 and data[:4] == b"TPL1" and data[-8:-4] == _END
            and zlib.crc32(memoryview(data)[:-8]) == int.from_bytes(data[-4:], "little"))


def generation_ring(gen: "Generation") -> tuple[str, ...]:
    """The buddy ring of a generation: its members in group-rank order, then the other nodes a swap gave
    ranks to (``assignments``), lost nodes left out. Every agent computes the same ring from the same record."""
    members = [m.node_id for m in sorted(gen.members, key=lambda m: m.group_rank)]
    holders = [str(a.get("node")) for a in (gen.assignments or {}).values() if isinstance(a, dict) and a.get("node")]
    return ring_nodes(members, holders, gen.lost)


class MirrorPlane:
    """Construct with the agent's port; ``async with`` starts the server (its port goes into the agent's
    ``NodeInfo`` before it registers); :meth:`run` in every generation."""

    def __init__(self, port: "AgentPort", run_id: str, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 encrypt: bool = False) -> None:
        self.port = port
        self.encrypt = encrypt          # --rdzv-conf encrypt=true: the server and every target seal their frames
        self.run_id = run_id
        self.store = MirrorStore(max_bytes)
        self.key = b""
        self.server: MirrorServer | None = None
        self.buddy: MirrorTarget | None = None
        self._buddy_gen: tuple[int, tuple[str, ...]] | None = None
        self._client: MirrorClient | None = None
        self._pushed: dict[int, dict[int, int]] = {}      # rank -> {step: crc32} pushed to the current buddy
        self._seen: dict[int, tuple[int, ...]] = {}       # slot -> the channel fields at the last look
        self._retry_at = 0.0
        self._said_down: str | None = None
        self.pushes = 0
        self.bytes_pushed = 0
        self._wake = asyncio.Event()
        self._known: dict[str, MirrorTarget] = {}   # node id -> its mirror, as registered (reach())

    @property
    def mirror_port(self) -> int:
        return self.server.port if self.server is not None else 0

    async def __aenter__(self) -> "MirrorPlane":
        rdzv = self.port.rdzv
        self.key = await ensure_mirror_key(rdzv.store, Keys(rdzv.key("")).mirror_key)
        self.server = MirrorServer(self.store, self.key, host=self.port.addr, run_id=self.run_id, encrypt=self.encrypt)
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            await self.server.close()
        self._close_client()

    def own_target(self) -> MirrorTarget:
        return MirrorTarget(self.port.node_id, self.port.addr, self.mirror_port, self.key, self.run_id,
                            self.port.epoch(), self.encrypt)

    # ------------------------------------------------------------------ where copies go
    async def target_of(self, node_id: str) -> MirrorTarget | None:
        """Any node's mirror (from its registration: its lease keeps it there while it lives)."""
        if node_id == self.port.node_id:
            return self.own_target()
        store = self.port.rdzv.store
        key = Keys(self.port.rdzv.key("")).node(node_id)
        doc, rev = await store.get_json(key)
        info = load(node_info, key, doc, rev) if doc is not None else None
        if info is None or not info.mirror_port:
            return None
        return MirrorTarget(node_id, info.addr, info.mirror_port, self.key, self.run_id,
                            self.port.epoch(), self.encrypt)

    async def _follow_ring(self) -> None:
        gen = self.port.generation()
        if gen is None:
            return
        ring = generation_ring(gen)
        if self._buddy_gen == (gen.number, ring):
            return
        buddy = copies_of(self.port.node_id, ring)
        target = await self.target_of(buddy) if buddy is not None else None
        self._buddy_gen = (gen.number, ring)
        if target != self.buddy:
            self.buddy = target
            self._close_client()
            self._pushed.clear()        # a new buddy gets everything current, not only what changes next
            self._seen.clear()
            emit(self.port.events, MirrorBuddy(buddy=buddy, ring=list(ring)))

    def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # ------------------------------------------------------------------ the light mirror
    async def run(self) -> None:
        """Every generation: follow the ring and mirror the light snapshots (cancelled with the generation)."""
        while True:
            try:
                await self._follow_ring()
                self._want_nudges(self.buddy is not None)
                if self.buddy is not None and time.monotonic() >= self._retry_at:
                    batch = self._changed_frames()
                    if batch:
                        await self._push(batch)
            except (MirrorError, OSError) as exc:
                self._retry_at = time.monotonic() + RETRY_AFTER_S
                if str(exc) != self._said_down:
                    self._said_down = str(exc)
                    log.warning("mirror: cannot copy light state to buddy %s: %s",
                                self.buddy.node if self.buddy else None, exc)
                    emit(self.port.events, MirrorPushFailed(buddy=self.buddy.node if self.buddy else None, error=str(exc)[:200]))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PUSH_EVERY_S)
            self._wake.clear()

    def _want_nudges(self, want: bool) -> None:
        """Workers nudge this agent after each light write only while there is a buddy to copy to (a job of one
        node has none): otherwise the nudge, a syscall per step, would buy nothing."""
        ch = self.port.slots.channel
        if ch is not None:
            for slot in self.port.slots.slots:
                if ch.get(slot.index, Field.WANT_NUDGE) != int(want):
                    ch.set(slot.index, Field.WANT_NUDGE, int(want))

    def nudge(self) -> None:
        """A worker just wrote a light snapshot (its seal, or a step's start): copy it now. What a death right
        after a step's collectives needs is that step's seal, and the node may go down a millisecond later."""
        self._wake.set()

    def _changed_frames(self) -> list[tuple[int, int, bytes, int]]:
        """(rank, step, frame, crc) for every snapshot not yet at the buddy, oldest first per rank."""
        ch = self.port.slots.channel
        if ch is None:
            return []
        out = []
        for slot in self.port.slots.slots:
            rank = slot.rank
            if rank is None or rank < 0 or slot.state != "running" or not slot.managed:
                continue
            # (LIGHT_WRITES: a seal rewritten in place, by a later backward of the same step, keeps its label)
            sig = (rank, ch.get(slot.index, Field.LIGHT_SEQ), ch.get(slot.index, Field.LIGHT_WRITES),
                   ch.get(slot.index, Field.LIGHT_STEP_0), ch.get(slot.index, Field.LIGHT_STEP_1),
                   ch.get(slot.index, Field.LIGHT_MIRRORED))
            if self._seen.get(slot.index) == sig:
                continue
            if sig[-1]:
                # the worker pushes its snapshots to the buddy itself, as it writes them (tpassrun/worker/light_mirror.py): a
                # copy from here would only cross the network again (and could land after a newer one)
                self._seen[slot.index] = sig
                continue
            frames = read_light_frames(ch, slot.index)
            if frames is None:
                continue                    # being written: the next look gets it
            pushed = self._pushed.setdefault(rank, {})
            for step, data in dict(frames).items():     # two frames for one step: the newer one wins
                crc = zlib.crc32(data)
                if pushed.get(step) != crc:
                    out.append((rank, step, data, crc))
            self._seen[slot.index] = sig
        return out

    async def _push(self, batch: list[tuple[int, int, bytes, int]]) -> None:
        target = self.buddy
        assert target is not None
        if self._client is None:
            self._client = target.client(timeout=5.0)
        client, epoch = self._client, self.port.epoch()

        def push() -> None:
            for rank, step, data, _crc in batch:
                client.put(rank, LIGHT, step, data, epoch=epoch)

        try:
            await asyncio.to_thread(push)
        except (MirrorError, OSError):
            self._seen.clear()              # look again once the buddy answers
            raise
        if self._said_down is not None:
            emit(self.port.events, MirrorPushRestored(buddy=target.node))
            self._said_down = None
        for rank, step, data, crc in batch:
            pushed = self._pushed.setdefault(rank, {})
            pushed[step] = crc
            for old in sorted(pushed)[:-4]:
                del pushed[old]
            self.pushes += 1
            self.bytes_pushed += len(data)

    # ------------------------------------------------------------------ workers
    async def answer_current(self, slot: "Slot") -> None:
        """:meth:`answer`, once the buddy follows the current generation's ring (a worker asks right after a
        re-formed world: its node's buddy may have changed with it)."""
        try:
            await self._follow_ring()
        except (MirrorError, OSError) as exc:
            log.debug("mirror: following the ring before answering slot %d: %s", slot.index, exc)
        self.answer(slot)

    def answer(self, slot: "Slot") -> None:
        """A worker's ``mirror_info``: where its copies go (this node's buddy, None without one) and this
        node's own mirror, with the key; over its private socket only."""
        self.port.slots.send(slot, MirrorInfo(buddy=self.buddy.to_json() if self.buddy else None,
                                              local=self.own_target().to_json()))

    # ------------------------------------------------------------------ recovery
    def held(self, ranks: Iterable[int], kind: str = LIGHT, min_epoch: int = 0) -> dict[int, tuple[int, ...]]:
        """The versions this node's store holds for each of ``ranks`` (copies of an epoch before ``min_epoch``,
        i.e. from before the last whole-group restart, do not count)."""
        out = {}
        for rank in ranks:
            item = self.store.get(rank, kind)
            if item is not None and item.epoch >= min_epoch:
                out[rank] = self.store.versions(rank, kind)
        return out

    def keep_lights(self, rank: int, frames: Iterable[tuple[int, bytes]]) -> None:
        """Keep a dead worker of this node's light frames ((step, frame), oldest first) in this node's own store,
        where :meth:`fetch_light` finds them for a plan replacing several dead ranks at once."""
        for step, data in frames:
            try:
                self.store.put(rank, LIGHT, step, data, epoch=self.port.epoch())
            except MirrorError as exc:
                log.warning("rank %d's light snapshot of step %d not kept in the mirror: %s", rank, step, exc)

    async def fetch_light(self, node_id: str, rank: int, step: int) -> bytes | None:
        """Rank ``rank``'s light frame for ``step`` from ``node_id``'s mirror (this node's own store without a
        connection); None if it is not there."""
        if node_id == self.port.node_id:
            item = self.store.get(rank, LIGHT, step)
            return item.data if item is not None else None
        target = await self.target_of(node_id)
        if target is None:
            return None

        def fetch() -> bytes | None:
            with target.client(timeout=10.0) as client:
                item = client.get(rank, LIGHT, step)
            return item.data if item is not None else None

        with contextlib.suppress(MirrorError, OSError):
            return await asyncio.to_thread(fetch)
        return None

    async def agent_gone(self, node_id: str) -> bool:
        """Whether ``node_id``'s agent process is certainly gone: its mirror port, served for the agent's whole
        life, refuses connections (the host answered, nobody listens). A frozen agent, a partition or a host
        that is down do not refuse: those wait for the lease, as they must."""
        return await self.reach(node_id) == "gone"

    async def reach(self, node_id: str, timeout: float = 1.0) -> str:
        """How ``node_id``'s agent answers a connection to its mirror port: "up", "gone" (refused: the host
        answered, nobody listens), "silent" (no answer within ``timeout``: cut off, down or frozen) or
        "unknown" (no address: this node, or its registration unreadable). Addresses are remembered, so a node
        cut off from etcd can still tell its peers silent."""
        target = self._known.get(node_id)
        if target is None and node_id != self.port.node_id:
            with contextlib.suppress(Exception):
                target = await asyncio.wait_for(self.target_of(node_id), timeout)
        if target is None:
            return "unknown"
        self._known[node_id] = target

        def knock() -> str:
            try:
                with socket.create_connection((target.addr, target.port), timeout=timeout):
                    return "up"
            except ConnectionRefusedError:
                return "gone"
            except OSError:
                return "silent"

        return await asyncio.to_thread(knock)

    def usage(self) -> dict[str, Any]:
        """What the mirror costs here, for status and the event log."""
        return {"held_bytes": self.store.nbytes, "max_bytes": self.store.max_bytes,
                "entries": len(self.store.usage()), "pushes": self.pushes, "bytes_pushed": self.bytes_pushed,
                "buddy": self.buddy.node if self.buddy else None}


def read_light_frames(ch: Any, slot: int) -> list[tuple[int, bytes]] | None:
    """Both light buffers of ``slot`` as (step, frame), oldest first, read consistently: each frame's own
    checksum holds and the channel's sequence and step labels did not move while it was read (None: a write
    was under way, look again)."""
    seq = ch.get(slot, Field.LIGHT_SEQ)
    found = []
    for previous in (True, False):
        step = ch.light_step(slot, previous)
        if step is None:
            continue
        data = ch.read_light(slot, previous)
        if data is None:
            continue
        if not light_frame_ok(data) or ch.light_step(slot, previous) != step:
            return None
        found.append((step, data))
    if ch.get(slot, Field.LIGHT_SEQ) != seq:
        return None
    return found


__all__ = ["LIGHT", "MirrorPlane", "generation_ring", "light_frame_ok", "read_light_frames"]
