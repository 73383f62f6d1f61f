"""Authenticated point-to-point connections between tpassrun processes: the HMAC handshake and frame MACs.

Torch-free on purpose: the agent (which never imports torch) uses it for its mirror store
(:mod:`tpassrun.mirror`), the workers for the state handoff (:mod:`tpassrun.transfer.wire`). Both ends share a
key that reached them through the control plane (etcd, the agent's private socket), never the network. Before
anything else is read or allocated, the two ends prove the key to each other over fresh nonces (either end may
be a stranger: a process that found the port, or a forged plan's address)::

    listener -> connector   40 B  b"TPNC" | u16 version | u16 flags | nonce_r (32 B)
    connector -> listener   68 B  b"TPAU" | nonce_s (32 B) | HMAC(key, "sender" | nonce_r | nonce_s | context)
    listener -> connector   36 B  b"TPOK" | HMAC(key, "receiver" | nonce_r | nonce_s | context)

``context`` names the purpose, the transfer and the rank (:class:`TransferAuth`), so a key holder of another
swap, rank or purpose is refused too. The handshake is sans-I/O (:class:`ListenerHandshake`,
:class:`ConnectorHandshake` say what to send and check what came back), so blocking sockets and asyncio
streams drive the very same code; :meth:`TransferAuth.frame_mac` then keys the MAC of everything that follows.

``flags`` says what the listener can verify and wants: :data:`FLAG_GMAC` (GMAC frame tags: every listener of this
version sets it; a sender refuses, in one line, a listener without it: a tpassrun from before issue 42 without
``cryptography``, which offered only Poly1305 (bit 1, never set now) or HMAC-SHA256 frames) and :data:`FLAG_ENCRYPT`.
The flags are not under a tag: a peer in the middle that flips them can only make the transfer fail (the stream's
head, under the connection's HMAC, names the frame MAC in use), which it can do anyway.

Primitives: the proofs, the connection's MAC and the keys derived from it are HMAC-SHA256 (the standard library's
``hmac``, OpenSSL's SHA-256 underneath: small messages, where HMAC is all that is needed); frames are tagged with
GMAC (:mod:`tpassrun.transfer.gmac`) or sealed with AES-256-GCM (:class:`FrameCipher`), both from ``cryptography``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import struct
from dataclasses import dataclass
from typing import Any

from tpassrun.settings import envnames as E

WIRE_VERSION = 1
HELLO = struct.Struct("<4sHH32s")     # b"TPNC", version, flags, listener nonce
PROOF = struct.Struct("<4s32s32s")    # b"TPAU", connector nonce, connector proof
ACCEPT = struct.Struct("<4s32s")      # b"TPOK", listener proof
TAG_LEN = 32
FLAG_ENCRYPT = 2                      # the listener's run encrypts (--rdzv-conf encrypt=true): AES-256-GCM frames
FLAG_GMAC = 4                         # the listener verifies GMAC frame tags (tpassrun.transfer.gmac)
AEAD_NAME = "aes-256-gcm"
AEAD_TAG_LEN = 16


class HandoffError(Exception):
    """A state handoff (or a mirror transfer) could not be captured, transferred or applied."""


class ChecksumError(HandoffError):
    """The received bytes do not match the sender's checksum: the state must not be used."""


class AuthError(HandoffError):
    """The peer did not prove the key: a stranger, or a peer of another swap, rank or purpose."""


