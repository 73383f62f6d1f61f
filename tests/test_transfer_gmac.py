"""GMAC frame tags (tpassrun/transfer/gmac.py; issue 27 item 7, authentication at line rate; issue 42, the one frame
MAC): the frame MAC was most of what an authenticated transfer cost over raw TCP, and GHASH runs at about twice
Poly1305's speed here. A tampered GMAC'd stream is refused (tests/test_security.py's FRAME_MACS). Peers of the
tpassrun before issue 42 (Poly1305 or HMAC-SHA256 frames) are refused in one line on either end, not misread."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from tpassrun.transfer import gmac, wire
from tpassrun.transfer.auth import FLAG_GMAC, PROOF, ListenerHandshake
from tpassrun.transfer.handoff import HandoffError, StateBundle, TransferAuth, recv_bundle, send_bundle

pytestmark = [pytest.mark.timeout(60)]
OLD_FLAG_POLY1305 = 1       # what a listener of the tpassrun before issue 42 offered without 'cryptography'


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


def test_the_gcm_known_answer():
    """NIST's GCM test case 14 (AES-256, zero key, zero IV, one zero block): the library computes standard GCM."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    sealed = AESGCM(bytes(32)).encrypt(bytes(12), bytes(16), None)
    assert sealed.hex() == "cea7403d4d606b6e074ec5d3baf39d18" "d0d1c8a799996bf0265b98b5d48ab919"


def test_a_sender_picks_gmac_and_refuses_an_older_receiver_in_one_line():
    assert wire._frame_mac_name(None, FLAG_GMAC | OLD_FLAG_POLY1305) == "gmac-aes-256"
    assert wire._frame_mac_name("gmac-aes-256", FLAG_GMAC) == "gmac-aes-256"
    for flags, offered in ((OLD_FLAG_POLY1305, "poly1305"), (0, "hmac-sha256")):
        with pytest.raises(HandoffError) as refused:
            wire._frame_mac_name(None, flags)
        line = str(refused.value)
        assert f"older tpassrun that cannot verify GMAC frame tags (it offers {offered} frames)" in line
        assert "nothing was sent" in line and "\n" not in line
    with pytest.raises(ValueError, match="unknown frame MAC 'poly1305'"):
        wire._frame_mac_name("poly1305")


def test_an_older_listener_gets_no_byte_of_state():
    """A listener of the older tpassrun (its hello offers Poly1305 only) proves the key; the sender refuses it
    after the handshake, before the head: the listener reads nothing more."""
    auth = TransferAuth(b"k" * 32, "swap-o", 1)
    a, b = socket.socketpair()
    seen: dict = {}

    def old_listener() -> None:
        shake = ListenerHandshake(auth, OLD_FLAG_POLY1305)
        b.sendall(shake.hello())
        b.sendall(shake.accept(wire._SocketReader(b).read_exact(PROOF.size, "proof")))
        seen["after"] = b.recv(1 << 16)               # b"" once the sender closed: not a byte of state

    with a, b:
        a.settimeout(10)
        b.settimeout(10)
        t = threading.Thread(target=old_listener)
        t.start()
        with pytest.raises(HandoffError, match="older tpassrun .* poly1305 frames"):
            send_bundle(a, StateBundle({"step": 1}, [torch.ones(10)]), auth=auth)
        a.close()
        t.join(10)
    assert seen["after"] == b""


@pytest.mark.parametrize("old_mac", ["poly1305", "hmac-sha256"])
def test_an_older_senders_stream_is_refused_in_one_line_not_misread(old_mac):
    """What the older tpassrun sent: the signed head naming its frame MAC (under the connection's HMAC, so it is
    genuinely the sender's), then frames this version cannot verify: refused at the head, nothing allocated."""
    auth = TransferAuth(b"k" * 32, "swap-o", 2)
    a, b = socket.socketpair()

    def old_sender() -> None:
        mac, _flags = wire._sender_handshake(a, auth)
        spec, _, view = wire._outgoing(torch.ones(1000))
        head = wire._encode_head({"step": 1}, [spec], 1 << 20, old_mac)
        a.sendall(head + wire._tag(mac.copy(), b"head", [head[:wire._PREFIX_LEN], head[wire._PREFIX_LEN:]]))
        a.sendall(bytes(view) + bytes(16 if old_mac == "poly1305" else 32))

    with a, b:
        a.settimeout(10)
        b.settimeout(10)
        t = threading.Thread(target=old_sender)
        t.start()
        with pytest.raises(HandoffError) as refused:
            recv_bundle(b, auth=auth)
        t.join(10)
    line = str(refused.value)
    assert f"the sender is an older tpassrun ({old_mac} frame tags" in line and "\n" not in line


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


def test_cryptography_is_a_dependency_and_nothing_binds_libcrypto_by_hand():
    """Issue 42: one well-kept library for every AEAD and MAC of bulk data; no ctypes binding of the host's OpenSSL
    (the Poly1305 of tpassrun/transfer/poly1305.py) and no home-made cipher remain."""
    import tomllib
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("cryptography>=") for d in project["dependencies"])
    assert project["optional-dependencies"]["encrypt"] == []      # the old extra's name still installs
    sources = [p for d in ("tpassrun", "rendezvous", "health") for p in (repo / d).rglob("*.py")]
    offenders = [str(p) for p in sources if any(w in p.read_text() for w in ("libcrypto", "EVP_MAC", "keystream"))]
    assert not offenders and not (repo / "tpassrun" / "transfer" / "poly1305.py").exists()
