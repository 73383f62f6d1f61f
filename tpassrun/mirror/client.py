"""The mirror's clients: the blocking :class:`MirrorClient` (a worker's pusher thread, a joiner, the agent through
``asyncio.to_thread``) and the one-way :class:`PushStream` (a worker's light snapshots). The wire format and the
server are :mod:`tpassrun.mirror.net`'s.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Any, Sequence

from tpassrun.mirror import meta as M
from tpassrun.mirror.net import (
    _CHUNK,
    _HEAD,
    _MAGIC,
    _TO_CLIENT,
    _TO_SERVER,
    MAX_REPLY_META,
    NOT_FOUND,
    OK,
    OP_DROP,
    OP_GET,
    OP_LIST,
    OP_PUSH,
    OP_PUT,
    OP_REPLY,
    PAYLOAD_GMAC,
    REFUSED,
    _auth,
    _mac_of,
    _payload_tag,
)
from tpassrun.mirror.seal import PAYLOAD_AEAD, FrameSeal
from tpassrun.mirror.store import MirrorEntry, MirrorError, MirrorFull, MirrorItem
from tpassrun.transfer import (
    ACCEPT,
    AEAD_TAG_LEN,
    FLAG_ENCRYPT,
    FLAG_GMAC,
    HELLO,
    TAG_LEN,
    AuthError,
    ConnectorHandshake,
    FrameMac,
    aead_unavailable_reason,
    encryption_wanted,
)


def _seals(host: str, port: int, base: FrameMac, flags: int, encrypt: bool) -> tuple[FrameSeal, FrameSeal] | None:
    """The connection's (requests', replies') seals when the server's hello says its run encrypts; None when
    it does not, unless this process's run encrypts: then nothing is sent in clear (a MirrorError)."""
    if not flags & FLAG_ENCRYPT:
        if encrypt:
            raise MirrorError(f"this run encrypts its mirror traffic (--rdzv-conf encrypt=true) and the mirror at "
                              f"{host}:{port} does not decrypt: nothing was sent")
        return None
    why = aead_unavailable_reason()
    if why is not None:
        raise MirrorError(f"the mirror at {host}:{port} encrypts its traffic, but here {why}")
    return FrameSeal(base, _TO_SERVER), FrameSeal(base, _TO_CLIENT)