@dataclass(frozen=True)
class TransferAuth:
    """What both ends of one connection share: the ``key`` (from the control plane, never on the network) and
    the connection's identity: ``purpose`` ("handoff": one rank's state in one swap; "mirror": the mirror store),
    ``swap_id`` and ``rank`` (for a mirror: the run id and -1)."""

    key: bytes
    swap_id: str
    rank: int
    purpose: str = "handoff"

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("a transfer key needs at least 16 bytes")

    def __repr__(self) -> str:   # never print the key
        return f"TransferAuth(purpose={self.purpose!r}, swap_id={self.swap_id!r}, rank={self.rank})"

    def _label(self) -> bytes:
        return b"tpassrun-" + self.purpose.encode() + b"/"

    def _context(self, nonce_r: bytes, nonce_s: bytes) -> bytes:
        ident = json.dumps([WIRE_VERSION, self.swap_id, self.rank]).encode()
        return nonce_r + nonce_s + struct.pack("<I", len(ident)) + ident

    def proof(self, role: bytes, nonce_r: bytes, nonce_s: bytes) -> bytes:
        return hmac.new(self.key, self._label() + role + b"\0" + self._context(nonce_r, nonce_s),
                        hashlib.sha256).digest()

    def frame_mac(self, nonce_r: bytes, nonce_s: bytes) -> "FrameMac":
        return FrameMac(hmac.new(self.key, self._label() + b"frame\0" + self._context(nonce_r, nonce_s),
                                 hashlib.sha256))


class FrameMac:
    """HMAC-SHA256 keyed for one connection: ``feed`` the bytes, ``tag`` is the 32-byte MAC, ``result`` its first
    4 bytes (a 32-bit checksum field). ``copy`` forks it (one MAC per frame from one connection's key)."""

    def __init__(self, mac: "hmac.HMAC") -> None:
        self._mac = mac

    def feed(self, data: Any) -> None:
        self._mac.update(data)

    def result(self) -> int:
        return int.from_bytes(self.tag()[:4], "little")

    def tag(self) -> bytes:
        return self._mac.copy().digest()

    def copy(self) -> "FrameMac":
        return FrameMac(self._mac.copy())

    def verify(self, tag: bytes) -> bool:
        return hmac.compare_digest(tag, self.tag())

    def one_time_key(self, label: bytes) -> bytes:
        """A 32-byte key for one purpose or message (the GMAC key of a connection's frames, an AES-256-GCM key, a
        mirror payload's GMAC key): this connection's HMAC over what was fed so far and ``label``, which must never
        repeat within the connection."""
        mac = self._mac.copy()
        mac.update(b"one-time-key\0" + label)
        return mac.digest()


class ListenerHandshake:
    """The listening end: :meth:`hello` out, the connector's proof (:data:`PROOF` ``.size`` bytes) into
    :meth:`accept`, which checks it in constant time and returns the answer to send; then :meth:`frame_mac`."""

    def __init__(self, auth: TransferAuth, flags: int = 0) -> None:
        self.auth = auth
        self.flags = flags
        self.nonce_r = secrets.token_bytes(32)
        self.nonce_s = b""

    def hello(self) -> bytes:
        return HELLO.pack(b"TPNC", WIRE_VERSION, self.flags, self.nonce_r)

    def accept(self, raw: bytes) -> bytes:
        if len(raw) != PROOF.size:
            raise AuthError("the peer sent no complete proof of the key")
        magic, nonce_s, proof = PROOF.unpack(raw)
        if magic != b"TPAU" or not hmac.compare_digest(proof, self.auth.proof(b"sender", self.nonce_r, nonce_s)):
            raise AuthError(f"the peer did not prove the {self.auth.purpose} key (a stranger, or another "
                            "swap, rank or run)")
        self.nonce_s = nonce_s
        return ACCEPT.pack(b"TPOK", self.auth.proof(b"receiver", self.nonce_r, nonce_s))

    def frame_mac(self) -> FrameMac:
        return self.auth.frame_mac(self.nonce_r, self.nonce_s)


