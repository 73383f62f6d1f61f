"""The mirror data plane: redundant copies of per-rank state in another node's host memory.

Every agent runs a :class:`MirrorServer` around one in-memory :class:`MirrorStore`. Other processes of the job
(agents mirroring their workers' light snapshots, workers mirroring their shards from a background thread) put
copies into the store of their *buddy* node (:func:`buddy_ring`) with a :class:`MirrorClient`; when a node
dies, the copies of its ranks are still in its buddy's memory and a recovery reads them back. Nothing here
goes through etcd, and nothing is on a training step's path: a copy is pushed after the fact, by whoever
holds it.

API (what the agent and the shard mirror code against)::

    store = MirrorStore(max_bytes=1 << 30)
    store.put(owner=3, kind="light", version=41, payload=b"...", epoch=2)  # -> True if kept
    store.get(3, "light")                 # newest: MirrorItem(owner, kind, version, epoch, data) or None
    store.get(3, "light", version=40)     # that version, or None
    store.versions(3, "light")            # (40, 41): newest two complete versions, ascending
    store.usage()                         # [MirrorEntry(owner, kind, epoch, versions, nbytes), ...]
    store.bytes_held(owner=3)             # what it costs

    async with MirrorServer(store, key, host=advertised_addr, run_id=run_id) as server:   # the agent
        server.port                       # published in the agent's NodeInfo (``mirror_port``)

    with MirrorClient(addr, port, key, run_id=run_id) as client:        # blocking: a thread, or to_thread
        client.put(3, "light", 41, payload, epoch=2)                    # payload: bytes-like, or a list of
        client.get(3, "light", version=None)                            #   them (sent without joining)
        client.versions(3, "light"); client.list(); client.drop(owner=3)

* **owner** is an int, the rank's global rank (stable across swaps: a joiner takes the dead rank's number);
  **kind** a short string (``"light"``, ``"shard/<name>"``); **version** an int, normally the step the copy
  is for; **epoch** the generation that spawned the writer (a whole-group restart starts a new epoch: a copy
  from before it is never taken for one after it; a put with a newer epoch drops the older epoch's copies of
  that (owner, kind), one with an older epoch is refused).
* A store keeps the newest two *complete* versions of each (owner, kind): a put is visible only once all its
  bytes arrived and its MAC verified, so a writer dying mid-put leaves the previous versions intact. A put of
  a version already held replaces it; one older than both held versions is not kept (``put`` returns False).
* Memory is bounded (``max_bytes``): copies of older epochs are evicted first; then a put that does not fit
  is refused (:class:`MirrorFull` on the client), never half-kept.

Security: the server listens on the agent's advertised address only. Every connection proves the per-run
mirror key (:mod:`tpassrun.wireauth`'s HMAC handshake, purpose "mirror", the run id as context) before the
server reads a byte of request or allocates anything for it; every frame after that carries an HMAC-SHA256 tag
over its direction, sequence number, header, meta and payload; sizes are checked before allocation. The key
is drawn once per run and kept in the run's authenticated etcd (:func:`ensure_mirror_key`), never on a command
line or in a file; workers get it over their private agent socket.

Wire, after the handshake, both directions (little endian)::

    head 24 B  b"TPMR" | u8 op | u8 status | u16 meta_len | u64 payload_len | u64 seq
    meta       meta_len B of UTF-8 JSON      payload   payload_len B      tag   32 B

ops: PUT {owner, kind, version, epoch} + payload -> {kept}; GET {owner, kind, version|null, epoch|null} ->
{version, epoch} + payload | NOT_FOUND; LIST {owner|null, kind|null} -> {entries, bytes, max_bytes};
DROP {owner|null, kind|null, below_epoch|null} -> {freed}.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .wireauth import ACCEPT, HELLO, PROOF, TAG_LEN, AuthError, ConnectorHandshake, FrameMac, HandoffError, \
    ListenerHandshake, TransferAuth

log = logging.getLogger("tpassrun.mirror")

DEFAULT_MAX_BYTES = 1 << 30
MAX_META = 1 << 16                  # a request's JSON; a LIST answer may be longer (see MAX_REPLY_META)
MAX_REPLY_META = 16 << 20
HANDSHAKE_TIMEOUT_S = 10.0
MAX_UNAUTHENTICATED = 64            # connections still in their handshake; more are closed at once
_CHUNK = 4 << 20                    # payloads stream in pieces of this size (MAC off the event loop above it)
_THREAD_MAC = 1 << 20

_HEAD = struct.Struct("<4sBBHQQ")
_MAGIC = b"TPMR"
OP_PUT, OP_GET, OP_LIST, OP_DROP, OP_REPLY = 1, 2, 3, 4, 5
OK, NOT_FOUND, REFUSED, BAD_REQUEST = 0, 1, 2, 3
_TO_SERVER, _TO_CLIENT = b"C", b"S"


class MirrorError(HandoffError):
    """A mirror request failed (connection lost, refused, malformed)."""


class MirrorFull(MirrorError):
    """The store refused a put: it would exceed its memory bound, or its epoch is stale."""


@dataclass(frozen=True)
class MirrorItem:
    owner: int
    kind: str
    version: int
    epoch: int
    data: bytes


@dataclass(frozen=True)
class MirrorEntry:
    """What a store holds for one (owner, kind): its epoch, complete versions (ascending) and bytes."""

    owner: int
    kind: str
    epoch: int
    versions: tuple[int, ...]
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"owner": self.owner, "kind": self.kind, "epoch": self.epoch, "versions": list(self.versions),
                "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: Any) -> "MirrorEntry":
        try:
            return cls(int(d["owner"]), str(d["kind"]), int(d["epoch"]), tuple(int(v) for v in d["versions"]),
                       int(d["nbytes"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise MirrorError(f"malformed mirror listing row {d!r}") from exc


# ---------------------------------------------------------------------------------------------- the store
class _Held:
    __slots__ = ("epoch", "versions")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.versions: dict[int, bytes] = {}

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.versions.values())


class MirrorStore:
    """In-memory copies keyed by (owner, kind): newest two complete versions each, ``max_bytes`` in all.

    Not thread-safe: the agent uses it from its event loop only (the server runs there too)."""

    KEEP = 2

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._held: dict[tuple[int, str], _Held] = {}
        self._bytes = 0
        self.reserved = 0                 # bytes of puts still arriving (counted against max_bytes)

    @property
    def nbytes(self) -> int:
        return self._bytes

    # --- admission -------------------------------------------------------------------------------------
    def _freed_by(self, owner: int, kind: str, version: int, epoch: int) -> int:
        held = self._held.get((owner, kind))
        if held is None:
            return 0
        if epoch > held.epoch:
            return held.nbytes
        if version in held.versions:
            return len(held.versions[version])
        if len(held.versions) >= self.KEEP and version > min(held.versions):
            return len(held.versions[min(held.versions)])
        return 0

    def admit(self, owner: int, kind: str, version: int, epoch: int, nbytes: int) -> str | None:
        """Make room for a put of ``nbytes`` (evicting older epochs' copies); None if it fits, else why not."""
        held = self._held.get((owner, kind))
        if held is not None and epoch < held.epoch:
            return f"stale epoch {epoch} for rank {owner}/{kind} (the store holds epoch {held.epoch})"
        need = nbytes - self._freed_by(owner, kind, version, epoch)
        if self._bytes + self.reserved + need <= self.max_bytes:
            return None
        newest = max((h.epoch for h in self._held.values()), default=epoch)
        for key in [k for k, h in self._held.items() if h.epoch < max(newest, epoch) and k != (owner, kind)]:
            self._drop(key)
            if self._bytes + self.reserved + need <= self.max_bytes:
                return None
        return (f"a copy of {nbytes} bytes for rank {owner}/{kind} does not fit: {self._bytes} held, "
                f"{self.reserved} arriving, limit {self.max_bytes}")

    # --- the operations --------------------------------------------------------------------------------
    def put(self, owner: int, kind: str, version: int, payload: bytes | bytearray | memoryview,
            epoch: int = 0) -> bool:
        """Keep a complete copy; True if kept (False: older than both versions held). Raises MirrorFull."""
        data = payload if isinstance(payload, bytes) else bytes(payload)
        why = self.admit(owner, kind, version, epoch, len(data))
        if why is not None:
            raise MirrorFull(why)
        return self._commit(owner, kind, version, epoch, data)

    def _commit(self, owner: int, kind: str, version: int, epoch: int, data: bytes) -> bool:
        key = (owner, kind)
        held = self._held.get(key)
        if held is None or epoch > held.epoch:
            if held is not None:
                self._drop(key)
            held = self._held[key] = _Held(epoch)
        elif epoch < held.epoch:
            raise MirrorFull(f"stale epoch {epoch} for rank {owner}/{kind} (the store holds epoch {held.epoch})")
        if version not in held.versions and len(held.versions) >= self.KEEP and version < min(held.versions):
            return False
        old = held.versions.pop(version, None)
        if old is not None:
            self._bytes -= len(old)
        held.versions[version] = data
        self._bytes += len(data)
        while len(held.versions) > self.KEEP:
            gone = held.versions.pop(min(held.versions))
            self._bytes -= len(gone)
        return True

    def get(self, owner: int, kind: str, version: int | None = None, epoch: int | None = None) -> MirrorItem | None:
        held = self._held.get((owner, kind))
        if held is None or not held.versions or (epoch is not None and held.epoch != epoch):
            return None
        v = max(held.versions) if version is None else version
        data = held.versions.get(v)
        return None if data is None else MirrorItem(owner, kind, v, held.epoch, data)

    def versions(self, owner: int, kind: str, epoch: int | None = None) -> tuple[int, ...]:
        held = self._held.get((owner, kind))
        if held is None or (epoch is not None and held.epoch != epoch):
            return ()
        return tuple(sorted(held.versions))

    def usage(self, owner: int | None = None, kind: str | None = None) -> list[MirrorEntry]:
        return [MirrorEntry(o, k, h.epoch, tuple(sorted(h.versions)), h.nbytes)
                for (o, k), h in sorted(self._held.items())
                if (owner is None or o == owner) and (kind is None or k == kind)]

    def bytes_held(self, owner: int | None = None, kind: str | None = None) -> int:
        return sum(e.nbytes for e in self.usage(owner, kind))

    def drop(self, owner: int | None = None, kind: str | None = None, below_epoch: int | None = None) -> int:
        """Forget matching copies (``below_epoch``: only those of older epochs); returns the bytes freed."""
        before = self._bytes
        for key in [k for k, h in self._held.items() if (owner is None or k[0] == owner)
                    and (kind is None or k[1] == kind) and (below_epoch is None or h.epoch < below_epoch)]:
            self._drop(key)
        return before - self._bytes

    def _drop(self, key: tuple[int, str]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= held.nbytes


# ---------------------------------------------------------------------------------------------- framing
def _mac_of(base: FrameMac, direction: bytes, head: bytes, meta: bytes) -> FrameMac:
    mac = base.copy()
    mac.feed(direction)
    mac.feed(head)
    mac.feed(meta)
    return mac


def _encode_meta(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def _decode_meta(raw: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise MirrorError(f"malformed mirror frame meta: {exc}") from exc
    if not isinstance(doc, dict):
        raise MirrorError("malformed mirror frame meta: not a JSON object")
    return doc


def _int_field(meta: dict[str, Any], name: str, optional: bool = False) -> int | None:
    value = meta.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise MirrorError(f"mirror request: {name} must be an integer, not {value!r}")
    return value


def _str_field(meta: dict[str, Any], name: str, optional: bool = False) -> str | None:
    value = meta.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > 256:
        raise MirrorError(f"mirror request: {name} must be a short string, not {value!r}")
    return value


def _auth(key: bytes, run_id: str) -> TransferAuth:
    return TransferAuth(key, run_id, -1, purpose="mirror")


# ---------------------------------------------------------------------------------------------- server
class MirrorServer:
    """The agent's end: serves one :class:`MirrorStore` on ``host`` (the agent's advertised address only).

    ``async with`` (or :meth:`start` / :meth:`close`) does the I/O; the constructor does none."""

    def __init__(self, store: MirrorStore, key: bytes, *, host: str, run_id: str = "", port: int = 0,
                 max_item_bytes: int | None = None) -> None:
        self.store = store
        self.host = host
        self.port = port
        self.max_item_bytes = max_item_bytes or store.max_bytes
        self._auth = _auth(key, run_id)
        self._server: asyncio.base_events.Server | None = None
        self._handshaking = 0
        self._conns: set[asyncio.Task[Any]] = set()
        self.strangers = 0                # connections dropped for not proving the key
        self.puts = 0
        self.bytes_in = 0

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
                await self._requests(reader, writer, base)
        except (ConnectionError, asyncio.IncompleteReadError, MirrorError, OSError) as exc:
            log.debug("mirror connection ended: %s", exc)
        except asyncio.CancelledError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> FrameMac | None:
        if self._handshaking >= MAX_UNAUTHENTICATED:
            self.strangers += 1
            return None
        self._handshaking += 1
        try:
            shake = ListenerHandshake(self._auth)
            writer.write(shake.hello())
            try:
                raw = await asyncio.wait_for(reader.readexactly(PROOF.size), HANDSHAKE_TIMEOUT_S)
                writer.write(shake.accept(raw))
                await writer.drain()
            except (AuthError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                self.strangers += 1
                log.warning("mirror: dropped a connection that did not prove the mirror key: %s",
                            type(exc).__name__ if not isinstance(exc, AuthError) else exc)
                return None
            return shake.frame_mac()
        finally:
            self._handshaking -= 1

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, base: FrameMac) -> None:
        seq_in = seq_out = 0
        while True:
            try:
                head = await reader.readexactly(_HEAD.size)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    return      # the client closed between requests
                raise
            magic, op, _status, meta_len, payload_len, seq = _HEAD.unpack(head)
            if magic != _MAGIC or seq != seq_in or meta_len > MAX_META:
                raise MirrorError(f"bad mirror frame (magic {magic!r}, seq {seq}/{seq_in}, meta {meta_len} B)")
            seq_in += 1
            meta_raw = await reader.readexactly(meta_len)
            mac = _mac_of(base, _TO_SERVER, head, meta_raw)
            status, reply, out = OK, {}, ()
            if op == OP_PUT:
                status, reply = await self._put(reader, mac, meta_raw, payload_len)
            else:
                if payload_len:
                    raise MirrorError(f"mirror op {op} carries no payload")
                if not mac.verify(await reader.readexactly(TAG_LEN)):
                    raise MirrorError("mirror request MAC mismatch")
                try:
                    status, reply, out = self._answer(op, _decode_meta(meta_raw))
                except MirrorError as exc:
                    status, reply = BAD_REQUEST, {"error": str(exc)}
            await self._reply(writer, base, seq_out, status, reply, out)
            seq_out += 1

    async def _put(self, reader: asyncio.StreamReader, mac: FrameMac, meta_raw: bytes,
                   payload_len: int) -> tuple[int, dict[str, Any]]:
        try:
            meta = _decode_meta(meta_raw)
            owner, kind = _int_field(meta, "owner"), _str_field(meta, "kind")
            version, epoch = _int_field(meta, "version"), _int_field(meta, "epoch")
        except MirrorError as exc:
            await _discard(reader, payload_len + TAG_LEN)
            return BAD_REQUEST, {"error": str(exc)}
        assert owner is not None and kind is not None and version is not None and epoch is not None
        why = (f"a copy of {payload_len} bytes is over this store's item limit {self.max_item_bytes}"
               if payload_len > self.max_item_bytes else self.store.admit(owner, kind, version, epoch, payload_len))
        if why is not None:
            await _discard(reader, payload_len + TAG_LEN)
            return REFUSED, {"error": why}
        self.store.reserved += payload_len
        try:
            chunks = []
            left = payload_len
            while left:
                piece = await reader.readexactly(min(left, _CHUNK))
                left -= len(piece)
                if len(piece) >= _THREAD_MAC:
                    await asyncio.to_thread(mac.feed, piece)   # hashlib drops the GIL: the loop keeps going
                else:
                    mac.feed(piece)
                chunks.append(piece)
            if not mac.verify(await reader.readexactly(TAG_LEN)):
                raise MirrorError("mirror put MAC mismatch: nothing kept")
        finally:
            self.store.reserved -= payload_len
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        try:
            kept = self.store._commit(owner, kind, version, epoch, data)
        except MirrorFull as exc:
            return REFUSED, {"error": str(exc)}
        self.puts += 1
        self.bytes_in += payload_len
        return OK, {"kept": kept}

    def _answer(self, op: int, meta: dict[str, Any]) -> tuple[int, dict[str, Any], Sequence[bytes]]:
        if op == OP_GET:
            owner, kind = _int_field(meta, "owner"), _str_field(meta, "kind")
            item = self.store.get(owner, kind, _int_field(meta, "version", True),   # type: ignore[arg-type]
                                  _int_field(meta, "epoch", True))
            if item is None:
                return NOT_FOUND, {}, ()
            return OK, {"version": item.version, "epoch": item.epoch}, (item.data,)
        if op == OP_LIST:
            rows = self.store.usage(_int_field(meta, "owner", True), _str_field(meta, "kind", True))
            return OK, {"entries": [r.to_json() for r in rows], "bytes": self.store.nbytes,
                        "max_bytes": self.store.max_bytes}, ()
        if op == OP_DROP:
            freed = self.store.drop(_int_field(meta, "owner", True), _str_field(meta, "kind", True),
                                    _int_field(meta, "below_epoch", True))
            return OK, {"freed": freed}, ()
        raise MirrorError(f"unknown mirror op {op}")

    async def _reply(self, writer: asyncio.StreamWriter, base: FrameMac, seq: int, status: int,
                     meta: dict[str, Any], payload: Sequence[bytes]) -> None:
        meta_raw = _encode_meta(meta)
        head = _HEAD.pack(_MAGIC, OP_REPLY, status, min(len(meta_raw), 0xFFFF), sum(len(p) for p in payload), seq)
        # meta_len is u16: a long LIST answer carries its meta length in the payload's place instead
        if len(meta_raw) >= 0xFFFF:
            head = _HEAD.pack(_MAGIC, OP_REPLY, status, 0xFFFF, len(meta_raw), seq)
            payload, meta_raw = (meta_raw,), b""
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


# ---------------------------------------------------------------------------------------------- client
class MirrorClient:
    """Blocking client for one :class:`MirrorServer` (a worker's background thread, or the agent through
    ``asyncio.to_thread``). One connection, reused; calls are serialized by a lock; ``timeout`` bounds the
    connect and every stall."""

    def __init__(self, host: str, port: int, key: bytes, *, run_id: str = "", timeout: float = 10.0) -> None:
        self.host, self.port = host, int(port)
        self.timeout = timeout
        self._auth = _auth(key, run_id)
        self._sock: socket.socket | None = None
        self._base: FrameMac | None = None
        self._seq_out = self._seq_in = 0
        self._lock = threading.Lock()

    def __enter__(self) -> "MirrorClient":
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MirrorClient({self.host}:{self.port})"

    def connect(self) -> "MirrorClient":
        with self._lock:
            self._connect()
        return self

    def _connect(self) -> None:
        if self._sock is not None:
            return
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise MirrorError(f"cannot reach the mirror at {self.host}:{self.port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            shake = ConnectorHandshake(self._auth)
            sock.sendall(shake.prove(_recv_exact(sock, HELLO.size)))
            try:
                answer = _recv_exact(sock, ACCEPT.size)
            except MirrorError as exc:
                raise AuthError(f"the mirror at {self.host}:{self.port} refused our proof of the key or left: "
                                f"{exc}") from exc
            self._base = shake.verify(answer)
        except (OSError, MirrorError, AuthError) as exc:
            sock.close()
            if isinstance(exc, AuthError):
                raise
            raise MirrorError(f"mirror handshake with {self.host}:{self.port} failed: {exc}") from exc
        self._sock, self._seq_out, self._seq_in = sock, 0, 0

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        sock, self._sock, self._base = self._sock, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # --- the operations --------------------------------------------------------------------------------
    def put(self, owner: int, kind: str, version: int, payload: Any, *, epoch: int = 0) -> bool:
        """Store a copy; True if kept. ``payload`` is one bytes-like object or a sequence of them (e.g. the
        memoryviews of several tensors), streamed as they are: never joined, never copied. Raises
        :class:`MirrorFull` when the store refuses it, :class:`MirrorError` when the connection fails."""
        pieces = [memoryview(p).cast("B") for p in (payload if isinstance(payload, (list, tuple)) else [payload])]
        status, meta, _ = self._call(OP_PUT, {"owner": owner, "kind": kind, "version": version, "epoch": epoch},
                                     pieces)
        if status == REFUSED:
            raise MirrorFull(str(meta.get("error", "refused")))
        _check_ok(status, meta)
        return bool(meta.get("kept", False))

    def get(self, owner: int, kind: str, version: int | None = None, *, epoch: int | None = None) -> MirrorItem | None:
        status, meta, data = self._call(OP_GET, {"owner": owner, "kind": kind, "version": version, "epoch": epoch})
        if status == NOT_FOUND:
            return None
        _check_ok(status, meta)
        return MirrorItem(owner, kind, int(meta["version"]), int(meta["epoch"]), data)

    def versions(self, owner: int, kind: str) -> tuple[int, ...]:
        rows = self.list(owner, kind)
        return rows[0].versions if rows else ()

    def list(self, owner: int | None = None, kind: str | None = None) -> list[MirrorEntry]:
        status, meta, _ = self._call(OP_LIST, {"owner": owner, "kind": kind})
        _check_ok(status, meta)
        return [MirrorEntry.from_json(r) for r in meta.get("entries", [])]

    def drop(self, owner: int | None = None, kind: str | None = None, *, below_epoch: int | None = None) -> int:
        status, meta, _ = self._call(OP_DROP, {"owner": owner, "kind": kind, "below_epoch": below_epoch})
        _check_ok(status, meta)
        return int(meta.get("freed", 0))

    # --- one request, one answer -----------------------------------------------------------------------
    def _call(self, op: int, meta: dict[str, Any], pieces: Sequence[memoryview] = ()) -> tuple[int, dict[str, Any], bytes]:
        with self._lock:
            self._connect()
            try:
                return self._exchange(op, meta, pieces)
            except (OSError, MirrorError) as exc:
                self._drop()       # a broken stream is never reused: the next call reconnects
                if isinstance(exc, MirrorError):
                    raise
                raise MirrorError(f"mirror at {self.host}:{self.port}: connection lost ({exc})") from exc

    def _exchange(self, op: int, meta: dict[str, Any], pieces: Sequence[memoryview]) -> tuple[int, dict[str, Any], bytes]:
        sock, base = self._sock, self._base
        assert sock is not None and base is not None
        meta_raw = _encode_meta(meta)
        head = _HEAD.pack(_MAGIC, op, 0, len(meta_raw), sum(p.nbytes for p in pieces), self._seq_out)
        self._seq_out += 1
        mac = _mac_of(base, _TO_SERVER, head, meta_raw)
        sock.sendall(head + meta_raw)
        for piece in pieces:
            for off in range(0, piece.nbytes, _CHUNK):
                part = piece[off:off + _CHUNK]
                mac.feed(part)
                sock.sendall(part)
        sock.sendall(mac.tag())
        head_in = _recv_exact(sock, _HEAD.size)
        magic, rop, status, meta_len, payload_len, seq = _HEAD.unpack(head_in)
        if magic != _MAGIC or rop != OP_REPLY or seq != self._seq_in:
            raise MirrorError(f"bad mirror reply (magic {magic!r}, op {rop}, seq {seq}/{self._seq_in})")
        self._seq_in += 1
        long_meta = meta_len == 0xFFFF
        if long_meta and payload_len > MAX_REPLY_META:
            raise MirrorError(f"mirror reply meta of {payload_len} bytes is over the limit")
        meta_in = b"" if long_meta else _recv_exact(sock, meta_len)
        mac = _mac_of(base, _TO_CLIENT, head_in, meta_in)
        data = bytearray(payload_len)
        view = memoryview(data)
        for off in range(0, payload_len, _CHUNK):
            part = view[off:off + _CHUNK]
            _recv_into(sock, part)
            mac.feed(part)
        if not mac.verify(_recv_exact(sock, TAG_LEN)):
            raise MirrorError("mirror reply MAC mismatch: forged or corrupted")
        if long_meta:
            return status, _decode_meta(bytes(data)), b""
        return status, _decode_meta(meta_in), bytes(data) if payload_len else b""


def _check_ok(status: int, meta: dict[str, Any]) -> None:
    if status != OK:
        raise MirrorError(f"mirror request failed (status {status}): {meta.get('error', '')}")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError as exc:
            raise MirrorError(f"the mirror made no progress for {sock.gettimeout()} s") from exc
        if n == 0:
            raise MirrorError("the mirror closed the connection")
        got += n


# ---------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class MirrorTarget:
    """Where one process's copies go: a node's mirror store and how to prove the key to it. The agent hands
    its workers theirs (their node's buddy) over the private agent socket (``mirror_info``); never printed."""

    node: str
    addr: str
    port: int
    key: bytes = dataclasses.field(repr=False)
    run_id: str = ""
    epoch: int = 0          # the epoch copies must carry (the generation that spawned the writers)

    def client(self, timeout: float = 10.0) -> MirrorClient:
        return MirrorClient(self.addr, self.port, self.key, run_id=self.run_id, timeout=timeout)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "addr": self.addr, "port": self.port, "key": self.key.hex(),
                "run_id": self.run_id, "epoch": self.epoch}

    @classmethod
    def from_json(cls, d: Any) -> "MirrorTarget":
        try:
            return cls(str(d["node"]), str(d["addr"]), int(d["port"]), bytes.fromhex(str(d["key"])),
                       str(d.get("run_id", "")), int(d.get("epoch", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise MirrorError(f"malformed mirror target: {type(exc).__name__}") from exc


# ---------------------------------------------------------------------------------------------- key, ring
def new_mirror_key() -> bytes:
    return secrets.token_bytes(32)


async def ensure_mirror_key(store: Any, key_path: str) -> bytes:
    """The run's mirror key: the first agent draws it and creates ``key_path`` in the run's (authenticated)
    etcd; every agent reads the one that won. ``store`` is the rendezvous's ``EtcdStore``."""
    await store.create_json(key_path, {"v": 1, "key": new_mirror_key().hex()})
    doc, _rev = await store.get_json(key_path)
    try:
        key = bytes.fromhex(str((doc or {})["key"]))
    except (KeyError, ValueError, TypeError) as exc:
        raise MirrorError(f"the run's mirror key in etcd ({key_path}) is unreadable: {exc}") from exc
    if len(key) < 16:
        raise MirrorError(f"the run's mirror key in etcd ({key_path}) is too short")
    return key


def ring_nodes(members: Sequence[str], holders: Iterable[str] = (), lost: Iterable[str] = ()) -> tuple[str, ...]:
    """The nodes of the buddy ring: ``members`` in group-rank order, then any other node that holds ranks
    (``holders``: a spare node that took a rank in a swap), sorted; nodes in ``lost`` left out."""
    gone = set(lost)
    ring = [m for m in members if m not in gone]
    ring += sorted({h for h in holders if h not in gone and h not in ring})
    return tuple(ring)


def buddy_ring(nodes: Sequence[str]) -> dict[str, str]:
    """node -> its buddy: the node that holds its copies (the next one in ``nodes``, wrapping). A ring of
    one node has no buddy (nothing else survives its loss)."""
    if len(nodes) < 2:
        return {}
    return {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)}


def copies_of(node: str, nodes: Sequence[str]) -> str | None:
    """Which node holds ``node``'s copies in the ring over ``nodes`` (None: no buddy)."""
    return buddy_ring(nodes).get(node)


__all__ = ["BAD_REQUEST", "DEFAULT_MAX_BYTES", "MirrorClient", "MirrorEntry", "MirrorError", "MirrorFull",
           "MirrorItem", "MirrorServer", "MirrorStore", "MirrorTarget", "NOT_FOUND", "OK", "REFUSED", "buddy_ring", "copies_of",
           "ensure_mirror_key", "new_mirror_key", "ring_nodes"]
