"""The point-to-point TCP transfer of a :class:`StateBundle`: the frame of :mod:`tpassrun.transfer.frame` on a
socket, the receiver's verdict, and (between processes) authentication.

An unauthenticated stream is the frame as it is, followed by the receiver's verdict::

    frame     prefix | head | data (chunks of chunk_bytes) | trailer      (see handoff_frame)
    ack       8 B  receiver -> sender: b"TPAK" | u32 status (0 ok, 1 checksum mismatch)

The ack matters: a leaving rank may only exit once the joiner has *verified* its state, otherwise the swap
must be abandoned.

A transfer between processes is authenticated (:class:`TransferAuth`): a per-swap key reaches both ends only
through the control plane, never the network. Before any state byte is read or sent, the two ends prove the
key to each other over fresh nonces (:mod:`tpassrun.transfer.auth`'s handshake, shared with the agent's mirror
store; either end may be a stranger: a process that found the port, or a forged plan's address). Then every
part of the frame carries a tag keyed for this connection (both nonces, the swap and the rank)::

    prefix | head | head tag                  MAC("head" | prefix | head): checked before the head is parsed,
                                              so nothing is allocated from a table the sender did not sign
    data frame i | tag i                      the tensor bytes as one stream cut into frames of chunk_bytes,
                                              FMAC_i("data" | u64 i | u64 length | frame), checked before
                                              anything is applied
    trailer | end tag                         MAC("end" | trailer | every frame tag): no frame dropped or moved
    ack

MAC is the connection's HMAC-SHA256 (32 B). The head names the frame MAC (its ``checksum``, under the head's tag):
``gmac-aes-256`` (16 B; FMAC_i is GMAC under the key MAC("one-time-key" | "gmac-data"), one per connection, with
nonce i: :mod:`tpassrun.transfer.gmac`, from ``cryptography``), the one frame MAC; the receiver's hello says
FLAG_GMAC. Why: SHA-256 is ~2 GB/s per core even with SHA instructions, so an HMAC'd stream was CPU-bound on both
ends at a fraction of the checksummed one; GHASH runs at ~20 GB/s per core, cheaper than the copy out of the
socket. Why frames and not one MAC over the stream: independent frame tags are computed off the socket's thread
(:mod:`tpassrun.transfer.tagger`; GMAC releases the GIL): the sender tags frame i+1 while frame i is on the wire,
the receiver verifies frame i while frame i+1 arrives (``bench/transfer.py``).

Older peers (tpassrun before issue 42, which also had ``poly1305`` and ``hmac-sha256`` frames): a receiver whose
hello lacks FLAG_GMAC is refused by the sender before a byte of state goes out, and a stream whose head names an
older frame MAC is refused by the receiver, each in one line (:func:`_frame_mac_name`, :func:`_older_sender`).

A listener serves every connection's handshake at once (:class:`~tpassrun.transfer.gate.HandshakeGate`), each within
one overall deadline (:data:`~tpassrun.transfer.gate.HANDSHAKE_DEADLINE_S`), the first to prove the key being the
sender; the sender's handshake has the same deadline, and a connection lost before the receiver proved the key
is tried again at once (:func:`connect_and_send`): a stranger can neither hold the listener nor the sender.
"""

from __future__ import annotations

import hmac
import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

