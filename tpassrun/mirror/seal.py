"""The mirror's frames under encryption (``--rdzv-conf encrypt=true``): meta and payload sealed with AES-256-GCM.

A mirror server whose run encrypts says so in its hello (:data:`~tpassrun.transfer.auth.FLAG_ENCRYPT`); then every
frame of the connection, both ways, is sealed (a request's status byte says :data:`PAYLOAD_AEAD`, and the server
refuses any request that does not)::

    head 24 B                        in clear (sizes, op, sequence number): the associated data of both seals
    AEAD_{2 seq}(meta)               meta_len + 16 B       (a long LIST answer: its meta is the payload, this empty)
    AEAD_{2 seq + 1}(payload)        payload_len + 16 B    (empty for requests without one: just its tag)

It replaces the frame's HMAC tag: the GCM tags authenticate meta, payload and (as associated data) the direction
and head. The key is :meth:`~tpassrun.transfer.auth.FrameMac.one_time_key` of the connection's handshake MAC
(both fresh nonces) for one direction, as a state transfer keys its frames (:mod:`tpassrun.transfer.seal`). A
client whose run encrypts sends nothing to a server that does not decrypt.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

from tpassrun.mirror.store import MirrorError
from tpassrun.transfer import AEAD_TAG_LEN, ChecksumError, FrameCipher, FrameMac

PAYLOAD_AEAD = 2                    # a request head's status byte: the frame is sealed (module doc)
_SEQ = struct.Struct("<Q")
_SEQ_AT = 16                        # the head's u64 sequence number (mirror.net's _HEAD: 4s B B H Q Q)


class FrameSeal:
    """Seals (or opens) the frames of one connection in one direction.

    Nonce invariant: the key is this connection's and this direction's alone (derived from both handshake
    nonces and the direction), and a frame's nonces are ``2 seq`` (meta) and ``2 seq + 1`` (payload), where
    ``seq`` is the head's sequence number: the sender numbers its frames 0, 1, 2, ... on each connection and never
    seals two frames with one number (a broken connection is never reused: the next one has a new key), and the
    receiver refuses a head whose number is not the next one. So no nonce is ever used twice under a key."""

    def __init__(self, base: FrameMac, direction: bytes) -> None:
        self._direction = direction
        self._cipher = FrameCipher(base.one_time_key(b"mirror-aead\0" + direction))

    def _aad(self, head: bytes) -> bytes:
        return self._direction + head

    def seal(self, head: bytes, meta: bytes, pieces: Sequence[Any] = ()) -> list[Any]:
        """The frame's wire pieces: head, sealed meta, sealed payload (``pieces`` joined once: GCM takes one
        buffer)."""
        seq = _SEQ.unpack_from(head, _SEQ_AT)[0]
        aad = self._aad(head)
        data: Any = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        meta_out = bytearray(len(meta) + AEAD_TAG_LEN)
        self._cipher.seal_into(2 * seq, aad, meta, meta_out)
        out = bytearray(len(data) + AEAD_TAG_LEN)
        self._cipher.seal_into(2 * seq + 1, aad, data, out)
        return [head, meta_out, out]

    def open_meta(self, head: bytes, sealed: bytes) -> bytes:
        seq = _SEQ.unpack_from(head, _SEQ_AT)[0]
        return self._open(2 * seq, head, sealed, "meta")

    def open_payload(self, head: bytes, sealed: Any) -> bytes:
        seq = _SEQ.unpack_from(head, _SEQ_AT)[0]
        return self._open(2 * seq + 1, head, sealed, "payload")

    def _open(self, nonce: int, head: bytes, sealed: Any, what: str) -> bytes:
        """The plaintext as immutable bytes, decrypted once (the mirror store keeps and shares it as is)."""
        if len(sealed) < AEAD_TAG_LEN:
            raise MirrorError(f"a sealed mirror {what} shorter than its tag")
        try:
            return self._cipher.open(nonce, self._aad(head), sealed)
        except ChecksumError:
            raise MirrorError(f"mirror frame {what} forged or corrupted (its GCM tag does not verify): nothing "
                              "kept") from None


__all__ = ["FrameSeal", "PAYLOAD_AEAD"]
