"""Handoff wire format and the point-to-point TCP transfer of a :class:`StateBundle`.

One transfer, all integers little endian::

    prefix   24 B  b"TPHO" | u16 version | u16 flags | u64 head_len | u32 crc32(head) | u32 crc32(first 20 B)
    head     head_len B of UTF-8 JSON: {"v": 1, "meta": <bundle meta>, "tensors": [spec, ...],
                                        "checksum": "blocksum64" | "crc32", "chunk_bytes": int}
    data     the raw bytes of every tensor, in table order, in chunks of ``chunk_bytes``
    trailer  16 B  b"TPEN" | u64 data_len | u32 checksum of prefix + head + data
    ack       8 B  receiver -> sender: b"TPAK" | u32 status (0 ok, 1 checksum mismatch)

The head carries its own checksum so a corrupted tensor table is caught before we allocate
from it; the trailer's checksum covers everything. The ack matters: a leaving rank may only
exit once the joiner has *verified* its state, otherwise the swap must be abandoned.

Tensors go out straight from their memory (``memoryview`` of a uint8 view, no ``torch.save``,
no pickle) and come in with ``recv_into`` preallocated tensors. The checksum runs in a helper
thread on chunk i while chunk i+1 is on the wire (it and the socket calls release the GIL, so
the two overlap instead of adding up); see ``_BlockSum64`` for why streams do not use crc32.

``encode_small``/``decode_small`` use the very same frame in memory (no ack, no thread) for the
per-step "light" snapshot a worker leaves in shared memory.

A transfer between processes is authenticated (:class:`TransferAuth`): a per-swap key reaches both ends only
through the control plane, never the network. Before any state byte is read or sent, the two ends prove the
key to each other over fresh nonces (either end may be a stranger: a process that found the port, or a forged
plan's address)::

    receiver -> sender    40 B  b"TPNC" | u16 version | u16 0 | nonce_r (32 B)
    sender -> receiver    68 B  b"TPAU" | nonce_s (32 B) | HMAC(key, "sender" | nonce_r | nonce_s | context)
    receiver -> sender    36 B  b"TPOK" | HMAC(key, "receiver" | nonce_r | nonce_s | context)

``context`` names the swap and the rank, so a key-holder of another swap or rank is refused too (the handshake
itself is :mod:`tpassrun.wireauth`'s, torch-free, shared with the agent's mirror store). The frame
then runs as above with HMAC-SHA256 over both nonces, the context and every byte of the frame as its checksum
("hmac-sha256"), the full 32-byte tag following the trailer; the receiver applies nothing before the tag
verified (constant-time compare), and allocates nothing beyond ``max_bytes``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import json
import math
import mmap
import os
import socket
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol
import logging

import torch

from .handoff_codec import ChecksumError, HandoffError, StateBundle, dtype_from_name
from .wireauth import (ACCEPT, HELLO, PROOF, TAG_LEN, AuthError, ConnectorHandshake, FrameMac,  # noqa: F401
                       ListenerHandshake, TransferAuth)

try:
    import numpy as np
except ImportError:  # pragma: no cover - then streams fall back to crc32
    np = None  # type: ignore[assignment]

log = logging.getLogger("tpassrun.handoff")

WIRE_VERSION = 1
_MAGIC = b"TPHO"
_END_MAGIC = b"TPEN"
_ACK_MAGIC = b"TPAK"
_PREFIX_BODY = struct.Struct("<4sHHQI")  # magic, version, flags, head_len, head_crc
_PREFIX_CRC = struct.Struct("<I")
_PREFIX_LEN = _PREFIX_BODY.size + _PREFIX_CRC.size
_TRAILER = struct.Struct("<4sQI")  # end magic, data_len, crc of everything before the trailer
_ACK = struct.Struct("<4sI")
_ACK_OK, _ACK_CHECKSUM_MISMATCH = 0, 1
_MAX_HEAD_BYTES = 1 << 30  # a corrupt length must not make us allocate the moon
_TAG_LEN = TAG_LEN
_HMAC_CHECKSUM = "hmac-sha256"
_HANDSHAKE_TIMEOUT_S = 10.0            # a stranger that connects and says nothing is dropped after this
_DEFAULT_CHUNK = 8 << 20
_HUGE_PAGE_MIN_BYTES = 4 << 20
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # built once: this runs every step


@dataclass(frozen=True)
class TransferStats:
    """What one transfer cost. ``nbytes`` counts every byte of the frame (header, data, trailer)."""

    nbytes: int
    seconds: float
    chunks: int
    checksum: str  # "<algorithm>:<8 hex digits>", identical on both ends of a good transfer

    @property
    def gbps(self) -> float:
        """Throughput in gigabytes (10**9 bytes) per second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class TensorSpec:
    """One row of the tensor table: enough to preallocate the receiving tensor."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    device: str  # device *type* on the sender; anything but "cpu" comes back on the receiver's ``device``
    requires_grad: bool

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes,
                "device": self.device, "requires_grad": self.requires_grad}

    @classmethod
    def from_json(cls, row: Any) -> "TensorSpec":
        try:
            spec = cls(str(row["dtype"]), tuple(int(n) for n in row["shape"]), int(row["nbytes"]),
                       str(row["device"]), bool(row["requires_grad"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise HandoffError(f"malformed tensor table row {row!r}") from exc
        dtype = dtype_from_name(spec.dtype)
        if any(n < 0 or n >= 1 << 62 for n in spec.shape) or len(spec.shape) > 64:
            raise HandoffError(f"tensor table row {row!r} has an impossible shape")
        expected = math.prod(spec.shape) * torch.empty((), dtype=dtype).element_size()
        if spec.nbytes != expected:
            raise HandoffError(f"tensor table row {row!r} is inconsistent (expected {expected} bytes)")
        return spec


def _receiver_handshake(sock: socket.socket, auth: TransferAuth) -> FrameMac:
    """Listener side: a fresh nonce out, the sender's proof in (constant-time), our proof out."""
    shake = ListenerHandshake(auth)
    try:
        sock.sendall(shake.hello())
    except OSError as exc:
        raise AuthError(f"the peer left before the handshake ({exc})") from exc
    try:
        raw = _SocketReader(sock).read_exact(PROOF.size, "the sender's proof")
    except HandoffError as exc:
        raise AuthError(f"no proof of the swap key from the peer: {exc}") from exc
    answer = shake.accept(raw)
    try:
        sock.sendall(answer)
    except OSError as exc:
        raise HandoffError(f"the sender left during the handshake ({exc})") from exc
    return shake.frame_mac()