from tpassrun.transfer import gmac
from tpassrun.transfer.auth import (
    ACCEPT,
    AEAD_NAME,
    AEAD_TAG_LEN,
    FLAG_GMAC,
    HELLO,
    PROOF,
    TAG_LEN,
    AuthError,
    ConnectorHandshake,
    FrameCipher,
    FrameMac,
    ListenerHandshake,
    TransferAuth,
    encryption_wanted,
)
from tpassrun.transfer.codec import ChecksumError, HandoffError, StateBundle
from tpassrun.transfer.frame import (
    _DEFAULT_CHUNK,
    _END_MAGIC,
    _MAX_HEAD_BYTES,
    _PREFIX_LEN,
    _STREAM_CHECKSUM,
    _TRAILER,
    _allocate_all,
    _encode_head,
    _Frame,
    _frames,
    _new_checksum,
    _outgoing,
    _parse_head,
    _Pipelined,
    _read_frame,
    _read_prefix,
    _SocketReader,
    decode_small,
    encode_parts,
    encode_small,
    reserve_receive_arena,
    reserved_receive_bytes,
)
from tpassrun.transfer.gate import HANDSHAKE_DEADLINE_S, HandshakeGate
from tpassrun.transfer.quiet import Throttle, held_note
from tpassrun.transfer.seal import (  # noqa: F401
    _AUTH_TRAILER,
    _MAC_THREADS,
    SEALED_FRAME_BYTES,
    _tag,
    listener_flags,
    open_head,
    read_sealed,
    send_sealed,
    sender_encrypts,
)
from tpassrun.transfer.tagger import GMAC_NAME, FrameTagger, TagAhead, Verifier, send_parts

log = logging.getLogger("tpassrun.transfer.handoff")

__all__ = ["AuthError", "TransferAuth", "TransferStats", "accept_and_recv", "accept_one", "connect_and_send",
           "decode_small", "encode_parts", "encode_small", "listen_for_bundle", "recv_bundle", "reserve_receive_arena",
           "reserved_receive_bytes", "send_bundle"]

_ACK_MAGIC = b"TPAK"
_ACK = struct.Struct("<4sI")
_ACK_OK, _ACK_CHECKSUM_MISMATCH = 0, 1
_GMAC_CHECKSUM = GMAC_NAME
_OLDER_FRAME_MACS = ("poly1305", "hmac-sha256")    # what a tpassrun before issue 42 could send: refused (one line)
_OLD_FLAG_POLY1305 = 1                             # the hello of such a receiver without 'cryptography' offered it
_UPGRADE = "run this tpassrun version (its frames are GMAC, from 'cryptography') on both ends"
_MAX_AUTH_HEAD_BYTES = 64 << 20        # what a signed head may claim before its tag was checked
_STRANGER_LINES = Throttle()           # one warning line per source a minute, however many strangers it sends


