"""GMAC frame tags (tpassrun/transfer/gmac.py; issue 27 item 7, authentication at line rate): the frame MAC was most of
what an authenticated transfer cost over raw TCP, and GHASH runs at about twice Poly1305's speed here. A tampered
GMAC'd stream is refused like the others (tests/test_security.py's FRAME_MACS)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tpassrun.transfer import gmac
from tpassrun.transfer import wire
from tpassrun.transfer.auth import FLAG_GMAC, FLAG_POLY1305
from tpassrun.transfer.handoff import StateBundle, TransferAuth, recv_bundle, send_bundle

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not gmac.available(), reason=f"no GMAC here: {gmac.unavailable_reason()}")]


def test_the_tag_is_standard_gmac_over_the_pieces_read_in_place():
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = bytes(range(32))
    tensor = torch.arange(1000, dtype=torch.float32)
    view = memoryview(tensor.numpy()).cast("B")
    joined = b"label" + bytes(view)
    want = AESGCM(key).encrypt(b"\0\0\0\0" + (7).to_bytes(8, "little"), b"", joined)     # GMAC: GCM, no plaintext
    assert gmac.tag(key, 7, [b"label", view]) == want == gmac.tag(key, 7, [b"", b"label", view[:0], view])
    assert gmac.tag(key, 8, [b"label", view]) != want                     # another frame's nonce, another tag
    tensor[3] += 1                                                        # the tag follows the memory
    assert gmac.tag(key, 7, [b"label", view]) != want
    with pytest.raises(ValueError):
        gmac.tag(key[:16], 7, [b"x"])


def test_a_sender_picks_gmac_where_the_receiver_offers_it_else_poly1305():
    assert wire._frame_mac_name(None, FLAG_GMAC | FLAG_POLY1305) == "gmac-aes-256"
    if wire.poly1305_here():
        assert wire._frame_mac_name(None, FLAG_POLY1305) == "poly1305"
    assert wire._frame_mac_name(None, 0) == "hmac-sha256"


@pytest.mark.parametrize("frame_mac", [None, "gmac-aes-256"])
def test_a_gmac_stream_arrives_equal(frame_mac):
    auth = TransferAuth(b"k" * 32, "swap-g", 2)
    bundle = StateBundle({"step": 4}, [torch.arange(300_001, dtype=torch.float64), torch.ones(77)])
    a, b = socket.socketpair()
    sent: dict = {}
    with a, b:
        a.settimeout(30)
        b.settimeout(30)
        t = threading.Thread(target=lambda: sent.setdefault("s", send_bundle(a, bundle, auth=auth, chunk_bytes=1 << 18,
                                                                             frame_mac=frame_mac)))
        t.start()
        got, stats = recv_bundle(b, auth=auth)
        t.join(30)
    assert stats.checksum.startswith("gmac-aes-256:") and sent["s"].checksum == stats.checksum and stats.chunks > 9
    assert all(torch.equal(x, y) for x, y in zip(got.tensors, bundle.tensors))
