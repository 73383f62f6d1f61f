"""tpassrun.transfer: state on the wire. ``auth`` (the handshakes, MACs and AES-256-GCM frames), ``gate`` (a
handshake no stranger can stall), ``codec`` (a state tree as frames), ``wire`` (the authenticated TCP transfer),
``seal`` (sealed frames), ``light`` (light snapshots), ``quiet`` (a throttle for repeated lines).

The door imports what it names on first use: ``codec`` and ``light`` import torch, which the launcher, the mirror's
server and the workers' store never pay for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpassrun.transfer.auth import (
        ACCEPT,
        AEAD_TAG_LEN,
        FLAG_ENCRYPT,
        FLAG_GMAC,
        HELLO,
        PROOF,
        TAG_LEN,
        AuthError,
        ChecksumError,
        ConnectorHandshake,
        FrameCipher,
        FrameMac,
        HandoffError,
        ListenerHandshake,
        TransferAuth,
        aead_unavailable_reason,
        encryption_wanted,
    )
    from tpassrun.transfer.codec import TreeEncoder, decode_tree, dtype_from_name
    from tpassrun.transfer.gate import HANDSHAKE_DEADLINE_S, HandshakeGate, PendingTable, source_of
    from tpassrun.transfer.light import LightSnapshotter
    from tpassrun.transfer.light import decode as decode_light
    from tpassrun.transfer.quiet import Throttle, held_note
    from tpassrun.transfer.seal import listener_flags
    from tpassrun.transfer.wire import decode_small, encode_parts, reserve_receive_arena


def _from(module: str, *names: str) -> dict[str, tuple[str, str]]:
    return {name: (module, name) for name in names}


# name -> (module, its name there)
_LAZY = {
    **_from("tpassrun.transfer.auth", "ACCEPT", "AEAD_TAG_LEN", "FLAG_ENCRYPT", "FLAG_GMAC", "HELLO", "PROOF", "TAG_LEN",
            "AuthError", "ChecksumError", "ConnectorHandshake", "FrameCipher", "FrameMac", "HandoffError",
            "ListenerHandshake", "TransferAuth", "aead_unavailable_reason", "encryption_wanted"),
    **_from("tpassrun.transfer.codec", "TreeEncoder", "decode_tree", "dtype_from_name"),
    **_from("tpassrun.transfer.gate", "HANDSHAKE_DEADLINE_S", "HandshakeGate", "PendingTable", "source_of"),
    **_from("tpassrun.transfer.light", "LightSnapshotter"),
    "decode_light": ("tpassrun.transfer.light", "decode"),
    **_from("tpassrun.transfer.quiet", "Throttle", "held_note"),
    **_from("tpassrun.transfer.seal", "listener_flags"),
    **_from("tpassrun.transfer.wire", "decode_small", "encode_parts", "reserve_receive_arena"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


__all__ = ["ACCEPT", "AEAD_TAG_LEN", "FLAG_ENCRYPT", "FLAG_GMAC", "HANDSHAKE_DEADLINE_S", "HELLO", "PROOF", "TAG_LEN",
           "AuthError", "ChecksumError", "ConnectorHandshake", "FrameCipher", "FrameMac", "HandoffError", "HandshakeGate",
           "LightSnapshotter", "ListenerHandshake", "PendingTable", "Throttle", "TransferAuth", "TreeEncoder",
           "aead_unavailable_reason", "decode_light", "decode_small", "decode_tree", "dtype_from_name", "encode_parts",
           "encryption_wanted", "held_note", "listener_flags", "reserve_receive_arena", "source_of"]