def _sender_handshake(sock: socket.socket, auth: TransferAuth) -> FrameMac:
    """Connecting side: prove the key over the receiver's nonce, and send nothing more unless the receiver
    proves it too (a forged address must not receive a single byte of state)."""
    reader = _SocketReader(sock)
    shake = ConnectorHandshake(auth)
    proof = shake.prove(reader.read_exact(HELLO.size, "the receiver's nonce"))
    try:
        sock.sendall(proof)
    except OSError as exc:
        raise HandoffError(f"sending the proof: connection lost ({exc})") from exc
    try:
        raw = reader.read_exact(ACCEPT.size, "the receiver's proof")
    except HandoffError as exc:
        raise AuthError(f"the receiver refused our proof or left: {exc}") from exc
    return shake.verify(raw)


# ---------------------------------------------------------------------------------------------
# building blocks


def _outgoing(tensor: torch.Tensor) -> tuple[TensorSpec, torch.Tensor, memoryview]:
    """The tensor's bytes as a memoryview, copying only when the memory is not CPU-contiguous."""
    source = tensor.detach()
    if source.device.type != "cpu":
        source = source.cpu()  # CUDA and friends: one staging copy, the only way onto a socket
    if source.is_conj() or source.is_neg() or not source.is_contiguous():
        source = source.resolve_conj().resolve_neg().contiguous()
    dtype_name = _DTYPE_NAMES.get(source.dtype) or str(source.dtype).removeprefix("torch.")
    raw = source.reshape(-1).view(torch.uint8)
    spec = TensorSpec(dtype_name, tuple(tensor.shape), raw.numel(), tensor.device.type, tensor.requires_grad)
    return spec, source, _writable_view(raw)


