"""The encrypted layout of a state transfer (``--rdzv-conf encrypt=true``), and what it shares with the signed
one (:mod:`tpassrun.transfer.wire`: the connection's MAC over labelled pieces, the trailer, the pool's size).

The signed layout with the head's meta and every frame under AES-256-GCM (:class:`~tpassrun.transfer.auth.FrameCipher`,
keyed for the connection from its HMAC handshake)::

    prefix | AEAD(head meta) | head tag        the head tag (HMAC) over the prefix and the sealed meta
    AEAD_i(frame i) (ciphertext | GCM tag)     nonce: i; associated data: "data" | u64 i | u64 length
    trailer | end tag                          MAC("end" | trailer | every GCM tag)

Both ends read the run's setting (``TPASSRUN_ENCRYPT``, :func:`encryption_wanted`); the receiver's hello says it
(``FLAG_ENCRYPT``), so a sender whose run encrypts never sends in clear, and a receiver that expects encryption
refuses a stream in clear.
"""

from __future__ import annotations

import collections
import hmac
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from tpassrun.transfer.auth import (  # noqa: F401
    AEAD_NAME,
    AEAD_TAG_LEN,
    FLAG_ENCRYPT,
    FLAG_GMAC,
    TAG_LEN,
    FrameCipher,  # re-exported
    FrameMac,
    aead_unavailable_reason,
    encryption_wanted,
)
from tpassrun.transfer.codec import ChecksumError, HandoffError, StateBundle
from tpassrun.transfer.frame import _END_MAGIC, _PREFIX_LEN, _allocate_all, _Frame, _frames, _SocketReader

_FRAME_INDEX = struct.Struct("<QQ")           # frame number, frame length
_AUTH_TRAILER = struct.Struct("<4sQQ")         # end magic, data length, frame count


def mac_threads() -> int:
    """Threads that tag or seal a transfer's frames: the cores this process may run on now (its affinity: taskset,
    a cgroup's cpuset, not the machine's count), at most 4."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):     # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


_MAC_THREADS = mac_threads()      # at import: how far sealed frames run ahead (the ring's size) is fixed per process


def _tag(mac: FrameMac, label: bytes, pieces: list[Any]) -> bytes:
    """The connection's MAC over ``label`` and ``pieces`` (``mac`` is a fresh copy: the pool runs these)."""
    mac.feed(label)
    for piece in pieces:
        mac.feed(piece)
    return mac.tag()


def _expect(check: Future[bytes], tag: bytes, index: int) -> None:
    if not hmac.compare_digest(check.result(), tag):
        raise ChecksumError(f"handoff data corrupted or forged: frame #{index}'s tag mismatch")


def listener_flags(encrypt: bool) -> int:
    """What a receiver's hello says: GMAC frame tags (always); FLAG_ENCRYPT when its run encrypts."""
    flags = FLAG_GMAC
    if encrypt:
        why = aead_unavailable_reason()
        if why is not None:
            raise HandoffError(f"this run encrypts its transfers (--rdzv-conf encrypt=true), but {why}")
        flags |= FLAG_ENCRYPT
    return flags


def sender_encrypts(encrypt: bool, peer_flags: int) -> bool:
    """A sender encrypts when its run does or the receiver's does; a sender whose run encrypts sends nothing
    to a receiver that would not decrypt."""
    if encrypt and not peer_flags & FLAG_ENCRYPT:
        raise HandoffError("this run encrypts its transfers (--rdzv-conf encrypt=true) and the receiver does not "
                           "decrypt: nothing was sent")
    if peer_flags & FLAG_ENCRYPT:
        why = aead_unavailable_reason()
        if why is not None:
            raise HandoffError(f"the receiver's run encrypts its transfers, but here {why}: nothing was sent")
        return True
    return False


def send_sealed(sender: Any, mac: FrameMac, name: str, head: bytes, views: list[memoryview],
                 frame_bytes: int) -> tuple[int, int]:
    """The encrypted layout (``--rdzv-conf encrypt=true``): the signed layout with the head's meta and every
    frame under AES-256-GCM (:class:`~tpassrun.transfer.auth.FrameCipher`, keyed for this connection; the frame's
    index is its nonce, its label the associated data); the GCM tag is the frame's tag. The pool encrypts
    frames ahead of the socket into their own buffers (the tensors are never written)."""
    cipher = FrameCipher(mac.one_time_key(b"aead"))
    prefix = head[:_PREFIX_LEN]
    sealed_head = cipher.seal(_HEAD_NONCE, b"head" + prefix, head[_PREFIX_LEN:])
    sender.send(prefix + sealed_head + _tag(mac.copy(), b"head", [prefix, sealed_head]), "header")
    frames = _frames(views, frame_bytes)
    tags: list[bytes] = []
    ring = _Ring(frames)
    with ThreadPoolExecutor(mac_threads(), thread_name_prefix="tpassrun-handoff-aead") as pool:
        ahead: collections.deque[Future[memoryview]] = collections.deque()
        queued = 0
        for index in range(len(frames)):
            while queued < len(frames) and queued <= index + _AHEAD:
                ahead.append(pool.submit(_seal_frame, cipher, queued, frames[queued], ring.buffer(queued)))
                queued += 1
            out = ahead.popleft().result()
            sender.send(out, f"frame #{index}")
            tags.append(bytes(out[-AEAD_TAG_LEN:]))
    data_len = sum(len(v) for v in views)
    trailer = _AUTH_TRAILER.pack(_END_MAGIC, data_len, len(frames))
    end = _tag(mac.copy(), b"end", [trailer, *tags])
    sender.send(trailer + end, "trailer")
    return len(frames), int.from_bytes(end[:4], "little")