@dataclass(frozen=True)
class TransferStats:
    """What one transfer cost. ``nbytes`` counts every byte of the frame (header, data, trailer, tags)."""

    nbytes: int
    seconds: float
    chunks: int
    checksum: str  # "<algorithm>:<8 hex digits>", identical on both ends of a good transfer

    @property
    def gbps(self) -> float:
        """Throughput in gigabytes (10**9 bytes) per second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


# ---------------------------------------------------------------------------------------------
# the handshake (wireauth's, over a blocking socket)


def _sender_handshake(sock: socket.socket, auth: TransferAuth,
                      deadline_s: float = HANDSHAKE_DEADLINE_S) -> tuple[FrameMac, int]:
    """Connecting side: prove the key over the receiver's nonce, and send nothing more unless the receiver
    proves it too (a forged address must not receive a single byte of state). Returns the connection's MAC and
    the receiver's flags (what it can verify). The whole exchange has ``deadline_s`` (not each read); the socket's
    own timeout is left as it was."""
    stream_timeout = sock.gettimeout()
    reader = _DeadlineReader(sock, time.monotonic() + deadline_s)
    shake = ConnectorHandshake(auth)
    try:
        proof = shake.prove(reader.read_exact(HELLO.size, "the receiver's nonce"))
        try:
            sock.sendall(proof)
        except OSError as exc:
            raise HandoffError(f"sending the proof: connection lost ({exc})") from exc
        try:
            raw = reader.read_exact(ACCEPT.size, "the receiver's proof")
        except HandoffError as exc:
            raise _Unproved(f"the receiver refused our proof or left: {exc}") from exc
        return shake.verify(raw), shake.peer_flags
    finally:
        sock.settimeout(stream_timeout)


class _Unproved(AuthError):
    """The receiver neither proved the key nor refused it: it left, or said nothing, after our proof (a retry may
    meet the joiner; a wrong proof never will)."""


class _DeadlineReader:
    """Reads that share one deadline: each ``recv`` waits only for what is left of it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def read_exact(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        got = 0
        while got < n:
            left = self._deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                k = self._sock.recv_into(memoryview(buf)[got:])
            except TimeoutError as exc:
                raise HandoffError(f"receiving {what}: the handshake's deadline passed ({got} of {n} bytes)") from exc
            except OSError as exc:
                raise HandoffError(f"receiving {what}: connection lost ({exc})") from exc
            if k == 0:
                raise HandoffError(f"receiving {what}: the peer closed the connection after {got} of {n} bytes")
            got += k
        return bytes(buf)


def _frame_mac_name(requested: str | None, peer_flags: int = FLAG_GMAC) -> str:
    """The frame MAC a sender uses (``requested``: tests, the bench; only GMAC exists): a receiver whose hello
    (``peer_flags``) does not say FLAG_GMAC is a tpassrun before issue 42 without ``cryptography``, refused in one
    line before a byte of state goes out."""
    if requested not in (None, _GMAC_CHECKSUM):
        raise ValueError(f"unknown frame MAC {requested!r} (there is one: {_GMAC_CHECKSUM})")
    if not peer_flags & FLAG_GMAC:
        offered = "poly1305" if peer_flags & _OLD_FLAG_POLY1305 else "hmac-sha256"
        raise HandoffError("the receiver is an older tpassrun that cannot verify GMAC frame tags (it offers "
                           f"{offered} frames): nothing was sent; {_UPGRADE}")
    return _GMAC_CHECKSUM


def _older_sender(checksum: str) -> HandoffError:
    return HandoffError(f"the sender is an older tpassrun ({checksum} frame tags, which this version no longer "
                        f"verifies): nothing was applied; {_UPGRADE}")


# ---------------------------------------------------------------------------------------------
# sending


class _Sender:
    """sendall with error translation, byte accounting and the test-only corruption hook."""

    def __init__(self, sock: socket.socket, corrupt_byte_at: int | None) -> None:
        self._sock = sock
        self._corrupt_byte_at = corrupt_byte_at
        self.offset = 0

    def send(self, data: Any, what: str) -> None:
        n = len(data)
        at = self._corrupt_byte_at
        if at is not None and self.offset <= at < self.offset + n:
            tampered = bytearray(data)
            tampered[at - self.offset] ^= 0xFF
            data = tampered
        try:
            self._sock.sendall(data)
        except TimeoutError as exc:
            raise HandoffError(f"sending {what}: receiver made no progress for {self._sock.gettimeout()} s") from exc
        except OSError as exc:
            raise HandoffError(f"sending {what}: connection lost ({exc})") from exc
        self.offset += n

    def send_frame(self, pieces: list[memoryview], tag: bytes, what: str) -> None:
        """A data frame and its tag, in one ``sendmsg`` where the socket takes it (no test corruption asked)."""
        n = sum(len(p) for p in pieces) + len(tag)
        if self._corrupt_byte_at is not None:
            for piece in pieces:
                self.send(piece, what)
            self.send(tag, f"{what}'s tag")
            return
        try:
            send_parts(self._sock, [*pieces, tag])
        except TimeoutError as exc:
            raise HandoffError(f"sending {what}: receiver made no progress for {self._sock.gettimeout()} s") from exc
        except OSError as exc:
            raise HandoffError(f"sending {what}: connection lost ({exc})") from exc
        self.offset += n


def send_bundle(sock: socket.socket, bundle: StateBundle, *, chunk_bytes: int = _DEFAULT_CHUNK,
                checksum: str = _STREAM_CHECKSUM, auth: TransferAuth | None = None, frame_mac: str | None = None,
                proved: tuple[FrameMac, int] | None = None, encrypt: bool | None = None,
                _corrupt_byte_at: int | None = None) -> TransferStats:
    """Stream ``bundle`` over a connected socket and wait for the receiver's verdict.

    Returns only once the receiver has verified the checksum. Raises ChecksumError if the
    receiver saw corrupted data, HandoffError if the connection failed or stalled longer
    than the socket's timeout. ``checksum`` is "blocksum64" (default, memory-bandwidth fast)
    or "crc32" (stronger, ~2 GB/s per core); the receiver follows the header. ``_corrupt_byte_at`` (tests only) flips
    the byte at that
    offset of the frame on the wire while checksumming the original. With ``auth`` the receiver must prove
    the swap's key before a byte of state goes out (:class:`AuthError` otherwise) and every part of the frame
    is authenticated (GMAC frame tags, or AES-256-GCM frames when either end's run encrypts; see the module doc).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    started = time.perf_counter()
    if auth is not None or proved is not None:
        _frame_mac_name(frame_mac)   # a bad request fails before the handshake
        mac, peer_flags = proved if proved is not None else _sender_handshake(sock, auth)   # type: ignore[arg-type]
        mac_name = AEAD_NAME if sender_encrypts(encryption_wanted(encrypt), peer_flags) \
            else _frame_mac_name(frame_mac, peer_flags)
    else:
        mac, mac_name = None, ""
    outgoing = [_outgoing(t) for t in bundle.tensors]
    specs, views = [spec for spec, _, _ in outgoing], [view for _, _, view in outgoing]
    sender = _Sender(sock, _corrupt_byte_at)
    if mac is not None:
        checksum = mac_name
        if checksum == AEAD_NAME:    # its ring of sealed frames stays in the cache until the kernel copies them
            chunk_bytes = min(chunk_bytes, SEALED_FRAME_BYTES)
        head = _encode_head(bundle.meta, specs, chunk_bytes, checksum)
        send = send_sealed if checksum == AEAD_NAME else _send_signed
        chunks, result = send(sender, mac, checksum, head, views, chunk_bytes)
    else:
        head = _encode_head(bundle.meta, specs, chunk_bytes, checksum)
        chunks, result = _send_plain(sender, head, views, chunk_bytes, checksum)
    reply = _SocketReader(sock).read_exact(_ACK.size, "the receiver's acknowledgement")
    magic, status = _ACK.unpack(reply)
    if magic != _ACK_MAGIC:
        raise HandoffError(f"unexpected acknowledgement {reply!r} from the receiver")
    if status == _ACK_CHECKSUM_MISMATCH:
        raise ChecksumError("the receiver reported a checksum mismatch: the state was corrupted in transit")
    if status != _ACK_OK:
        raise HandoffError(f"the receiver rejected the state (status {status})")
    return TransferStats(sender.offset, time.perf_counter() - started, chunks, f"{checksum}:{result:08x}")


def _send_plain(sender: _Sender, head: bytes, views: list[memoryview], chunk_bytes: int,
                checksum: str) -> tuple[int, int]:
    chunks = data_len = 0
    with _Pipelined(_new_checksum(checksum)) as crc:
        crc.feed(head[:_PREFIX_LEN])  # the same pieces the receiver will feed
        crc.feed(head[_PREFIX_LEN:])
        sender.send(head, "header")
        for index, view in enumerate(views):
            for offset in range(0, len(view), chunk_bytes):
                piece = view[offset:offset + chunk_bytes]
                crc.feed(piece)  # checksum this chunk while the kernel copies it
                sender.send(piece, f"tensor #{index}")
                chunks += 1
            data_len += len(view)
        result = crc.result()
    sender.send(_TRAILER.pack(_END_MAGIC, data_len, result), "trailer")
    return chunks, result


def _send_signed(sender: _Sender, mac: FrameMac, name: str, head: bytes, views: list[memoryview],
                 frame_bytes: int) -> tuple[int, int]:
    """The authenticated layout: frame tags computed by the pool ahead of the socket (the data is all in
    memory), so the wire never waits for SHA-256 unless the cores cannot keep up."""
    sender.send(head + _tag(mac.copy(), b"head", [head[:_PREFIX_LEN], head[_PREFIX_LEN:]]), "header")
    frames = _frames(views, frame_bytes)
    tags: list[bytes] = []
    with TagAhead(FrameTagger(mac), frames) as ahead:
        for index, pieces in enumerate(frames):
            tags.append(ahead.tag(index))     # computed while the frame before was on the wire
            sender.send_frame(pieces, tags[-1], f"frame #{index}")
    data_len = sum(len(v) for v in views)
    trailer = _AUTH_TRAILER.pack(_END_MAGIC, data_len, len(frames))
    end = _tag(mac.copy(), b"end", [trailer, *tags])
    sender.send(trailer + end, "trailer")
    return len(frames), int.from_bytes(end[:4], "little")


# ---------------------------------------------------------------------------------------------
# receiving


def recv_bundle(sock: socket.socket, *, device: str = "cpu", auth: TransferAuth | None = None,
                max_bytes: int | None = None, mac: FrameMac | None = None,
                encrypt: bool | None = None) -> tuple[StateBundle, TransferStats]:
    """Receive one bundle from a connected socket, verify it, acknowledge it.

    Tensors that lived on an accelerator on the sender are moved to ``device``; CPU tensors
    (RNG states, optimizer ``step`` counters) stay on the CPU, as they were.
    Raises ChecksumError on corruption (or a tag that does not verify), HandoffError on a lost or stalled
    connection, AuthError when the peer does not prove ``auth``'s key within the handshake's deadline (checked
    before anything else is read). ``mac``: the connection already proved the key (a :class:`HandshakeGate`'s
    winner); its MAC. ``max_bytes`` bounds what the sender may announce, checked before anything is allocated.
    """
    started = time.perf_counter()
    try:
        encrypted = encryption_wanted(encrypt)
        if auth is not None and mac is None:
            mac = _receiver_handshake(sock, auth, encrypted)
        if mac is not None:
            frame = _read_signed(_SocketReader(sock), mac, max_bytes, encrypted)
        else:
            frame = _read_frame(_SocketReader(sock), pipelined=True, max_bytes=max_bytes)
    except ChecksumError:
        _send_ack_quietly(sock, _ACK_CHECKSUM_MISMATCH)
        raise
    _send_ack_quietly(sock, _ACK_OK)
    tensors = frame.bundle.tensors
    for index, spec in enumerate(frame.specs):
        if spec.device != "cpu" and device != "cpu":
            tensors[index] = tensors[index].to(device).requires_grad_(spec.requires_grad)
    stats = TransferStats(frame.nbytes, time.perf_counter() - started, frame.chunks, frame.checksum)
    return frame.bundle, stats


def _receiver_handshake(sock: socket.socket, auth: TransferAuth, encrypt: bool = False) -> FrameMac:
    """One accepted connection's handshake (a listener serving many uses :class:`HandshakeGate`): a fresh nonce
    out, the sender's proof in within the handshake's deadline (constant-time check), our proof out."""
    stream_timeout = sock.gettimeout()
    shake = ListenerHandshake(auth, listener_flags(encrypt))
    try:
        try:
            sock.settimeout(HANDSHAKE_DEADLINE_S)
            sock.sendall(shake.hello())
        except OSError as exc:
            raise AuthError(f"the peer left before the handshake ({exc})") from exc
        try:
            raw = _DeadlineReader(sock, time.monotonic() + HANDSHAKE_DEADLINE_S).read_exact(PROOF.size,
                                                                                            "the sender's proof")
        except HandoffError as exc:
            raise AuthError(f"no proof of the swap key from the peer: {exc}") from exc
        answer = shake.accept(raw)
        try:
            sock.sendall(answer)
        except OSError as exc:
            raise HandoffError(f"the sender left during the handshake ({exc})") from exc
        return shake.frame_mac()
    finally:
        sock.settimeout(stream_timeout)


def _read_signed(reader: _SocketReader, mac: FrameMac, max_bytes: int | None, encrypted: bool = False) -> _Frame:
    """The authenticated layout (see the module doc): the head's tag before the head is parsed, every frame's
    tag verified by the pool while the next one arrives, the end tag over all of them; any mismatch is a
    ChecksumError and nothing received is returned. ``encrypted`` (this receiver's hello said FLAG_ENCRYPT):
    the head's meta and every frame are sealed (:func:`_send_sealed`), and a stream that is not is refused."""
    limit = min(_MAX_AUTH_HEAD_BYTES, _MAX_HEAD_BYTES if max_bytes is None else max_bytes)
    prefix, head_len, head_crc = _read_prefix(reader, limit)
    body = reader.read_exact(head_len + (AEAD_TAG_LEN if encrypted else 0), "header meta")
    if not hmac.compare_digest(reader.read_exact(TAG_LEN, "the header's tag"), _tag(mac.copy(), b"head", [prefix, body])):
        raise ChecksumError("handoff header corrupted or forged: tag mismatch")
    cipher = FrameCipher(mac.one_time_key(b"aead")) if encrypted else None
    if cipher is not None:
        body = open_head(cipher, prefix, body)
    head = _parse_head(prefix, body, head_crc, max_bytes)
    if (head.checksum == AEAD_NAME) != encrypted:
        raise HandoffError(f"the sender's stream is {'not ' if encrypted else ''}encrypted ({head.checksum}), and "
                           f"this receiver's run {'encrypts' if encrypted else 'does not encrypt'}")
    if cipher is not None:
        return read_sealed(reader, mac, cipher, head_len, head)
    if head.checksum in _OLDER_FRAME_MACS:
        raise _older_sender(head.checksum)
    if head.checksum != _GMAC_CHECKSUM:
        raise HandoffError(f"an authenticated stream must use {_GMAC_CHECKSUM}, not {head.checksum!r}")
    tag_len = gmac.TAG_LEN
    if not 0 < head.chunk_bytes <= 1 << 30:
        raise HandoffError(f"an authenticated stream with {head.chunk_bytes}-byte frames, refusing")
    tensors, views = _allocate_all(head.specs, use_arena=True)
    frames = _frames(views, head.chunk_bytes)
    tags: list[bytes] = []
    with Verifier(FrameTagger(mac)) as verifier:
        for index, pieces in enumerate(frames):
            for piece in pieces:
                reader.read_into(piece, f"frame #{index} of {len(frames)}")
            tags.append(reader.read_exact(tag_len, f"frame #{index}'s tag"))
            verifier.check(index, pieces, tags[-1])     # verified while the next frame arrives
        trailer = reader.read_exact(_AUTH_TRAILER.size, "trailer")
        end = reader.read_exact(TAG_LEN, "the end tag")
        verifier.wait()     # the whole stream is read first: the sender hears the verdict
    end_magic, data_len, count = _AUTH_TRAILER.unpack(trailer)
    if not hmac.compare_digest(end, _tag(mac.copy(), b"end", [trailer, *tags])) or end_magic != _END_MAGIC \
            or count != len(frames) or data_len != sum(len(v) for v in views):
        raise ChecksumError(f"handoff stream corrupted or forged: end tag mismatch ({len(frames)} frames "
                            f"received, the sender says {count})")
    nbytes = _PREFIX_LEN + head_len + TAG_LEN + data_len + tag_len * len(frames) + _AUTH_TRAILER.size + TAG_LEN
    return _Frame(StateBundle(head.meta, tensors), head.specs, nbytes, len(frames),
                  f"{head.checksum}:{int.from_bytes(end[:4], 'little'):08x}")


def _send_ack_quietly(sock: socket.socket, status: int) -> None:
    # The verdict is best effort: if the sender is gone, the receiver's own result still stands.
    try:
        sock.sendall(_ACK.pack(_ACK_MAGIC, status))
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------
# connection helpers for the joiner (listens) and the leaver/donor (connects)


def listen_for_bundle(host: str = "127.0.0.1") -> tuple[socket.socket, int]:
    """A bound, listening socket on a free port of ``host`` (the node's advertised address), and that port.

    If ``host`` is a name that does not resolve to an address of this machine (a misconfigured FQDN), the
    listener falls back to every interface with a warning: the transfer's authentication still holds."""
    try:
        return _listen(host)
    except OSError as exc:
        if host in ("0.0.0.0", "::"):
            raise
        log.warning("cannot listen for the handoff on %s (%s); listening on every interface instead", host, exc)
        return _listen("::" if ":" in host else "0.0.0.0")


def _listen(host: str) -> tuple[socket.socket, int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, 0))
        listener.listen(128)   # strangers may queue ahead of the sender: it must still get in
    except OSError:
        listener.close()
        raise
    return listener, listener.getsockname()[1]


def connect_and_send(addr: str, port: int, bundle: StateBundle, *, timeout: float,
                     chunk_bytes: int = _DEFAULT_CHUNK, auth: TransferAuth | None = None,
                     frame_mac: str | None = None, give_up: Callable[[], bool] | None = None,
                     encrypt: bool | None = None, _corrupt_byte_at: int | Callable[[], int | None] | None = None,
                     _cut_first_handshake_at: int | None = None) -> TransferStats:
    """Connect to a joiner and stream ``bundle``. ``timeout`` bounds the connect, getting a connection through
    the handshake, and every stall of the stream.

    With ``auth``, a connection lost before the receiver proved the key (closed, reset, or silent past the
    handshake's own deadline: the network, or a listener shedding a flood of strangers) is retried at once, and
    again (backing off to 1 s) until ``timeout`` or ``give_up()`` says to stop; nobody listening, a receiver
    that answers with a wrong proof, or a failure once state is flowing end it. ``_corrupt_byte_at`` (tests; a
    callable is asked once the receiver proved the key) flips a byte of the frame on the wire;
    ``_cut_first_handshake_at`` (tests) cuts the first connection after that many bytes of the proof."""
    deadline = time.monotonic() + timeout
    cut = _cut_first_handshake_at
    pause = 0.0
    while True:
        try:
            sock = socket.create_connection((addr, port), timeout=max(0.001, deadline - time.monotonic()))
        except ConnectionRefusedError as exc:
            raise HandoffError(f"cannot connect to the joiner at {addr}:{port}: {exc}") from exc
        except OSError as exc:
            if _retry(f"connecting to {addr}:{port}: {exc}", deadline, give_up, pause):
                pause = min(1.0, max(0.05, 2 * pause))
                continue
            raise HandoffError(f"cannot connect to the joiner at {addr}:{port}: {exc}") from exc
        with sock:
            sock.settimeout(timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            proved = None
            if auth is not None:
                try:
                    if cut is not None:
                        at, cut = cut, None
                        _cut_handshake(sock, auth, at)
                    proved = _sender_handshake(sock, auth, min(HANDSHAKE_DEADLINE_S, deadline - time.monotonic()))
                except AuthError as exc:
                    if not isinstance(exc, _Unproved) or not _retry(str(exc), deadline, give_up, pause):
                        raise
                    pause = min(1.0, max(0.05, 2 * pause))
                    continue
                except HandoffError as exc:
                    if not _retry(str(exc), deadline, give_up, pause):
                        raise
                    pause = min(1.0, max(0.05, 2 * pause))
                    continue
            corrupt = _corrupt_byte_at() if callable(_corrupt_byte_at) else _corrupt_byte_at
            return send_bundle(sock, bundle, chunk_bytes=chunk_bytes, auth=auth, frame_mac=frame_mac,
                               proved=proved, encrypt=encrypt, _corrupt_byte_at=corrupt)


def _retry(why: str, deadline: float, give_up: Callable[[], bool] | None, pause: float) -> bool:
    """Whether a connection that failed before the handshake completed is tried again (after ``pause``)."""
    if time.monotonic() + pause >= deadline or (give_up is not None and give_up()):
        return False
    log.warning("handoff: the connection to the joiner failed before the handshake completed (%s): trying again%s",
                why, f" in {pause:.2f} s" if pause else "")
    time.sleep(pause)
    return True


def _cut_handshake(sock: socket.socket, auth: TransferAuth, at: int) -> None:
    """Tests: this connection dies after ``at`` bytes of the proof (as a connection the network dropped)."""
    hello = _DeadlineReader(sock, time.monotonic() + HANDSHAKE_DEADLINE_S).read_exact(HELLO.size, "the nonce")
    sock.sendall(ConnectorHandshake(auth).prove(hello)[:at])
    sock.shutdown(socket.SHUT_RDWR)
    raise HandoffError(f"the connection was cut after {at} of {PROOF.size} bytes of the proof (a test's fault)")


def accept_and_recv(listener: socket.socket, *, timeout: float, device: str = "cpu",
                    auth: TransferAuth | None = None, max_bytes: int | None = None,
                    strangers: list[str] | None = None, handshake_s: float = HANDSHAKE_DEADLINE_S,
                    encrypt: bool | None = None) -> tuple[StateBundle, TransferStats]:
    """Receive a bundle from the first sender on ``listener`` that proves ``auth``. Every connection's handshake
    runs at once (:class:`~tpassrun.transfer.gate.HandshakeGate`), each within ``handshake_s``; strangers are dropped
    and noted in ``strangers``. ``timeout`` bounds the wait for the sender and every stall of the stream. The
    listener stays open (the caller owns it). Without ``auth``, the first connection is the sender."""
    if auth is None:
        conn = accept_one(listener, timeout)
        with conn:
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return recv_bundle(conn, device=device, max_bytes=max_bytes)
    deadline = time.monotonic() + timeout
    dropped: list[str] = []
    encrypted = encryption_wanted(encrypt)
    with HandshakeGate(listener, auth, listener_flags(encrypted), deadline_s=handshake_s) as gate:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandoffError(f"no authenticated sender connected within {timeout} s"
                                   + (f" ({len(dropped)} strangers dropped)" if dropped else ""))
            proved = gate.poll(left)
            for source, why in gate.take_dropped():
                held = _STRANGER_LINES.check(source)
                if held is not None:
                    log.warning("handoff: dropped a connection from %s that did not prove the swap key: %s%s", source,
                                why, held_note(held, _STRANGER_LINES.window))
                dropped.append(f"{source}: {why}")
            if proved is not None:
                break
    if strangers is not None:
        strangers.extend(dropped)
    with proved.sock as conn:
        conn.settimeout(timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return recv_bundle(conn, device=device, max_bytes=max_bytes, mac=proved.mac, encrypt=encrypted)


def accept_one(listener: socket.socket, timeout: float) -> socket.socket:
    """The next connection on ``listener`` within ``timeout`` seconds (HandoffError otherwise)."""
    if timeout <= 0:
        raise HandoffError("no authenticated sender connected in time")
    listener.settimeout(timeout)
    try:
        conn, _peer = listener.accept()
    except TimeoutError as exc:
        raise HandoffError(f"no sender connected within {timeout:.1f} s") from exc
    except OSError as exc:
        raise HandoffError(f"accepting the sender failed: {exc}") from exc
    return conn