def _writable_view(raw: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU uint8 tensor as a writable memoryview (the caller keeps the tensor alive).
    ``Tensor.numpy()`` raises when numpy is not installed, and numpy is not a dependency: then ctypes."""
    if np is not None:
        return memoryview(raw.numpy())
    return memoryview((ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())).cast("B")


_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.float16, torch.bfloat16, torch.float32, torch.float64)}


class _Arena:
    """Memory a warm spare faults in while it idles, so receiving a rank's state is a copy out of the socket
    and not also the kernel zeroing fresh pages (on this kind of host that costs the receiver several times
    the copy: 300 MB of first touches took 0.3-0.7 s). Tensors are carved from it in order; it serves one
    transfer, then the module forgets it and it is unmapped with the last tensor that uses it."""

    def __init__(self, nbytes: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.region = mmap.mmap(-1, nbytes, flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.region.madvise(mmap.MADV_HUGEPAGE)
        view = memoryview(self.region)
        for offset in range(0, nbytes, mmap.PAGESIZE):   # MAP_POPULATE is a hint: make sure
            view[offset] = 0
        view.release()
        self.size, self.used = nbytes, 0

    def take(self, nbytes: int) -> memoryview | None:
        start = (self.used + 63) & ~63
        if nbytes == 0 or start + nbytes > self.size:
            return None
        self.used = start + nbytes
        return memoryview(self.region)[start:start + nbytes]


_arena: _Arena | None = None


def reserve_receive_arena(nbytes: int) -> int:
    """Fault in ``nbytes`` for the next :func:`recv_bundle` (a spare does this while it waits, once it knows
    the size of a rank's state); replaces any earlier reservation. Returns the bytes reserved (0: none)."""
    global _arena
    _arena = None
    if nbytes <= 0:
        return 0
    try:
        _arena = _Arena(nbytes)
    except (OSError, ValueError):  # no memory for it: receive into fresh memory as before
        return 0
    return nbytes


def reserved_receive_bytes() -> int:
    return _arena.size if _arena is not None else 0


def _allocate(spec: TensorSpec, arena: _Arena | None = None) -> tuple[torch.Tensor, memoryview]:
    dtype = dtype_from_name(spec.dtype)
    piece = arena.take(spec.nbytes) if arena is not None else None
    if piece is not None:
        tensor = torch.frombuffer(piece, dtype=torch.uint8).view(dtype).reshape(spec.shape)
        return tensor, _writable_view(tensor.reshape(-1).view(torch.uint8))
    if spec.nbytes >= _HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        # Faulting in fresh 4 KiB pages costs the receiver as much CPU as the copy out of the
        # socket; transparent huge pages (granted on madvise by default) cut that in half.
        # Each large tensor gets its own mapping so it is freed with the tensor.
        region = mmap.mmap(-1, spec.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
        tensor = torch.frombuffer(region, dtype=torch.uint8).view(dtype).reshape(spec.shape)
    else:
        tensor = torch.empty(spec.shape, dtype=dtype)
    return tensor, _writable_view(tensor.reshape(-1).view(torch.uint8))


def _encode_head(meta: dict, specs: list[TensorSpec], chunk_bytes: int, checksum: str) -> bytes:
    doc = {"v": WIRE_VERSION, "meta": meta, "tensors": [s.to_json() for s in specs],
           "checksum": checksum, "chunk_bytes": chunk_bytes}
    try:
        body = _JSON.encode(doc).encode()
    except (TypeError, ValueError) as exc:
        raise HandoffError(f"bundle meta is not plain JSON (build bundles with capture()): {exc}") from exc
    prefix = _PREFIX_BODY.pack(_MAGIC, WIRE_VERSION, 0, len(body), zlib.crc32(body))
    return prefix + _PREFIX_CRC.pack(zlib.crc32(prefix)) + body


class _Checksum(Protocol):
    """A running checksum over the frame, fed the same pieces in the same order on both ends."""

    def feed(self, data: Any) -> None: ...
    def result(self) -> int: ...


class _Crc32:
    """zlib's crc32: the strongest check, ~2 GB/s per core. Used for the small in-memory frames."""

    def __init__(self) -> None:
        self._crc = 0

    def feed(self, data: Any) -> None:
        self._crc = zlib.crc32(data, self._crc)

    def result(self) -> int:
        return self._crc


class _BlockSum64:
    """Wrapping sums of the little-endian 64-bit words of every 64 KiB block, the block sums (and
    each piece's length) chained through crc32.

    Why not plain crc32 for streams: it runs at ~2 GB/s per core, so on a small host it takes
    the cores the socket copies need (measured: the handoff fell to ~0.4 of raw TCP) and on a
    fast NIC it would be the bottleneck. The word sums run at memory bandwidth (~13 GB/s).
    Detected: any corruption within one word (every flipped bit or byte), truncation, and
    blocks that are reordered, duplicated or misplaced. Not detected: words permuted inside one
    block, or several errors that cancel out exactly - neither is how sockets or memory fail.
    """

    _BLOCK_WORDS = (64 << 10) // 8

    def __init__(self) -> None:
        self._crc = 0

    def feed(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        whole = len(view) - len(view) % 8
        words = np.frombuffer(view[:whole], dtype="<u8")
        blocks = words.size // self._BLOCK_WORDS
        block_sums = words[:blocks * self._BLOCK_WORDS].reshape(blocks, self._BLOCK_WORDS).sum(axis=1, dtype=np.uint64)
        tail = int(words[blocks * self._BLOCK_WORDS:].sum(dtype=np.uint64))
        self._crc = zlib.crc32(block_sums.astype("<u8", copy=False).tobytes(), self._crc)
        self._crc = zlib.crc32(struct.pack("<QQ", tail, len(view)) + bytes(view[whole:]), self._crc)

    def result(self) -> int:
        return self._crc


_CHECKSUMS: dict[str, type] = {"crc32": _Crc32}
if np is not None:
    _CHECKSUMS["blocksum64"] = _BlockSum64
_STREAM_CHECKSUM = "blocksum64" if np is not None else "crc32"


def _new_checksum(name: str) -> _Checksum:
    if name not in _CHECKSUMS:
        raise HandoffError(f"checksum {name!r} is not available here (have {sorted(_CHECKSUMS)})")
    return _CHECKSUMS[name]()


class _Pipelined:
    """Runs a checksum on one helper thread, in feed order, overlapping the socket I/O.

    A fed buffer must stay unchanged until :meth:`result` returns (true here: each chunk is
    sent or received before the next one is touched, and nothing writes a chunk twice).
    zlib and numpy both release the GIL on large buffers, so the overlap is real.
    """

    def __init__(self, checksum: _Checksum) -> None:
        self._checksum = checksum
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tpassrun-handoff-checksum")

    def __enter__(self) -> "_Pipelined":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def feed(self, data: Any) -> None:
        self._pool.submit(self._checksum.feed, data)

    def result(self) -> int:
        self._pool.shutdown(wait=True)
        return self._checksum.result()


class _Reader(Protocol):
    def read_exact(self, n: int, what: str) -> bytes: ...
    def read_into(self, view: memoryview, what: str) -> None: ...


class _SocketReader:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read_exact(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf), what)
        return bytes(buf)

    def read_into(self, view: memoryview, what: str) -> None:
        got, total = 0, len(view)
        while got < total:
            try:
                n = self._sock.recv_into(view[got:])
            except TimeoutError as exc:
                raise HandoffError(f"receiving {what}: no data for {self._sock.gettimeout()} s "
                                   f"({got} of {total} bytes)") from exc
            except OSError as exc:
                raise HandoffError(f"receiving {what}: connection lost ({exc})") from exc
            if n == 0:
                raise HandoffError(f"receiving {what}: the sender closed the connection after "
                                   f"{got} of {total} bytes")
            got += n


class _BufferReader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def read_exact(self, n: int, what: str) -> bytes:
        return bytes(self._take(n, what))

    def read_into(self, view: memoryview, what: str) -> None:
        view[:] = self._take(len(view), what)

    def _take(self, n: int, what: str) -> memoryview:
        if self._pos + n > len(self._view):
            raise HandoffError(f"snapshot truncated while reading {what}: need {n} bytes at offset "
                               f"{self._pos}, have {len(self._view) - self._pos}")
        piece = self._view[self._pos:self._pos + n]
        self._pos += n
        return piece


@dataclass
class _Frame:
    bundle: StateBundle
    specs: list[TensorSpec]
    nbytes: int
    chunks: int
    checksum: str


def _read_frame(reader: _Reader, pipelined: bool, mac: FrameMac | None = None,
                max_bytes: int | None = None) -> _Frame:
    """Read and verify one frame. Raises ChecksumError on any mismatch, HandoffError otherwise.

    With ``mac`` (an authenticated stream) the frame's checksum must be that HMAC and its full tag, read after
    the trailer, must match; ``max_bytes`` bounds the header and the tensor table before anything is allocated."""
    limit = _MAX_HEAD_BYTES if max_bytes is None else max_bytes
    prefix = reader.read_exact(_PREFIX_LEN, "header")
    (prefix_crc,) = _PREFIX_CRC.unpack_from(prefix, _PREFIX_BODY.size)
    if zlib.crc32(prefix[:_PREFIX_BODY.size]) != prefix_crc:
        if not prefix.startswith(_MAGIC):
            raise HandoffError(f"not a tpassrun handoff stream (starts with {prefix[:8]!r})")
        raise ChecksumError("handoff header corrupted (prefix checksum mismatch)")
    _magic, version, _flags, head_len, head_crc = _PREFIX_BODY.unpack_from(prefix)
    if version != WIRE_VERSION:
        raise HandoffError(f"handoff wire version {version} is not supported (this side speaks {WIRE_VERSION})")
    if head_len > min(limit, _MAX_HEAD_BYTES):
        raise HandoffError(f"handoff header claims {head_len} bytes of meta, refusing (limit {limit})")
    body = reader.read_exact(head_len, "header meta")
    if zlib.crc32(body) != head_crc:
        raise ChecksumError("handoff meta corrupted (meta checksum mismatch)")
    try:
        doc = json.loads(body)
        meta, rows, chunk_bytes = doc["meta"], doc["tensors"], int(doc["chunk_bytes"])
        checksum_name = str(doc["checksum"])
    except (ValueError, KeyError, TypeError) as exc:
        raise HandoffError(f"malformed handoff meta: {exc}") from exc
    if doc.get("v") != WIRE_VERSION:
        raise HandoffError(f"unsupported handoff meta version {doc.get('v')!r}")
    if not isinstance(rows, list):
        raise HandoffError("malformed handoff meta: the tensor table is not a list")
    specs = [TensorSpec.from_json(row) for row in rows]
    announced = head_len + sum(spec.nbytes for spec in specs)
    if max_bytes is not None and announced > max_bytes:
        raise HandoffError(f"the sender announces {announced} bytes of state, more than the {max_bytes} "
                           f"this transfer allows: refusing before allocating")
    if mac is not None:
        if checksum_name != _HMAC_CHECKSUM:
            raise HandoffError(f"an authenticated stream must use {_HMAC_CHECKSUM}, not {checksum_name!r}")
        checksum: _Checksum = mac
    else:
        checksum = _new_checksum(checksum_name)
    with _Pipelined(checksum) if pipelined else contextlib.nullcontext(checksum) as crc:
        crc.feed(prefix)
        crc.feed(body)
        tensors, chunks, data_len = _read_tensors(reader, specs, chunk_bytes, crc)
        expected = crc.result()
    trailer = reader.read_exact(_TRAILER.size, "trailer")
    end_magic, sent_len, sent_crc = _TRAILER.unpack(trailer)
    if mac is not None:
        mac.feed(trailer)
        if not hmac.compare_digest(reader.read_exact(_TAG_LEN, "the frame's tag"), mac.tag()):
            raise ChecksumError(f"handoff data corrupted or forged: {_HMAC_CHECKSUM} tag mismatch "
                                f"({data_len} bytes received, sender says {sent_len})")
    if end_magic != _END_MAGIC or sent_len != data_len or sent_crc != expected:
        raise ChecksumError(f"handoff data corrupted: {checksum_name} {expected:08x} received, sender says "
                            f"{sent_crc:08x} ({data_len} bytes received, sender says {sent_len})")
    nbytes = _PREFIX_LEN + head_len + data_len + _TRAILER.size + (_TAG_LEN if mac is not None else 0)
    return _Frame(StateBundle(meta, tensors), specs, nbytes, chunks, f"{checksum_name}:{expected:08x}")


def _read_tensors(reader: _Reader, specs: list[TensorSpec], chunk_bytes: int,
                  crc: _Checksum) -> tuple[list[torch.Tensor], int, int]:
    global _arena
    chunk_bytes = chunk_bytes if chunk_bytes > 0 else _DEFAULT_CHUNK
    tensors, chunks, data_len = [], 0, 0
    arena = None
    if isinstance(reader, _SocketReader):   # a reservation serves one transfer; in-memory frames never use it
        arena, _arena = _arena, None
    for index, spec in enumerate(specs):
        tensor, view = _allocate(spec, arena)
        for offset in range(0, len(view), chunk_bytes):
            piece = view[offset:offset + chunk_bytes]
            reader.read_into(piece, f"tensor #{index} ({spec.dtype}{list(spec.shape)})")
            crc.feed(piece)
            chunks += 1
        data_len += len(view)
        tensors.append(tensor.requires_grad_(spec.requires_grad))
    return tensors, chunks, data_len


# ---------------------------------------------------------------------------------------------
# in-memory frames: the per-step light snapshot


def encode_small(bundle: StateBundle) -> bytes:
    """The bundle as one self-checking frame in memory (meant for RNG + small objects)."""
    return b"".join(encode_parts(bundle))


def encode_parts(bundle: StateBundle) -> list[Any]:
    """:func:`encode_small`'s frame as its pieces (head, each tensor's memory as is, trailer), nothing joined:
    a sender that streams it (the shard mirror's pusher thread) never copies the tensors once more. The caller
    keeps the bundle's tensors alive and unchanged until the pieces are sent. ``decode_small`` reads the
    pieces joined."""
    outgoing = [_outgoing(t) for t in bundle.tensors]
    head = _encode_head(bundle.meta, [spec for spec, _, _ in outgoing], chunk_bytes=0, checksum="crc32")
    views = [view for _, _, view in outgoing]
    crc = zlib.crc32(head)  # == crc32 fed the prefix, then the body, as the reader does
    for view in views:
        crc = zlib.crc32(view, crc)
    trailer = _TRAILER.pack(_END_MAGIC, sum(len(v) for v in views), crc)
    return [head, *views, trailer]


def decode_small(data: bytes | bytearray | memoryview) -> StateBundle:
    """Inverse of :func:`encode_small`. Raises ChecksumError if the frame is torn or corrupted.

    Bytes after the trailer are ignored: the frame delimits itself, so a fixed-size
    shared-memory slot can be decoded as it is.
    """
    return _read_frame(_BufferReader(data), pipelined=False).bundle


# ---------------------------------------------------------------------------------------------
# streaming over a connected socket


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


def send_bundle(sock: socket.socket, bundle: StateBundle, *, chunk_bytes: int = _DEFAULT_CHUNK,
                checksum: str = _STREAM_CHECKSUM, auth: TransferAuth | None = None,
                _corrupt_byte_at: int | None = None) -> TransferStats:
    """Stream ``bundle`` over a connected socket and wait for the receiver's verdict.

    Returns only once the receiver has verified the checksum. Raises ChecksumError if the
    receiver saw corrupted data, HandoffError if the connection failed or stalled longer
    than the socket's timeout. ``checksum`` is "blocksum64" (default, memory-bandwidth fast)
    or "crc32" (stronger, ~2 GB/s per core); the receiver follows the header. ``_corrupt_byte_at`` (tests only) flips the byte at that
    offset of the frame on the wire while checksumming the original. With ``auth`` the receiver must prove
    the swap's key before a byte of state goes out (:class:`AuthError` otherwise) and the frame is
    authenticated with HMAC-SHA256.
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    started = time.perf_counter()
    mac = _sender_handshake(sock, auth) if auth is not None else None
    if mac is not None:
        checksum = _HMAC_CHECKSUM
    outgoing = [_outgoing(t) for t in bundle.tensors]
    head = _encode_head(bundle.meta, [spec for spec, _, _ in outgoing], chunk_bytes, checksum)
    sender = _Sender(sock, _corrupt_byte_at)
    chunks = 0
    with _Pipelined(mac if mac is not None else _new_checksum(checksum)) as crc:
        crc.feed(head[:_PREFIX_LEN])  # the same pieces the receiver will feed
        crc.feed(head[_PREFIX_LEN:])
        sender.send(head, "header")
        data_len = 0
        for index, (spec, _keepalive, view) in enumerate(outgoing):
            for offset in range(0, len(view), chunk_bytes):
                piece = view[offset:offset + chunk_bytes]
                crc.feed(piece)  # checksum this chunk while the kernel copies it
                sender.send(piece, f"tensor #{index} ({spec.dtype}{list(spec.shape)})")
                chunks += 1
            data_len += len(view)
        result = crc.result()
    trailer = _TRAILER.pack(_END_MAGIC, data_len, result)
    if mac is not None:
        mac.feed(trailer)
        trailer += mac.tag()
    sender.send(trailer, "trailer")
    reply = _SocketReader(sock).read_exact(_ACK.size, "the receiver's acknowledgement")
    magic, status = _ACK.unpack(reply)
    if magic != _ACK_MAGIC:
        raise HandoffError(f"unexpected acknowledgement {reply!r} from the receiver")
    if status == _ACK_CHECKSUM_MISMATCH:
        raise ChecksumError("the receiver reported a checksum mismatch: the state was corrupted in transit")
    if status != _ACK_OK:
        raise HandoffError(f"the receiver rejected the state (status {status})")
    return TransferStats(sender.offset, time.perf_counter() - started, chunks, f"{checksum}:{result:08x}")


def recv_bundle(sock: socket.socket, *, device: str = "cpu", auth: TransferAuth | None = None,
                max_bytes: int | None = None) -> tuple[StateBundle, TransferStats]:
    """Receive one bundle from a connected socket, verify it, acknowledge it.

    Tensors that lived on an accelerator on the sender are moved to ``device``; CPU tensors
    (RNG states, optimizer ``step`` counters) stay on the CPU, as they were.
    Raises ChecksumError on corruption, HandoffError on a lost or stalled connection, AuthError when the
    peer does not prove ``auth``'s key (checked before anything else is read).
    """
    started = time.perf_counter()
    mac = None
    if auth is not None:
        stream_timeout = sock.gettimeout()
        sock.settimeout(_HANDSHAKE_TIMEOUT_S if stream_timeout is None else min(stream_timeout, _HANDSHAKE_TIMEOUT_S))
        mac = _receiver_handshake(sock, auth)
        sock.settimeout(stream_timeout)
    try:
        frame = _read_frame(_SocketReader(sock), pipelined=True, mac=mac, max_bytes=max_bytes)
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
        listener.listen(8)     # strangers may queue ahead of the sender: it must still get in
    except OSError:
        listener.close()
        raise
    return listener, listener.getsockname()[1]


def connect_and_send(addr: str, port: int, bundle: StateBundle, *, timeout: float,
                     chunk_bytes: int = _DEFAULT_CHUNK, auth: TransferAuth | None = None,
                     _corrupt_byte_at: int | None = None) -> TransferStats:
    """Connect to a joiner and stream ``bundle``. ``timeout`` bounds the connect and every stall."""
    try:
        sock = socket.create_connection((addr, port), timeout=timeout)
    except OSError as exc:
        raise HandoffError(f"cannot connect to the joiner at {addr}:{port}: {exc}") from exc
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return send_bundle(sock, bundle, chunk_bytes=chunk_bytes, auth=auth, _corrupt_byte_at=_corrupt_byte_at)


def accept_and_recv(listener: socket.socket, *, timeout: float, device: str = "cpu",
                    auth: TransferAuth | None = None, max_bytes: int | None = None,
                    strangers: list[str] | None = None) -> tuple[StateBundle, TransferStats]:
    """Accept senders on ``listener`` until one proves ``auth`` (strangers are dropped and noted in
    ``strangers``), and receive its bundle. ``timeout`` bounds the whole wait for the sender and every stall
    of the stream. The listener stays open (the caller owns it)."""
    deadline = time.monotonic() + timeout
    while True:
        conn = accept_one(listener, deadline - time.monotonic())
        with conn:
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                return recv_bundle(conn, device=device, auth=auth, max_bytes=max_bytes)
            except AuthError as exc:
                log.warning("handoff: dropped a connection that did not prove the swap key: %s", exc)
                if strangers is not None:
                    strangers.append(str(exc))


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