_HEAD_NONCE = (1 << 64) - 1     # the head's index: never a frame's


def _frame_label(index: int, length: int) -> bytes:
    return b"data" + _FRAME_INDEX.pack(index, length)


_AHEAD = 2 * _MAC_THREADS    # frames sealed ahead of the one being sent
SEALED_FRAME_BYTES = 2 << 20  # a sealed stream's frames: its ring (_AHEAD + 2 of them) fits in the cache (bench/transfer.py)


class _Ring:
    """The buffers sealed frames are written into (sender) or read into (receiver): frame i uses buffer
    i % (_AHEAD + 2), allocated and faulted in once per transfer, not once per frame. Invariant: a buffer is reused
    only once the frame it held was sent (sender: at most _AHEAD frames are sealed ahead of the one on the wire)
    or opened (receiver: :func:`read_sealed` waits for that frame's decryption first)."""

    def __init__(self, frames: list[list[memoryview]]) -> None:
        largest = max((sum(len(p) for p in pieces) for pieces in frames), default=0)
        self._buffers = [bytearray(largest + AEAD_TAG_LEN) for _ in range(min(len(frames), _AHEAD + 2))]

    def buffer(self, index: int, length: int | None = None) -> memoryview:
        buf = self._buffers[index % len(self._buffers)]
        return memoryview(buf)[:len(buf) if length is None else length]


def _seal_frame(cipher: FrameCipher, index: int, pieces: list[memoryview], out: memoryview) -> memoryview:
    length = sum(len(p) for p in pieces)
    data: Any = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    out = out[:length + AEAD_TAG_LEN]
    cipher.seal_into(index, _frame_label(index, length), data, out)
    return out


def _open_frame(cipher: FrameCipher, index: int, sealed: memoryview, pieces: list[memoryview]) -> bytes:
    """Decrypt frame ``index`` into its tensors' bytes (straight into a single piece); its tag, for the end
    tag's check. A forged or altered frame is a ChecksumError."""
    length = len(sealed) - AEAD_TAG_LEN
    if len(pieces) == 1:
        cipher.open_into(index, _frame_label(index, length), sealed, pieces[0])
    else:
        plain = bytearray(length)
        cipher.open_into(index, _frame_label(index, length), sealed, plain)
        at = 0
        for piece in pieces:
            piece[:] = plain[at:at + len(piece)]
            at += len(piece)
    return bytes(sealed[-AEAD_TAG_LEN:])


def open_head(cipher: FrameCipher, prefix: bytes, sealed: bytes) -> bytes:
    """The head's meta, decrypted (a ChecksumError when it was forged or altered)."""
    return cipher.open(_HEAD_NONCE, b"head" + prefix, sealed)


def read_sealed(reader: _SocketReader, mac: FrameMac, cipher: FrameCipher, head_len: int, head: Any) -> _Frame:
    """The encrypted frames: each read whole into its own buffer, decrypted by the pool into the tensors while
    the next one arrives."""
    if not 0 < head.chunk_bytes <= 1 << 30:
        raise HandoffError(f"an encrypted stream with {head.chunk_bytes}-byte frames, refusing")
    tensors, views = _allocate_all(head.specs, use_arena=True)
    frames = _frames(views, head.chunk_bytes)
    tags: list[bytes] = []
    ring = _Ring(frames)
    with ThreadPoolExecutor(mac_threads(), thread_name_prefix="tpassrun-handoff-aead") as pool:
        checks: list[Future[bytes]] = []
        for index, pieces in enumerate(frames):
            if index >= _AHEAD + 2:
                wait([checks[index - _AHEAD - 2]])    # that frame's buffer is this one's: opened first
            sealed = ring.buffer(index, sum(len(p) for p in pieces) + AEAD_TAG_LEN)
            reader.read_into(sealed, f"frame #{index} of {len(frames)}")
            tags.append(bytes(sealed[-AEAD_TAG_LEN:]))
            checks.append(pool.submit(_open_frame, cipher, index, sealed, pieces))
        trailer = reader.read_exact(_AUTH_TRAILER.size, "trailer")
        end = reader.read_exact(TAG_LEN, "the end tag")
        for index, check in enumerate(checks):
            _expect(check, tags[index], index)
    end_magic, data_len, count = _AUTH_TRAILER.unpack(trailer)
    if not hmac.compare_digest(end, _tag(mac.copy(), b"end", [trailer, *tags])) or end_magic != _END_MAGIC \
            or count != len(frames) or data_len != sum(len(v) for v in views):
        raise ChecksumError(f"handoff stream corrupted or forged: end tag mismatch ({len(frames)} frames "
                            f"received, the sender says {count})")
    nbytes = (_PREFIX_LEN + head_len + AEAD_TAG_LEN + TAG_LEN + data_len + AEAD_TAG_LEN * len(frames)
              + _AUTH_TRAILER.size + TAG_LEN)
    return _Frame(StateBundle(head.meta, tensors), head.specs, nbytes, len(frames),
                  f"{AEAD_NAME}:{int.from_bytes(end[:4], 'little'):08x}")