class ConnectorHandshake:
    """The connecting end: the listener's hello (:data:`HELLO` ``.size`` bytes) into :meth:`prove`, which returns
    the proof to send; the listener's answer (:data:`ACCEPT` ``.size`` bytes) into :meth:`verify`, which returns
    the connection's :class:`FrameMac` only if the listener proved the key too (a forged address must not
    receive a single byte). :attr:`peer_flags` is what the listener said it can verify."""

    def __init__(self, auth: TransferAuth) -> None:
        self.auth = auth
        self.nonce_r = b""
        self.nonce_s = secrets.token_bytes(32)
        self.peer_flags = 0

    def prove(self, raw: bytes) -> bytes:
        if len(raw) != HELLO.size:
            raise AuthError("the peer sent no complete hello")
        magic, version, flags, nonce_r = HELLO.unpack(raw)
        if magic != b"TPNC" or version != WIRE_VERSION:
            raise AuthError(f"the peer is not a tpassrun {self.auth.purpose} endpoint (hello {magic!r} v{version})")
        self.nonce_r, self.peer_flags = nonce_r, flags
        return PROOF.pack(b"TPAU", self.nonce_s, self.auth.proof(b"sender", nonce_r, self.nonce_s))

    def verify(self, raw: bytes) -> FrameMac:
        if len(raw) != ACCEPT.size:
            raise AuthError("the peer refused our proof or left")
        magic, proof = ACCEPT.unpack(raw)
        if magic != b"TPOK" or not hmac.compare_digest(proof, self.auth.proof(b"receiver", self.nonce_r,
                                                                               self.nonce_s)):
            raise AuthError(f"the peer did not prove the {self.auth.purpose} key: sending nothing to it")
        return self.auth.frame_mac(self.nonce_r, self.nonce_s)


class FrameCipher:
    """AES-256-GCM (``cryptography``'s, OpenSSL underneath) keyed for one connection and one direction: the key is
    :meth:`FrameMac.one_time_key` of the handshake (both nonces), the nonce a message's index (never reused within
    the connection). ``seal_into``/``open_into`` write into the caller's buffers (no copy of a frame's bytes);
    :class:`ChecksumError` when a frame was forged or altered."""

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)

    @staticmethod
    def nonce(index: int) -> bytes:
        return b"\0\0\0\0" + index.to_bytes(8, "little")

    def seal(self, index: int, aad: bytes, data: Any) -> bytes:
        return self._aead.encrypt(self.nonce(index), bytes(data), aad)

    def seal_into(self, index: int, aad: bytes, data: Any, out: Any) -> None:
        """``out``: ``len(data) + AEAD_TAG_LEN`` bytes, the ciphertext then the tag."""
        self._aead.encrypt_into(self.nonce(index), data, aad, out)

    def open(self, index: int, aad: bytes, data: Any) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(self.nonce(index), data, aad)    # any buffer: no copy of the input
        except InvalidTag:
            raise ChecksumError("an encrypted frame was forged or altered (its tag does not verify)") from None

    def open_into(self, index: int, aad: bytes, data: Any, out: Any) -> None:
        from cryptography.exceptions import InvalidTag

        try:
            self._aead.decrypt_into(self.nonce(index), data, aad, out)
        except InvalidTag:
            raise ChecksumError("an encrypted frame was forged or altered (its tag does not verify)") from None


def encryption_wanted(encrypt: bool | None = None) -> bool:
    """Whether this process's transfers and mirror traffic are encrypted: ``encrypt``, else its run's
    ``--rdzv-conf encrypt=true`` (the agent sets ``TPASSRUN_ENCRYPT=1`` for every worker of such a run, so both
    ends of a transfer agree; the agent itself passes its setting explicitly)."""
    if encrypt is not None:
        return encrypt
    return os.environ.get(E.TPASSRUN_ENCRYPT, "") == "1"


def aead_unavailable_reason() -> str | None:
    """None when this process can encrypt (``cryptography`` with ``encrypt_into``), else why not."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return "the 'cryptography' package is not installed (a dependency of tpassrun: pip install tpassrun again)"
    if not hasattr(AESGCM, "encrypt_into"):
        return "the installed 'cryptography' is too old (encrypt_into needs cryptography >= 44)"
    return None


__all__ = ["ACCEPT", "AEAD_NAME", "AEAD_TAG_LEN", "AuthError", "FLAG_ENCRYPT", "FLAG_GMAC", "FrameCipher",
           "aead_unavailable_reason", "ChecksumError", "ConnectorHandshake", "FrameMac", "HELLO",
           "HandoffError",
           "ListenerHandshake", "PROOF", "encryption_wanted", "TAG_LEN", "TransferAuth", "WIRE_VERSION"]
