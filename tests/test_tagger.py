"""The frame tags of a signed transfer off the socket's thread (tpassrun/transfer/tagger.py; issue 27 item 7,
authentication at line rate): the sender tags frame k+1 while frame k is on the wire, a bounded distance ahead (a
tag computed 40 MB ahead of its frame left the frame out of the cache by the time the kernel copied it), and a frame
leaves with its tag in one sendmsg; the receiver checks every frame before anything is returned. The stream's
layout is unchanged (tests/test_security.py flips a byte in every part of it)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tpassrun.transfer import gmac, tagger
from tpassrun.transfer.auth import TransferAuth
from tpassrun.transfer.codec import ChecksumError, StateBundle
from tpassrun.transfer.frame import _frames
from tpassrun.transfer.wire import recv_bundle, send_bundle

pytestmark = pytest.mark.timeout(60)
AUTH = TransferAuth(b"t" * 32, "swap-t", 1)


def _frames_of(sizes: list[int], frame_bytes: int) -> list[list[memoryview]]:
    views = [memoryview(bytearray(bytes([i + 1]) * n)) for i, n in enumerate(sizes)]
    return _frames(views, frame_bytes)


@pytest.mark.parametrize("ahead_bytes, ahead_frames", [(0, 1), (4096, 1), (3 * 4096, 3)])
def test_the_sender_tags_in_order_and_never_further_ahead_than_asked(ahead_bytes, ahead_frames):
    frames = _frames_of([10_000, 3, 20_000], 4096)
    tags = tagger.FrameTagger(AUTH.frame_mac(b"r" * 32, b"s" * 32))
    with tagger.TagAhead(tags, frames, ahead_bytes=ahead_bytes) as ahead:
        for index in range(len(frames)):
            assert ahead.tag(index) == tags.tag(index, frames[index])
            furthest = ahead.submitted - 1
            assert min(index + 1, len(frames) - 1) <= furthest <= index + ahead_frames   # the next frame, no more


def test_gmac_frames_share_one_key_per_connection_and_bind_index_and_length():
    mac = AUTH.frame_mac(b"r" * 32, b"s" * 32)
    tags = tagger.FrameTagger(mac)
    assert tags.name == gmac.NAME == "gmac-aes-256" and len(tags.tag(0, [])) == gmac.TAG_LEN
    piece = memoryview(bytearray(b"x" * 100))
    assert tags.tag(0, [piece]) == tags.tag(0, [piece[:40], piece[40:]])             # pieces read as one frame
    assert len({tags.tag(0, [piece]), tags.tag(1, [piece]), tags.tag(0, [piece[:99]])}) == 3
    other = tagger.FrameTagger(AUTH.frame_mac(b"r" * 32, b"t" * 32))   # another connection
    assert other.tag(0, [piece]) != tags.tag(0, [piece])


def test_the_verifier_names_the_first_frame_that_does_not_verify():
    frames = _frames_of([9000], 4096)
    tags = tagger.FrameTagger(AUTH.frame_mac(b"r" * 32, b"s" * 32))
    good = [tags.tag(i, f) for i, f in enumerate(frames)]
    with tagger.Verifier(tags) as verifier:
        for index, pieces in enumerate(frames):
            verifier.check(index, pieces, good[index] if index != 1 else bytes(len(good[1])))
        with pytest.raises(ChecksumError, match="frame #1's tag mismatch"):
            verifier.wait()


class _Trickle:
    """A socket whose sendmsg takes at most ``most`` bytes a call, from anywhere in the list of buffers."""

    def __init__(self, most: int) -> None:
        self.most, self.got, self.calls = most, bytearray(), 0

    def sendmsg(self, buffers: list[memoryview]) -> int:
        self.calls += 1
        joined = b"".join(bytes(b) for b in buffers)[:self.most]
        self.got += joined
        return len(joined)


@pytest.mark.parametrize("most", [1, 7, 1 << 20])
def test_send_parts_sends_every_byte_once_in_order_whatever_sendmsg_takes(most):
    parts = [memoryview(bytearray(b"a" * 10)), b"", memoryview(bytearray(b"bc" * 9)), b"TAG-16-BYTES...."]
    sock = _Trickle(most)
    tagger.send_parts(sock, parts)
    assert bytes(sock.got) == b"".join(bytes(p) for p in parts)
    assert sock.calls == (1 if most >= 44 else -(-44 // most))


def test_a_frame_spread_over_more_buffers_than_one_sendmsg_takes_arrives_whole():
    parts = [memoryview(bytearray(bytes([i % 251]))) for i in range(1500)]
    sock = _Trickle(1 << 20)
    tagger.send_parts(sock, parts)
    assert bytes(sock.got) == bytes(i % 251 for i in range(1500)) and sock.calls == 3   # 512 buffers a call


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_stream_of_many_small_frames_round_trips_equal(encrypt):
    """40 frames: the sender's tags run ahead and its sealed-frame buffers wrap around several times."""
    tensors = [torch.arange(20_000, dtype=torch.float64), torch.randn(3), torch.arange(17, dtype=torch.int16)]
    bundle = StateBundle({"step": 2}, tensors)
    a, b = socket.socketpair()
    sent: dict[str, object] = {}
    with a, b:
        a.settimeout(30)
        b.settimeout(30)
        t = threading.Thread(target=lambda: sent.setdefault("s", send_bundle(a, bundle, auth=AUTH, chunk_bytes=4096,
                                                                             encrypt=encrypt)))
        t.start()
        got, stats = recv_bundle(b, auth=AUTH, encrypt=encrypt)
        t.join(30)
    assert stats.chunks == 40 and sent["s"].checksum == stats.checksum
    assert all(torch.equal(x, y) for x, y in zip(got.tensors, tensors))
