"""GMAC (NIST SP 800-38D: AES-256-GCM over associated data only, no plaintext) for the frames of a state transfer,
from ``cryptography`` (OpenSSL underneath) where it is installed.

Why: the frame MAC is most of what an authenticated transfer costs over raw TCP (``bench/transfer.py``: ~0.3 of
0.7 CPU-s/GB, both ends). GHASH with the CPU's carry-less multiply (PCLMULQDQ, VPCLMULQDQ) runs at ~23 GB/s per core
on this host against ~12.5 for OpenSSL's Poly1305, so the same frames cost half the CPU. ``cryptography`` releases
the GIL while it hashes, so the handoff's pool of threads tags frames in parallel, as with Poly1305.

GMAC, like Poly1305, must never authenticate two messages under one (key, nonce). Callers key it per connection
and purpose (:meth:`tpassrun.transfer.auth.FrameMac.one_time_key`, which binds both handshake nonces) and use the
frame's index as its nonce; see :func:`tag`.

Without ``cryptography`` (>= 44, as the ``encrypt`` extra), :func:`unavailable_reason` says so and the transfer
keeps Poly1305 (or HMAC-SHA256) frames.
"""

from __future__ import annotations

from typing import Any

KEY_LEN = 32
TAG_LEN = 16

_missing: str | None = None
_checked = False


def unavailable_reason() -> str | None:
    """None when this process can compute GMAC tags, else why not."""
    global _missing, _checked
    if not _checked:
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes  # noqa: F401
            from tpassrun.transfer.auth import aead_unavailable_reason

            _missing = aead_unavailable_reason()
        except ImportError:
            _missing = "the 'cryptography' package is not installed"
        _checked = True
    return _missing


def available() -> bool:
    return unavailable_reason() is None


def tag(key: bytes, index: int, pieces: list[Any]) -> bytes:
    """The 16-byte GMAC of the concatenation of ``pieces`` (bytes or buffers, read in place) under ``key`` with the
    96-bit nonce ``index`` (a frame number).

    Invariant: a caller never passes one (``key``, ``index``) twice for different messages: the key is one
    connection's, for one purpose, and the index a frame number that the connection's sender uses once."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if len(key) != KEY_LEN:
        raise ValueError(f"a GMAC key here has {KEY_LEN} bytes, not {len(key)}")
    gmac = Cipher(algorithms.AES(key), modes.GCM(b"\0\0\0\0" + index.to_bytes(8, "little"))).encryptor()
    for piece in pieces:
        if len(piece):
            gmac.authenticate_additional_data(piece)
    gmac.finalize()
    return bytes(gmac.tag)


__all__ = ["KEY_LEN", "TAG_LEN", "available", "tag", "unavailable_reason"]
