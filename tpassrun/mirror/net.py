"""The mirror's network end: an authenticated asyncio :class:`MirrorServer` around a store, a blocking
:class:`MirrorClient` (see :mod:`tpassrun.mirror` for the API).

Every connection proves the per-run mirror key (:mod:`tpassrun.transfer.auth`'s handshake, purpose "mirror", the
run id as context) before the server reads a byte of request or allocates anything for it.

Wire, after the handshake, both directions (little endian)::

    head 24 B  b"TPMR" | u8 op | u8 status | u16 meta_len | u64 payload_len | u64 seq
    meta       meta_len B of UTF-8 JSON      payload   payload_len B      tag   32 B

ops: PUT {owner, kind, version, epoch} + payload -> {kept}; GET {owner, kind, version|null, epoch|null} ->
{version, epoch} + payload | NOT_FOUND; LIST {owner|null, kind|null} -> {entries, bytes, max_bytes};
DROP {owner|null, kind|null, below_epoch|null} -> {freed}; PUSH: a PUT with no answer (:class:`PushStream`).
Each meta is declared once, in :mod:`tpassrun.mirror.meta`.

``tag`` is the connection's HMAC-SHA256 (:class:`~tpassrun.transfer.auth.FrameMac`) over the direction, head, meta and
payload. A PUT whose head's status byte is :data:`PAYLOAD_GMAC` carries a cheaper one instead, when the server's
hello offered it (:data:`~tpassrun.transfer.auth.FLAG_GMAC`: every server of this version): the HMAC over the
direction, head and meta, then over the GMAC tag (:mod:`tpassrun.transfer.gmac`) of the payload under a one-time key
derived from that HMAC (the head's sequence number makes it unique within the connection, so nonce 0 is never
reused under it; :meth:`~tpassrun.transfer.auth.FrameMac.one_time_key`). One SHA-256 pass over a refresh's megabytes
cost about 0.5 ms of CPU on each end; GMAC about a tenth of that, still authenticated. The status byte 1 was an older
tpassrun's Poly1305 payload tag: refused in one line (a client of that version never sends it to a server of this
one, whose hello does not offer it).

A server whose run encrypts (``--rdzv-conf encrypt=true``) says so in its hello, and then every frame both ways
has its meta and payload sealed with AES-256-GCM instead of the tag (:mod:`tpassrun.mirror.seal`); it refuses a
request in clear.

A :class:`PushStream` is a one-way connection: after the handshake the server never writes to it again, so a
writer that is SIGKILLed right after handing a frame to its kernel still has it delivered (a socket closed with
unread data in its receive queue would be reset instead, and its unsent bytes dropped). A push the store refuses
(an older version, full) is dropped and counted; a malformed one ends the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import struct
from typing import Any, Sequence

from tpassrun.mirror import meta as M
from tpassrun.mirror.seal import PAYLOAD_AEAD, FrameSeal
from tpassrun.mirror.store import MirrorError, MirrorFull, MirrorStore
from tpassrun.transfer import (
    AEAD_TAG_LEN,
    FLAG_ENCRYPT,
    FLAG_GMAC,
    HANDSHAKE_DEADLINE_S,
    PROOF,
    TAG_LEN,
    AuthError,
    FrameMac,
    ListenerHandshake,
    PendingTable,
    Throttle,
    TransferAuth,
    aead_unavailable_reason,
    gmac,
    held_note,
    source_of,
)

log = logging.getLogger("tpassrun.mirror")

MAX_META = 1 << 16                  # a request's JSON; a LIST answer may be longer (see MAX_REPLY_META)
MAX_REPLY_META = 16 << 20
_CHUNK = 4 << 20                    # payloads stream in pieces of this size (MAC off the event loop above it)
_THREAD_MAC = 1 << 20
_THREAD_GMAC = 8 << 20              # GMAC runs at ~20 GB/s: below this, a thread hand-off costs more than the tag

_HEAD = struct.Struct("<4sBBHQQ")
_MAGIC = b"TPMR"
OP_PUT, OP_GET, OP_LIST, OP_DROP, OP_REPLY, OP_PUSH = 1, 2, 3, 4, 5, 6
OK, NOT_FOUND, REFUSED, BAD_REQUEST = 0, 1, 2, 3
_TO_SERVER, _TO_CLIENT = b"C", b"S"
PAYLOAD_GMAC = 3                    # a request head's status byte: the payload is under a GMAC tag (module doc)
_OLD_PAYLOAD_POLY1305 = 1           # an older tpassrun's Poly1305 payload tag: refused
_GMAC_LABEL = b"mirror-payload-gmac"


# ---------------------------------------------------------------------------------------------- framing
def _mac_of(base: FrameMac, direction: bytes, head: bytes, meta: bytes) -> FrameMac:
    mac = base.copy()
    mac.feed(direction)
    mac.feed(head)
    mac.feed(meta)
    return mac


def _payload_tag(mac: FrameMac, pieces: Sequence[Any]) -> bytes:
    """The tag of a :data:`PAYLOAD_GMAC` frame: ``mac`` (fed the direction, head and meta) over the GMAC
    tag of the payload ``pieces`` under a one-time key from ``mac`` (module doc). GIL released while it runs."""
    mac = mac.copy()
    mac.feed(gmac.tag(mac.one_time_key(_GMAC_LABEL), 0, list(pieces)))     # the key is this message's alone
    return mac.tag()


def _auth(key: bytes, run_id: str) -> TransferAuth:
    return TransferAuth(key, run_id, -1, purpose="mirror")


# ---------------------------------------------------------------------------------------------- server
class MirrorServer:
    """The agent's end: serves one :class:`MirrorStore` on ``host`` (the agent's advertised address only).

    ``async with`` (or :meth:`start` / :meth:`close`) does the I/O; the constructor does none. ``encrypt``: the
    run encrypts (every connection's frames sealed, :mod:`tpassrun.mirror.seal`)."""

    def __init__(self, store: MirrorStore, key: bytes, *, host: str, run_id: str = "", port: int = 0,
                 max_item_bytes: int | None = None, encrypt: bool = False) -> None:
        if encrypt and aead_unavailable_reason() is not None:
            raise MirrorError(f"this run encrypts its mirror traffic, but {aead_unavailable_reason()}")
        self.encrypt = encrypt
        self.store = store
        self.host = host
        self.port = port
        self.max_item_bytes = max_item_bytes or store.max_bytes
        self._auth = _auth(key, run_id)
        self._server: asyncio.base_events.Server | None = None
        # handshakes in progress, bounded per source and in all: a newcomer evicts the oldest (tpassrun/transfer/gate.py)
        self._handshaking: PendingTable[asyncio.Task[Any]] = PendingTable()
        self._conns: set[asyncio.Task[Any]] = set()
        self.strangers = 0                # connections dropped for not proving the key
        self._lines = Throttle()          # one warning line per source a minute, however many it sends
        self.puts = 0
        self.bytes_in = 0
        self.pushes_refused = 0           # one-way pushes the store did not keep (no one to tell)

    async def __aenter__(self) -> "MirrorServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> tuple[str, int]:
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=1 << 20)
        except OSError as exc:
            if self.host in ("0.0.0.0", "::"):
                raise
            # a name that does not resolve to an address of this machine (a misconfigured FQDN): as the handoff
            # does, listen on every interface; the key still guards every connection
            log.warning("cannot listen for the mirror on %s (%s); listening on every interface instead",
                        self.host, exc)
            self._server = await asyncio.start_server(self._serve, None, self.port, limit=1 << 20)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.host, self.port

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            await asyncio.wait(self._conns, timeout=2)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            base = await self._handshake(reader, writer)
            if base is not None:
                seals = (FrameSeal(base, _TO_SERVER), FrameSeal(base, _TO_CLIENT)) if self.encrypt else None
                await self._requests(reader, writer, base, seals)
        except (ConnectionError, asyncio.IncompleteReadError, MirrorError, OSError) as exc:
            log.debug("mirror connection ended: %s", exc)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> FrameMac | None:
        """The client's proof within :data:`~tpassrun.transfer.gate.HANDSHAKE_DEADLINE_S` of its connect (the whole
        proof, not each byte). Every connection's handshake is its own task; a flood of silent or dripping ones
        evicts the oldest of its source, never a newcomer, so a legitimate client always gets its turn."""
        task = asyncio.current_task()
        assert task is not None
        source = source_of(writer.get_extra_info("peername"))
        for victim in self._handshaking.admit(task, source, asyncio.get_running_loop().time()):
            self.strangers += 1
            victim.cancel()
        try:
            shake = ListenerHandshake(self._auth, FLAG_GMAC
                                      | (FLAG_ENCRYPT if self.encrypt else 0))
            writer.write(shake.hello())
            try:
                raw = await asyncio.wait_for(reader.readexactly(PROOF.size), HANDSHAKE_DEADLINE_S)
                writer.write(shake.accept(raw))
                await writer.drain()
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:      # connected and left without a word (a liveness probe): not a stranger
                    return None
                self._stranger(source, "it left mid-proof")
                return None
            except (AuthError, asyncio.TimeoutError) as exc:
                self._stranger(source, str(exc) if isinstance(exc, AuthError)
                               else f"no proof within {HANDSHAKE_DEADLINE_S:g} s")
                return None
            return shake.frame_mac()
        finally:
            self._handshaking.remove(task)

    def _stranger(self, source: str, why: str) -> None:
        self.strangers += 1
        held = self._lines.check(source)
        if held is not None:
            log.warning("mirror: dropped a connection from %s that did not prove the mirror key: %s%s", source, why,
                        held_note(held, self._lines.window))

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, base: FrameMac,
                        seals: tuple[FrameSeal, FrameSeal] | None = None) -> None:
        """``seals`` (the run encrypts): the requests' and the replies' :class:`FrameSeal`."""
        seq_in = seq_out = 0
        while True:
            try:
                head = await reader.readexactly(_HEAD.size)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    return      # the client closed between requests
                raise
            magic, op, flags, meta_len, payload_len, seq = _HEAD.unpack(head)
            if magic != _MAGIC or seq != seq_in or meta_len > MAX_META:
                raise MirrorError(f"bad mirror frame (magic {magic!r}, seq {seq}/{seq_in}, meta {meta_len} B)")
            seq_in += 1
            if seals is not None and flags != PAYLOAD_AEAD:
                raise MirrorError(f"a mirror request in clear (flags {flags}) on a connection of a run that encrypts")
            meta_raw = await reader.readexactly(meta_len + (AEAD_TAG_LEN if seals else 0))
            if seals is not None:
                meta_raw = seals[0].open_meta(head, meta_raw)
            mac = _mac_of(base, _TO_SERVER, head, meta_raw)
            reply: Any
            out: Sequence[bytes] = ()
            if op == OP_PUSH:
                status, reply = await self._put(reader, mac, meta_raw, payload_len, flags, head, seals)
                if isinstance(reply, M.Failed) and status == BAD_REQUEST:
                    raise MirrorError(f"bad mirror push: {reply.error}")
                if not (isinstance(reply, M.Stored) and reply.kept):
                    self.pushes_refused += 1
                    log.debug("mirror push not kept: %s",
                              reply.error if isinstance(reply, M.Failed) else "older than the versions held")
                continue                # one-way: never an answer (see PushStream)
            if op == OP_PUT:
                status, reply = await self._put(reader, mac, meta_raw, payload_len, flags, head, seals)
            else:
                if payload_len:
                    raise MirrorError(f"mirror op {op} carries no payload")
                if seals is not None:
                    seals[0].open_payload(head, await reader.readexactly(AEAD_TAG_LEN))
                elif not mac.verify(await reader.readexactly(TAG_LEN)):
                    raise MirrorError("mirror request MAC mismatch")
                try:
                    status, reply, out = self._answer(op, meta_raw)
                except MirrorError as exc:
                    status, reply = BAD_REQUEST, M.Failed(str(exc))
            await self._reply(writer, base, seq_out, status, reply, out, seals[1] if seals else None)
            seq_out += 1

    async def _put(self, reader: asyncio.StreamReader, mac: FrameMac, meta_raw: bytes,
                   payload_len: int, flags: int = 0, head: bytes = b"",
                   seals: tuple[FrameSeal, FrameSeal] | None = None) -> tuple[int, M.Stored | M.Failed]:
        fast = flags == PAYLOAD_GMAC
        tag_len = AEAD_TAG_LEN if seals else TAG_LEN
        try:
            if seals is None and flags == _OLD_PAYLOAD_POLY1305:
                raise MirrorError("a payload under an older tpassrun's Poly1305 tag, which this server no longer "
                                  "verifies: run one tpassrun version on every node")
            if seals is None and flags not in (0, PAYLOAD_GMAC):
                raise MirrorError(f"a payload MAC this server does not offer (flags {flags})")
            ref = M.read(M.CopyRef, meta_raw)
        except MirrorError as exc:
            await _discard(reader, payload_len + tag_len)
            return BAD_REQUEST, M.Failed(str(exc))
        owner, kind, version, epoch = ref.owner, ref.kind, ref.version, ref.epoch
        why = (f"a copy of {payload_len} bytes is over this store's item limit {self.max_item_bytes}"
               if payload_len > self.max_item_bytes else self.store.admit(owner, kind, version, epoch, payload_len))
        if why is not None:
            await _discard(reader, payload_len + tag_len)
            return REFUSED, M.Failed(why)
        self.store.reserved += payload_len
        try:
            if seals is not None:
                data = await self._open_payload(reader, seals[0], head, payload_len)
            else:
                data = await self._read_tagged(reader, mac, payload_len, fast)
        finally:
            self.store.reserved -= payload_len
        try:
            kept = self.store._commit(owner, kind, version, epoch, data)
        except MirrorFull as exc:
            return REFUSED, M.Failed(str(exc))
        self.puts += 1
        self.bytes_in += payload_len
        return OK, M.Stored(kept)

    async def _open_payload(self, reader: asyncio.StreamReader, seal: FrameSeal, head: bytes,
                            payload_len: int) -> bytes:
        """A sealed payload, read whole and decrypted (off the event loop when large)."""
        chunks = []
        left = payload_len + AEAD_TAG_LEN
        while left:
            piece = await reader.readexactly(min(left, _CHUNK))
            left -= len(piece)
            chunks.append(piece)
        sealed = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        if payload_len >= _THREAD_MAC:
            return await asyncio.to_thread(seal.open_payload, head, sealed)
        return seal.open_payload(head, sealed)

    async def _read_tagged(self, reader: asyncio.StreamReader, mac: FrameMac, payload_len: int,
                           fast: bool) -> bytes:
        """A payload in clear and its tag, verified (a MirrorError when it does not)."""
        chunks = []
        left = payload_len
        while left:
            piece = await reader.readexactly(min(left, _CHUNK))
            left -= len(piece)
            if fast:        # tagged whole below
                pass
            elif len(piece) >= _THREAD_MAC:
                await asyncio.to_thread(mac.feed, piece)   # hashlib drops the GIL: the loop keeps going
            else:
                mac.feed(piece)
            chunks.append(piece)
        tag = await reader.readexactly(TAG_LEN)
        if fast:
            want = (await asyncio.to_thread(_payload_tag, mac, chunks) if payload_len >= _THREAD_GMAC
                    else _payload_tag(mac, chunks))
            ok = hmac.compare_digest(tag, want)
        else:
            ok = mac.verify(tag)
        if not ok:
            raise MirrorError("mirror put MAC mismatch: nothing kept")
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _answer(self, op: int, meta_raw: bytes) -> tuple[int, Any, Sequence[bytes]]:
        if op == OP_GET:
            get = M.read(M.Get, meta_raw)
            item = self.store.get(get.owner, get.kind, get.version, get.epoch)
            if item is None:
                return NOT_FOUND, M.NotFound(), ()
            return OK, M.Got(item.version, item.epoch), (item.data,)
        if op == OP_LIST:
            select = M.read(M.Select, meta_raw)
            return OK, M.Listing(tuple(self.store.usage(select.owner, select.kind)), self.store.nbytes,
                                 self.store.max_bytes), ()
        if op == OP_DROP:
            drop = M.read(M.Drop, meta_raw)
            return OK, M.Dropped(self.store.drop(drop.owner, drop.kind, drop.below_epoch)), ()
        raise MirrorError(f"unknown mirror op {op}")

    async def _reply(self, writer: asyncio.StreamWriter, base: FrameMac, seq: int, status: int,
                     meta: Any, payload: Sequence[bytes], seal: FrameSeal | None = None) -> None:
        meta_raw = M.encode(meta)
        head = _HEAD.pack(_MAGIC, OP_REPLY, status, min(len(meta_raw), 0xFFFF), sum(len(p) for p in payload), seq)
        # meta_len is u16: a long LIST answer carries its meta length in the payload's place instead
        if len(meta_raw) >= 0xFFFF:
            head = _HEAD.pack(_MAGIC, OP_REPLY, status, 0xFFFF, len(meta_raw), seq)
            payload, meta_raw = (meta_raw,), b""
        if seal is not None:
            sealed = (await asyncio.to_thread(seal.seal, head, meta_raw, payload)
                      if sum(len(p) for p in payload) >= _THREAD_MAC else seal.seal(head, meta_raw, payload))
            writer.writelines(sealed)
            await writer.drain()
            return
        mac = _mac_of(base, _TO_CLIENT, head, meta_raw)
        writer.write(head + meta_raw)
        for piece in payload:
            if len(piece) >= _THREAD_MAC:
                await asyncio.to_thread(mac.feed, piece)
            else:
                mac.feed(piece)
            writer.write(piece)
            await writer.drain()
        writer.write(mac.tag())
        await writer.drain()


async def _discard(reader: asyncio.StreamReader, n: int) -> None:
    while n > 0:
        n -= len(await reader.readexactly(min(n, _CHUNK)))


__all__ = ["BAD_REQUEST", "MirrorServer", "NOT_FOUND", "OK", "PAYLOAD_GMAC", "REFUSED"]
