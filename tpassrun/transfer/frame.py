"""The handoff frame: how a :class:`StateBundle` is laid out as bytes, checked, and read back into tensors.

One frame, all integers little endian::

    prefix   24 B  b"TPHO" | u16 version | u16 flags | u64 head_len | u32 crc32(head) | u32 crc32(first 20 B)
    head     head_len B of UTF-8 JSON: {"v": 1, "meta": <bundle meta>, "tensors": [spec, ...], "chunk_bytes": int,
                                        "checksum": "blocksum64" | "crc32" | "gmac-aes-256" | "aes-256-gcm"}
    data     the raw bytes of every tensor, in table order, in chunks of ``chunk_bytes``
    trailer  16 B  b"TPEN" | u64 data_len | u32 checksum of prefix + head + data

The head carries its own checksum so a corrupted tensor table is caught before we allocate from it; the
trailer's checksum covers everything. An authenticated stream (``gmac-aes-256``, or ``aes-256-gcm`` encrypted) adds tags
between these parts and cuts the data into frames of its own: :mod:`tpassrun.transfer.wire` reads and writes that
layout with the building blocks here.

Tensors go out straight from their memory (``memoryview`` of a uint8 view, no ``torch.save``, no pickle) and
come in through ``recv_into`` preallocated tensors (carved from a spare's pre-faulted arena when it has one).
The checksum runs in a helper thread on chunk i while chunk i+1 is on the wire (it and the socket calls
release the GIL, so the two overlap instead of adding up); see ``_BlockSum64`` for why streams do not use
crc32. ``encode_small``/``decode_small`` use the very same frame in memory (no thread) for the per-step
"light" snapshot a worker leaves in shared memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import socket
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tpassrun.transfer.codec import ChecksumError, HandoffError, StateBundle, dtype_from_name

try:
    import numpy as np
except ImportError:  # pragma: no cover - then streams fall back to crc32
    np = None  # type: ignore[assignment]

WIRE_VERSION = 1
_MAGIC = b"TPHO"
_END_MAGIC = b"TPEN"
_PREFIX_BODY = struct.Struct("<4sHHQI")  # magic, version, flags, head_len, head_crc
_PREFIX_CRC = struct.Struct("<I")
_PREFIX_LEN = _PREFIX_BODY.size + _PREFIX_CRC.size
_TRAILER = struct.Struct("<4sQI")  # end magic, data_len, crc of everything before the trailer
_MAX_HEAD_BYTES = 1 << 30  # a corrupt length must not make us allocate the moon
_DEFAULT_CHUNK = 8 << 20
_HUGE_PAGE_MIN_BYTES = 4 << 20
_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # built once: this runs every step


@dataclass(frozen=True)
class TensorSpec:
    """One row of the tensor table: enough to preallocate the receiving tensor."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    device: str  # device *type* on the sender; anything but "cpu" comes back on the receiver's ``device``
    requires_grad: bool

    def to_json(self) -> dict[str, Any]:
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


def _encode_head(meta: dict[str, Any], specs: list[TensorSpec], chunk_bytes: int, checksum: str) -> bytes:
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


_CHECKSUMS: dict[str, type[_Checksum]] = {"crc32": _Crc32}
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


@dataclass(frozen=True)
class _Head:
    prefix: bytes
    body: bytes
    meta: Any
    specs: list[TensorSpec]
    chunk_bytes: int
    checksum: str


def _read_prefix(reader: _Reader, limit: int) -> tuple[bytes, int, int]:
    """The 24-byte prefix, checked: ``(prefix, head_len, head_crc)``; ``head_len`` is bounded by ``limit``."""
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
    return prefix, head_len, head_crc


def _parse_head(prefix: bytes, body: bytes, head_crc: int, max_bytes: int | None) -> _Head:
    """The head's JSON, checked: the tensor table valid and the whole announced size within ``max_bytes``
    (before anything is allocated from it)."""
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
    announced = len(body) + sum(spec.nbytes for spec in specs)
    if max_bytes is not None and announced > max_bytes:
        raise HandoffError(f"the sender announces {announced} bytes of state, more than the {max_bytes} "
                           f"this transfer allows: refusing before allocating")
    return _Head(prefix, body, meta, specs, chunk_bytes, checksum_name)


def _read_frame(reader: _Reader, pipelined: bool, max_bytes: int | None = None) -> _Frame:
    """Read and verify one (unauthenticated) frame. Raises ChecksumError on any mismatch, HandoffError
    otherwise. ``max_bytes`` bounds the header and the tensor table before anything is allocated."""
    prefix, head_len, head_crc = _read_prefix(reader, _MAX_HEAD_BYTES if max_bytes is None else max_bytes)
    head = _parse_head(prefix, reader.read_exact(head_len, "header meta"), head_crc, max_bytes)
    with _Pipelined(_new_checksum(head.checksum)) if pipelined else \
            contextlib.nullcontext(_new_checksum(head.checksum)) as crc:
        crc.feed(prefix)
        crc.feed(head.body)
        tensors, chunks, data_len = _read_tensors(reader, head.specs, head.chunk_bytes, crc)
        expected = crc.result()
    end_magic, sent_len, sent_crc = _TRAILER.unpack(reader.read_exact(_TRAILER.size, "trailer"))
    if end_magic != _END_MAGIC or sent_len != data_len or sent_crc != expected:
        raise ChecksumError(f"handoff data corrupted: {head.checksum} {expected:08x} received, sender says "
                            f"{sent_crc:08x} ({data_len} bytes received, sender says {sent_len})")
    nbytes = _PREFIX_LEN + head_len + data_len + _TRAILER.size
    return _Frame(StateBundle(head.meta, tensors), head.specs, nbytes, chunks, f"{head.checksum}:{expected:08x}")


def _allocate_all(specs: list[TensorSpec], *, use_arena: bool) -> tuple[list[torch.Tensor], list[memoryview]]:
    """Receiving tensors for every row of the table (from the spare's arena when ``use_arena``: a reservation
    serves one transfer), and their memory as writable views."""
    global _arena
    arena = None
    if use_arena:
        arena, _arena = _arena, None
    tensors, views = [], []
    for spec in specs:
        tensor, view = _allocate(spec, arena)
        tensors.append(tensor.requires_grad_(spec.requires_grad))
        views.append(view)
    return tensors, views


def _frames(views: list[memoryview], frame_bytes: int) -> list[list[memoryview]]:
    """The data stream (every view, in order) cut into frames of ``frame_bytes`` (the last one shorter): each
    frame the list of pieces of views it covers. Both ends cut the same way from the same table."""
    frames: list[list[memoryview]] = []
    current: list[memoryview] = []
    room = frame_bytes
    for view in views:
        offset = 0
        while offset < len(view):
            take = min(room, len(view) - offset)
            current.append(view[offset:offset + take])
            offset += take
            room -= take
            if room == 0:
                frames.append(current)
                current, room = [], frame_bytes
    if current:
        frames.append(current)
    return frames


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