def _dial(host: str, port: int, timeout: float, auth: Any, *,
          sndbuf: int = 0) -> tuple[socket.socket, FrameMac, int]:
    """Connect to a mirror server and prove the job's key (both clients): -> (socket, the connection's frame MAC
    base, what the server's hello offers: :data:`FLAG_GMAC`). A refused proof is an :class:`AuthError`; anything
    else a :class:`MirrorError`."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise MirrorError(f"cannot reach the mirror at {host}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sndbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        shake = ConnectorHandshake(auth)
        sock.sendall(shake.prove(_recv_exact(sock, HELLO.size)))
        try:
            answer = _recv_exact(sock, ACCEPT.size)
        except MirrorError as exc:
            raise AuthError(f"the mirror at {host}:{port} refused our proof of the key or left: {exc}") from exc
        return sock, shake.verify(answer), shake.peer_flags
    except (OSError, MirrorError, AuthError) as exc:
        sock.close()
        if isinstance(exc, AuthError):
            raise
        raise MirrorError(f"mirror handshake with {host}:{port} failed: {exc}") from exc


class MirrorClient:
    """Blocking client for one :class:`MirrorServer` (a worker's background thread, or the agent through
    ``asyncio.to_thread``). One connection, reused; calls are serialized by a lock; ``timeout`` bounds the
    connect and every stall. ``encrypt``: this process's run encrypts (None: :func:`encryption_wanted`); a server
    that encrypts is followed either way."""

    def __init__(self, host: str, port: int, key: bytes, *, run_id: str = "", timeout: float = 10.0,
                 encrypt: bool | None = None) -> None:
        self.host, self.port = host, int(port)
        self.timeout = timeout
        self.encrypt = encryption_wanted(encrypt)
        self._seals: tuple[FrameSeal, FrameSeal] | None = None
        self._auth = _auth(key, run_id)
        self._sock: socket.socket | None = None
        self._base: FrameMac | None = None
        self._seq_out = self._seq_in = 0
        self._gmac = False              # the server verifies GMAC payload tags (an older one: HMAC-SHA256 tags)
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
        sock, self._base, flags = _dial(self.host, self.port, self.timeout, self._auth)
        try:
            self._seals = _seals(self.host, self.port, self._base, flags, self.encrypt)
        except MirrorError:
            sock.close()
            raise
        self._gmac = bool(flags & FLAG_GMAC)
        self._sock, self._seq_out, self._seq_in = sock, 0, 0

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        sock, self._sock, self._base, self._seals = self._sock, None, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # --- the operations --------------------------------------------------------------------------------
    def put(self, owner: int, kind: str, version: int, payload: Any, *, epoch: int = 0) -> bool:
        """Store a copy; True if kept. ``payload`` is one bytes-like object or a sequence of them (e.g. the
        memoryviews of several tensors), streamed as they are: never joined, never copied. Raises
        :class:`MirrorFull` when the store refuses it, :class:`MirrorError` when the connection fails."""
        pieces = [memoryview(p).cast("B") for p in (payload if isinstance(payload, (list, tuple)) else [payload])]
        status, meta, _ = self._call(OP_PUT, M.CopyRef(owner, kind, version, epoch), pieces)
        if status == REFUSED:
            raise MirrorFull(M.read(M.Failed, meta).error or "refused")
        _check_ok(status, meta)
        return M.read(M.Stored, meta).kept

    def get(self, owner: int, kind: str, version: int | None = None, *, epoch: int | None = None) -> MirrorItem | None:
        status, meta, data = self._call(OP_GET, M.Get(owner, kind, version, epoch))
        if status == NOT_FOUND:
            return None
        _check_ok(status, meta)
        got = M.read(M.Got, meta)
        return MirrorItem(owner, kind, got.version, got.epoch, data)

    def versions(self, owner: int, kind: str) -> tuple[int, ...]:
        rows = self.list(owner, kind)
        return rows[0].versions if rows else ()

    def list(self, owner: int | None = None, kind: str | None = None) -> list[MirrorEntry]:
        status, meta, _ = self._call(OP_LIST, M.Select(owner, kind))
        _check_ok(status, meta)
        return list(M.read(M.Listing, meta).entries)

    def drop(self, owner: int | None = None, kind: str | None = None, *, below_epoch: int | None = None) -> int:
        status, meta, _ = self._call(OP_DROP, M.Drop(owner, kind, below_epoch))
        _check_ok(status, meta)
        return M.read(M.Dropped, meta).freed

    # --- one request, one answer -----------------------------------------------------------------------
    def _call(self, op: int, meta: Any, pieces: Sequence[memoryview] = ()) -> tuple[int, bytes, bytes]:
        """(status, the answer's meta bytes, its payload) of one request (``meta``: one of :mod:`.meta`'s)."""
        with self._lock:
            self._connect()
            try:
                return self._exchange(op, meta, pieces)
            except (OSError, MirrorError) as exc:
                self._drop()       # a broken stream is never reused: the next call reconnects
                if isinstance(exc, MirrorError):
                    raise
                raise MirrorError(f"mirror at {self.host}:{self.port}: connection lost ({exc})") from exc

    def _exchange(self, op: int, meta: Any, pieces: Sequence[memoryview]) -> tuple[int, bytes, bytes]:
        sock, base = self._sock, self._base
        assert sock is not None and base is not None
        meta_raw = M.encode(meta)
        seals = self._seals
        fast = self._gmac and op == OP_PUT and seals is None
        head = _HEAD.pack(_MAGIC, op, PAYLOAD_AEAD if seals else PAYLOAD_GMAC if fast else 0, len(meta_raw),
                          sum(p.nbytes for p in pieces), self._seq_out)
        self._seq_out += 1
        mac = _mac_of(base, _TO_SERVER, head, meta_raw)
        if seals is not None:
            _send_all(sock, seals[0].seal(head, meta_raw, pieces))
        elif fast:        # one tag over the pieces in place, then one gathered send: no per-chunk Python loop
            tag = _payload_tag(mac, pieces)
            _send_all(sock, [head + meta_raw, *pieces, tag])
        else:
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
        if seals is not None:
            meta_in = seals[1].open_meta(head_in, _recv_exact(sock, (0 if long_meta else meta_len) + AEAD_TAG_LEN))
            sealed = bytearray(payload_len + AEAD_TAG_LEN)
            _recv_into(sock, memoryview(sealed))
            plain = seals[1].open_payload(head_in, sealed)
            if long_meta:
                return status, plain, b""
            return status, meta_in, plain
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
            return status, bytes(data), b""
        return status, meta_in, bytes(data) if payload_len else b""


class PushStream:
    """A one-way pushing connection to one :class:`MirrorServer` (a worker's light snapshots): :meth:`connect`
    (blocking: the handshake, from a helper thread), then :meth:`push` from the training thread, which hands one
    MAC'd frame to the kernel without waiting for anything and returns at once.

    After the handshake nothing is ever read from the socket (the server sends nothing), so a process killed
    right after :meth:`push` returned still has its frame delivered: the kernel sends what it accepted and then
    closes the connection in order. What is *not* covered: a host losing power before the frame left its network
    card (microseconds on an idle link)."""

    SNDBUF = 1 << 20             # room for ~100 frames: a push never blocks, and never half-fits unless the
                                 # buddy stopped reading for that long

    def __init__(self, host: str, port: int, key: bytes, *, run_id: str = "", timeout: float = 5.0,
                 encrypt: bool | None = None) -> None:
        self.host, self.port = host, int(port)
        self.timeout = timeout
        self.encrypt = encryption_wanted(encrypt)     # as MirrorClient's
        self._seal: FrameSeal | None = None
        self._auth = _auth(key, run_id)
        self._sock: socket.socket | None = None
        self._base: FrameMac | None = None
        self._seq = 0
        self.pushed = 0
        self.bytes = 0

    def __repr__(self) -> str:
        return f"PushStream({self.host}:{self.port})"

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> "PushStream":
        sock, base, flags = _dial(self.host, self.port, self.timeout, self._auth, sndbuf=self.SNDBUF)
        try:
            seals = _seals(self.host, self.port, base, flags, self.encrypt)
        except MirrorError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock, self._base, self._seq, self._seal = sock, base, 0, seals[0] if seals else None
        return self

    def frame(self, owner: int, kind: str, version: int, epoch: int, payload: bytes) -> list[bytes]:
        """The pieces of one PUSH frame (head and meta, payload, tag); advances the sequence number."""
        assert self._base is not None
        meta = M.encode(M.CopyRef(owner, kind, version, epoch))
        head = _HEAD.pack(_MAGIC, OP_PUSH, PAYLOAD_AEAD if self._seal else 0, len(meta), len(payload), self._seq)
        self._seq += 1
        if self._seal is not None:
            return self._seal.seal(head, meta, [payload])
        mac = _mac_of(self._base, _TO_SERVER, head, meta)
        mac.feed(payload)
        return [head + meta, payload, mac.tag()]

    def push(self, owner: int, kind: str, version: int, epoch: int, payload: bytes) -> bytes | None:
        """Hand one frame to the kernel, never blocking. Returns None when all of it was accepted, else the
        bytes still to send (the send buffer was full: the caller finishes them off the training thread, or
        drops the stream). Raises :class:`OSError` when the connection is broken."""
        sock = self._sock
        if sock is None:
            raise OSError("push stream not connected")
        pieces = self.frame(owner, kind, version, epoch, payload)
        total = sum(len(p) for p in pieces)
        try:
            sent = sock.sendmsg(pieces)
        except BlockingIOError:
            sent = 0
        self.pushed += 1
        self.bytes += len(payload)
        return None if sent == total else b"".join(pieces)[sent:]

    def finish(self, rest: bytes, timeout: float = 5.0) -> None:
        """Send what :meth:`push` could not (blocking, bounded: from a helper thread)."""
        sock = self._sock
        if sock is None:
            raise OSError("push stream not connected")
        deadline, view = time.monotonic() + timeout, memoryview(rest)
        while view:
            try:
                n = sock.send(view)
                view = view[n:]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the mirror at {self.host}:{self.port} took no data for {timeout} s") from None
                select.select([], [sock], [], left)

    def close(self) -> None:
        sock, self._sock, self._base, self._seal = self._sock, None, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _check_ok(status: int, meta: bytes) -> None:
    if status != OK:
        raise MirrorError(f"mirror request failed (status {status}): {M.read(M.Failed, meta).error}")


def _send_all(sock: socket.socket, pieces: list[Any]) -> None:
    """``sendall`` of the pieces in order, gathered (``sendmsg``), never joined into one buffer."""
    views = [memoryview(p).cast("B") for p in pieces]
    views = [v for v in views if v.nbytes]
    while views:
        sent = sock.sendmsg(views[:512])
        while sent and views:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0], sent = views[0][sent:], 0


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


__all__ = ["MirrorClient", "PushStream"]
