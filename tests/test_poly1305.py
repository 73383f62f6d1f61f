"""Poly1305 from the host's OpenSSL (tpassrun/poly1305.py): the RFC 8439 vectors, pieces read in place, one-time
keys per frame, and the handoff's choice of frame MAC (the fastest this host has; a receiver without Poly1305
says so in one line)."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tpassrun import handoff_wire, poly1305
from tpassrun.handoff import HandoffError, StateBundle, TransferAuth, recv_bundle, send_bundle

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not poly1305.available(), reason=f"no Poly1305: {poly1305.unavailable_reason()}")]


def test_rfc8439_vectors():
    # 2.5.2 (also checked when the binding loads) and A.3 #2 (a 375-byte text under s-only key)
    assert poly1305.tag(bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b"),
                        [b"Cryptographic Forum Research Group"]).hex() == "a8061dc1305136c6c22b8baf0c0127a9"
    text = (b"Any submission to the IETF intended by the Contributor for publication as all or part of an IETF "
            b"Internet-Draft or RFC and any statement made within the context of an IETF activity is considered "
            b"an \"IETF Contribution\". Such statements include oral statements in IETF sessions, as well as "
            b"written and electronic communications made at any time or place, which are addressed to")
    key = bytes(16) + bytes.fromhex("36e5f6b5c5e06070f0efca96227a863e")
    assert poly1305.tag(key, [text]).hex() == "36e5f6b5c5e06070f0efca96227a863e"


def test_pieces_are_read_in_place_and_equal_the_joined_message():
    tensor = torch.arange(10_000, dtype=torch.float32)
    view = memoryview(tensor.numpy()).cast("B")
    key = bytes(range(32))
    joined = b"head" + bytes(view) + bytes(view[:7])
    assert poly1305.tag(key, [b"head", view, memoryview(bytes(view[:7]))]) == poly1305.tag(key, [joined])
    assert poly1305.tag(key, [b"", view[:0], joined]) == poly1305.tag(key, [joined])
    tensor[5] += 1            # the tag follows the memory, not a copy of it
    assert poly1305.tag(key, [b"head", view, bytes(view[:7])]) != poly1305.tag(key, [joined])
    with pytest.raises(ValueError):
        poly1305.tag(key[:16], [joined])


def test_frame_keys_are_one_time():
    auth = TransferAuth(b"k" * 32, "swap-1", 3)
    mac = auth.frame_mac(b"r" * 32, b"s" * 32)
    keys = {mac.one_time_key(b"data" + i.to_bytes(8, "little")) for i in range(100)}
    assert len(keys) == 100
    other = auth.frame_mac(b"r" * 32, b"t" * 32)          # another connection: other keys for the same frames
    assert other.one_time_key(b"data" + bytes(8)) not in keys
    assert handoff_wire._frame_mac_name(None) == "poly1305"


def test_a_receiver_without_poly1305_refuses_in_one_line(monkeypatch):
    sender_sock, receiver_sock = socket.socketpair()
    main = threading.main_thread()
    monkeypatch.setattr(poly1305, "available", lambda: threading.current_thread() is not main)
    auth = TransferAuth(b"k" * 32, "swap-1", 0)
    bundle = StateBundle({"step": 1}, [torch.ones(100)])
    with sender_sock, receiver_sock:
        receiver_sock.settimeout(10)
        sender_sock.settimeout(10)
        t = threading.Thread(target=lambda: pytest.raises(HandoffError, send_bundle, sender_sock, bundle, auth=auth,
                                                          frame_mac="poly1305"))
        t.start()
        with pytest.raises(HandoffError, match="poly1305, which this host's OpenSSL lacks"):
            recv_bundle(receiver_sock, auth=auth)
        receiver_sock.close()
        t.join(30)
    assert not t.is_alive()
