"""Poly1305 from the host's OpenSSL (tpassrun/transfer/poly1305.py): the RFC 8439 vectors, pieces read in place, one-time
keys per frame, and the handoff's choice of frame MAC (Poly1305 where both ends have it, else HMAC-SHA256 frames
and one line; a receiver without Poly1305 refuses a Poly1305 stream in one line)."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
import torch

from tpassrun.transfer import wire as handoff_wire
from tpassrun.transfer import gmac, poly1305
from tpassrun.transfer.handoff import HandoffError, StateBundle, TransferAuth, recv_bundle, send_bundle

pytestmark = pytest.mark.timeout(60)
needs_poly1305 = pytest.mark.skipif(not poly1305.available(), reason=f"no Poly1305: {poly1305.unavailable_reason()}")


@needs_poly1305
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


@needs_poly1305
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


@needs_poly1305
def test_frame_keys_are_one_time():
    auth = TransferAuth(b"k" * 32, "swap-1", 3)
    mac = auth.frame_mac(b"r" * 32, b"s" * 32)
    keys = {mac.one_time_key(b"data" + i.to_bytes(8, "little")) for i in range(100)}
    assert len(keys) == 100
    other = auth.frame_mac(b"r" * 32, b"t" * 32)          # another connection: other keys for the same frames
    assert other.one_time_key(b"data" + bytes(8)) not in keys
    assert handoff_wire._frame_mac_name(None) == "poly1305"


@needs_poly1305
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


def _transfer(auth: TransferAuth, bundle: StateBundle):
    sender_sock, receiver_sock = socket.socketpair()
    with sender_sock, receiver_sock:
        receiver_sock.settimeout(10)
        sender_sock.settimeout(10)
        sent: dict = {}
        t = threading.Thread(target=lambda: sent.setdefault("stats", send_bundle(sender_sock, bundle, auth=auth)))
        t.start()
        got, stats = recv_bundle(receiver_sock, auth=auth)
        t.join(30)
    assert not t.is_alive() and sent["stats"].checksum == stats.checksum
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, bundle.tensors))
    return stats


def test_without_poly1305_frames_are_hmac_and_one_line_says_why(monkeypatch, caplog):
    """A host whose libcrypto is missing (or has no EVP_MAC Poly1305): the binding fails at load, not at import,
    transfers go on with HMAC-SHA256 frames, and one warning line per process names the reason."""
    def no_libcrypto():
        raise OSError("no OpenSSL 3 libcrypto (libcrypto.so.3: cannot open shared object file)")

    monkeypatch.setattr(gmac, "available", lambda: False)     # nor the faster GMAC (no 'cryptography' either)

    monkeypatch.setattr(poly1305, "_open_libcrypto", no_libcrypto)
    monkeypatch.setattr(poly1305, "_loaded", None)
    monkeypatch.setattr(poly1305, "_failed", None)
    monkeypatch.setattr(handoff_wire, "_poly1305_said", False)
    assert not poly1305.available() and "libcrypto.so.3" in poly1305.unavailable_reason()
    with pytest.raises(RuntimeError, match="not available"):
        poly1305.tag(bytes(32), [b"x"])
    auth = TransferAuth(b"k" * 32, "swap-1", 0)
    bundle = StateBundle({"step": 1}, [torch.arange(5000, dtype=torch.float32)])
    with caplog.at_level(logging.WARNING, logger="tpassrun.transfer.handoff"):
        for _ in range(2):
            assert _transfer(auth, bundle).checksum.startswith("hmac-sha256:")
    lines = [r.getMessage() for r in caplog.records if "Poly1305" in r.getMessage()]
    assert len(lines) == 1 and "HMAC-SHA256" in lines[0] and "libcrypto.so.3" in lines[0] and "\n" not in lines[0]


@needs_poly1305
def test_a_sender_picks_hmac_frames_for_a_receiver_without_poly1305(monkeypatch):
    """The receiver's hello says what it can verify: a sender with Poly1305 sends HMAC frames to one without."""
    monkeypatch.setattr(gmac, "available", lambda: False)
    main = threading.main_thread()
    monkeypatch.setattr(poly1305, "available", lambda: threading.current_thread() is not main)   # receiver: none
    monkeypatch.setattr(handoff_wire, "_poly1305_said", True)
    auth = TransferAuth(b"k" * 32, "swap-1", 0)
    assert _transfer(auth, StateBundle({"step": 1}, [torch.ones(100)])).checksum.startswith("hmac-sha256:")
    monkeypatch.setattr(poly1305, "available", lambda: True)
    assert _transfer(auth, StateBundle({"step": 1}, [torch.ones(100)])).checksum.startswith("poly1305:")
