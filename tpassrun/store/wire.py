"""The workers' store wire: an authenticated request/response channel (torch-free, sans torch on both ends).

A client opens a connection to the store's one port and says :data:`MAGIC` first (a plain ``TCPStore`` client's
first byte is a small query-type number, never ``T``), then the two ends run :mod:`tpassrun.transfer.auth`'s HMAC
handshake (purpose ``"store"``) over fresh nonces. Every message after it::

    u32 body length | body | 16-byte tag = HMAC-SHA256(k, direction | u64 sequence | body)[:16]

``k`` is the connection's one-time key (:meth:`~tpassrun.transfer.auth.FrameMac.one_time_key`), the sequence numbers
count per direction from 0, so a message cannot be forged, replayed, reordered or reflected. A body is one
operation (u8 op, u32 timeout in ms, u16 count, then ``count`` fields of u32 length + bytes) or one answer (u8
status, u16 count, fields); integers travel as decimal text. Sizes are checked before anything is allocated.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from typing import Sequence

from tpassrun.transfer import ACCEPT, HELLO, PROOF, ConnectorHandshake, ListenerHandshake, TransferAuth
from tpassrun.transfer import AuthError as AuthError  # what every function here raises on a bad peer

MAGIC = b"TPST"
PURPOSE = "store"
CONTEXT = "workers-store"          # TransferAuth.swap_id: one store per run key, rank -1
MAX_BODY = 64 << 20                # a store value larger than this is refused (gloo's are bytes to kilobytes)
MAX_FIELDS = 1 << 16
TAG = 16

# operations: what the client asks, one per message
SET, GET, ADD, COMPARE_SET, CHECK, DELETE, NUM_KEYS, WAIT, APPEND, MULTI_GET, MULTI_SET, PING = range(1, 13)
OK, TIMEOUT, ERROR = 0, 1, 2       # answers' status

_LEN = struct.Struct("<I")
_OP = struct.Struct("<BIH")
_ANSWER = struct.Struct("<BH")


def store_auth(key: bytes) -> TransferAuth:
    return TransferAuth(key, CONTEXT, -1, purpose=PURPOSE)


def derive_store_key(base: bytes) -> bytes:
    """The workers' store key from the run's mirror key (shared by every agent of the run, never on a command
    line): a holder of this one learns nothing of the mirror's."""
    return hmac.new(base, b"tpassrun-workers-store/v1", hashlib.sha256).digest()


def encode_fields(fields: Sequence[bytes]) -> bytes:
    return b"".join(_LEN.pack(len(f)) + bytes(f) for f in fields)


def decode_fields(body: bytes, at: int, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        if at + 4 > len(body):
            raise AuthError("a store message ends inside a field length")
        (n,) = _LEN.unpack_from(body, at)
        at += 4
        if at + n > len(body):
            raise AuthError("a store message ends inside a field")
        out.append(body[at:at + n])
        at += n
    if at != len(body):
        raise AuthError("a store message has bytes past its last field")
    return out


def encode_op(op: int, fields: Sequence[bytes], timeout_ms: int = 0) -> bytes:
    return _OP.pack(op, max(0, min(timeout_ms, 0xFFFFFFFF)), len(fields)) + encode_fields(fields)


def decode_op(body: bytes) -> tuple[int, int, list[bytes]]:
    if len(body) < _OP.size:
        raise AuthError("a store request too short")
    op, timeout_ms, count = _OP.unpack_from(body)
    return op, timeout_ms, decode_fields(body, _OP.size, count)


def encode_answer(status: int, fields: Sequence[bytes]) -> bytes:
    return _ANSWER.pack(status, len(fields)) + encode_fields(fields)


def decode_answer(body: bytes) -> tuple[int, list[bytes]]:
    if len(body) < _ANSWER.size:
        raise AuthError("a store answer too short")
    status, count = _ANSWER.unpack_from(body)
    return status, decode_fields(body, _ANSWER.size, count)


class Channel:
    """One authenticated connection, blocking: :meth:`send` and :meth:`recv` whole messages, each tagged.
    ``role`` is ``b"c"`` (client) or ``b"s"`` (server): a message is tagged with its sender's role, so one
    end's messages can never be played back to it."""

    def __init__(self, sock: socket.socket, key: bytes, role: bytes) -> None:
        self.sock, self._key, self._role = sock, key, role
        self._peer = b"s" if role == b"c" else b"c"
        self._sent = self._got = 0

    def _tag(self, role: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, role + struct.pack("<Q", seq) + body, hashlib.sha256).digest()[:TAG]

    def send(self, body: bytes) -> None:
        tag = self._tag(self._role, self._sent, body)
        self._sent += 1
        self.sock.sendall(_LEN.pack(len(body)) + body + tag)

    def recv(self) -> bytes:
        (n,) = _LEN.unpack(recv_exact(self.sock, 4))
        if n > MAX_BODY:
            raise AuthError(f"a store message of {n} bytes (at most {MAX_BODY})")
        body = recv_exact(self.sock, n)
        tag = recv_exact(self.sock, TAG)
        if not hmac.compare_digest(tag, self._tag(self._peer, self._got, body)):
            raise AuthError("a store message without a valid tag (forged, replayed or corrupted)")
        self._got += 1
        return body

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; with ``deadline`` (monotonic) the whole read must end by then, however slowly they drip."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AuthError("the peer did not finish its handshake in time")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the store connection was closed")
        buf += chunk
    return bytes(buf)


def client_handshake(sock: socket.socket, key: bytes, deadline: float) -> Channel:
    """The connecting end: the magic, then proof for proof; a server that cannot prove the key gets nothing."""
    shake = ConnectorHandshake(store_auth(key))
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(MAGIC)
    sock.sendall(shake.prove(recv_exact(sock, HELLO.size, deadline)))
    try:
        answer = recv_exact(sock, ACCEPT.size, deadline)
    except ConnectionError:
        raise AuthError("the store closed the connection on our proof (another run's key)") from None
    mac = shake.verify(answer)
    sock.settimeout(None)
    return Channel(sock, mac.one_time_key(b"store-messages"), b"c")


def server_handshake(sock: socket.socket, key: bytes, deadline: float) -> Channel:
    """The listening end, after :data:`MAGIC` was read: hello, the client's proof checked, our proof back."""
    shake = ListenerHandshake(store_auth(key))
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    sock.sendall(shake.hello())
    sock.sendall(shake.accept(recv_exact(sock, PROOF.size, deadline)))
    sock.settimeout(None)
    return Channel(sock, shake.frame_mac().one_time_key(b"store-messages"), b"s")
