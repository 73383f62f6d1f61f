"""The data frames' tags of a signed state transfer (:mod:`tpassrun.transfer.wire`'s layout), computed off the
socket's thread and overlapped with the wire.

Sender (:class:`TagAhead`): while frame k is on the wire, a worker thread tags frame k+1 (and no further ahead than
:data:`AHEAD_BYTES`: a frame tagged just before it is sent is still in the shared cache when the kernel copies it
into the socket, so its memory is fetched once, not twice); frame k then leaves with its tag in one ``sendmsg``.
Receiver (:class:`Verifier`): frame k's tag is checked by a worker while frame k+1 arrives (recv_into just wrote
frame k, so the check reads it from the cache); every check is done before anything is returned. GMAC
(:mod:`tpassrun.transfer.gmac`, OpenSSL through ``cryptography``) releases the GIL for buffers of 2 KiB and more,
so the socket's thread never waits for one.

Keys (:class:`FrameTagger`): one GMAC key per connection (its nonce is the frame's index), derived once from the
connection's MAC. The tag of frame i covers ``"data" | u64 i | u64 length | frame``: its position and length are
bound, so frames cannot be reordered, cut or spliced from another stream (another connection has other keys).
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tpassrun.transfer import gmac
from tpassrun.transfer.auth import FrameMac
from tpassrun.transfer.seal import _FRAME_INDEX, _expect, mac_threads

GMAC_NAME = gmac.NAME
AHEAD_BYTES = 8 << 20     # how far the sender's tags run ahead of the wire: within the cache, at least one frame


class FrameTagger:
    """GMAC frame tags of one connection; :meth:`tag` is safe to call from many threads."""

    name = GMAC_NAME

    def __init__(self, mac: FrameMac) -> None:
        self._key = mac.one_time_key(b"gmac-data")    # this connection's data frames only; the nonce is the index

    def tag(self, index: int, pieces: list[memoryview]) -> bytes:
        label = b"data" + _FRAME_INDEX.pack(index, sum(len(p) for p in pieces))
        return gmac.tag(self._key, index, [label, *pieces])


class TagAhead:
    """The sender's tags, in frame order, each computed by the pool before its frame is sent, at most
    ``ahead_bytes`` (and at least one frame) ahead of the frame being sent."""

    def __init__(self, tagger: FrameTagger, frames: list[list[memoryview]], ahead_bytes: int | None = None,
                 threads: int | None = None) -> None:
        self._tagger, self._frames = tagger, frames
        largest = max((sum(len(p) for p in f) for f in frames), default=1)
        self._ahead = max(1, (AHEAD_BYTES if ahead_bytes is None else ahead_bytes) // max(1, largest))
        self._pool = ThreadPoolExecutor(threads or mac_threads(), thread_name_prefix="tpassrun-handoff-mac")
        self._queued: collections.deque[Future[bytes]] = collections.deque()
        self._submitted = 0

    def __enter__(self) -> "TagAhead":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def submitted(self) -> int:
        """How many frames' tags were asked of the pool so far (frames 0 .. submitted - 1)."""
        return self._submitted

    def tag(self, index: int) -> bytes:
        """Frame ``index``'s tag (frames are asked for in order); frames up to ``index + ahead`` are being tagged
        meanwhile."""
        while self._submitted < len(self._frames) and self._submitted <= index + self._ahead:
            self._queued.append(self._pool.submit(self._tagger.tag, self._submitted, self._frames[self._submitted]))
            self._submitted += 1
        return self._queued.popleft().result()


class Verifier:
    """The receiver's checks: :meth:`check` queues frame ``index``'s (its memory must stay unchanged until
    :meth:`wait`), :meth:`wait` raises :class:`ChecksumError` for the first frame whose tag does not verify."""

    def __init__(self, tagger: FrameTagger, threads: int | None = None) -> None:
        self._tagger = tagger
        self._pool = ThreadPoolExecutor(threads or mac_threads(), thread_name_prefix="tpassrun-handoff-mac")
        self._checks: list[tuple[Future[bytes], bytes]] = []

    def __enter__(self) -> "Verifier":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def check(self, index: int, pieces: list[memoryview], tag: bytes) -> None:
        self._checks.append((self._pool.submit(self._tagger.tag, index, pieces), tag))

    def wait(self) -> None:
        for index, (check, tag) in enumerate(self._checks):
            _expect(check, tag, index)


def send_parts(sock: Any, parts: list[Any]) -> None:
    """``sendall`` of the concatenation of ``parts`` (buffers, read in place) in as few ``sendmsg`` calls as the
    socket takes: a frame and its tag leave together, not as one more small segment each."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


_IOV_MAX = 512


__all__ = ["AHEAD_BYTES", "FrameTagger", "GMAC_NAME", "TagAhead", "Verifier", "send_parts"]
