"""GMAC (NIST SP 800-38D: AES-256-GCM over associated data only, no plaintext): the tag of every data frame of a
state transfer and of every mirror payload, from ``cryptography`` (a required dependency; OpenSSL underneath).

Why GMAC: the frame MAC is most of what an authenticated transfer costs over raw TCP (``bench/transfer.py``).
GHASH with the CPU's carry-less multiply (PCLMULQDQ, VPCLMULQDQ) runs at ~19-23 GB/s per core here, about twice
Poly1305 and ten times HMAC-SHA256 (``bench/mac_cost.py``), and ``cryptography`` releases the GIL while it
hashes, so a pool of threads tags frames in parallel with the socket's copies.

GMAC must never authenticate two messages under one (key, nonce). Callers key it per connection and purpose
(:meth:`tpassrun.transfer.auth.FrameMac.one_time_key`, which binds both handshake nonces) and use the frame's
index as its nonce (the transfer), or derive a key per message and use nonce 0 (the mirror); see :func:`tag`.
"""

from __future__ import annotations

from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

KEY_LEN = 32
TAG_LEN = 16
NAME = "gmac-aes-256"       # what a stream's head says its frames carry


def tag(key: bytes, index: int, pieces: list[Any]) -> bytes:
    """The 16-byte GMAC of the concatenation of ``pieces`` (bytes or buffers, read in place) under ``key`` with the
    96-bit nonce ``index`` (a frame number).

    Invariant: a caller never passes one (``key``, ``index``) twice for different messages: the key is one
    connection's, for one purpose, and the index a frame number that the connection's sender uses once (or the
    key is one message's own)."""
    if len(key) != KEY_LEN:
        raise ValueError(f"a GMAC key here has {KEY_LEN} bytes, not {len(key)}")
    gmac = Cipher(algorithms.AES(key), modes.GCM(b"\0\0\0\0" + index.to_bytes(8, "little"))).encryptor()
    for piece in pieces:
        if len(piece):
            gmac.authenticate_additional_data(piece)
    gmac.finalize()
    return bytes(gmac.tag)


__all__ = ["KEY_LEN", "NAME", "TAG_LEN", "tag"]
