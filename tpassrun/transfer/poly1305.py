"""Poly1305 from the host's OpenSSL (the libcrypto Python's own ``hashlib`` links), for MACs of bulk data.

Why: HMAC-SHA256 is one SHA-256 pass over the data, about 2 GB/s per core even with the CPU's SHA instructions;
an authenticated state transfer paid that on both ends and ran at a fraction of the checksummed stream. Poly1305
(RFC 8439) runs at 10-15 GB/s per core on the same host (``bench/transfer.py``), so authenticating a frame costs
less than copying it out of the socket. The standard library does not expose it; OpenSSL 3 does (``EVP_MAC``),
and ctypes releases the GIL during each call, so a pool of threads tags frames in parallel.

Poly1305 is a *one-time* authenticator: a key must never tag two messages. Callers derive a fresh 32-byte key
per message from a connection's HMAC key (:meth:`tpassrun.transfer.auth.FrameMac.one_time_key`, which binds the
connection's nonces, the purpose and the message's index), as ChaCha20-Poly1305 derives it from the stream
cipher.

Where libcrypto or its Poly1305 is missing (no shared libcrypto, OpenSSL < 3, a FIPS provider without it, not
Linux), :func:`available` is False, :func:`unavailable_reason` says why, and callers keep HMAC-SHA256.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
from typing import Any

KEY_LEN = 32
TAG_LEN = 16

_lock = threading.Lock()
_loaded: tuple[Any, int] | None = None
_failed: str | None = None


def _load() -> tuple[Any, int] | None:
    """libcrypto and its fetched POLY1305 EVP_MAC (once per process), or None (the reason in ``_failed``)."""
    global _loaded, _failed
    if _loaded is not None or _failed is not None:
        return _loaded
    with _lock:
        if _loaded is not None or _failed is not None:
            return _loaded
        try:
            lib = _open_libcrypto()
            lib.EVP_MAC_fetch.restype = ctypes.c_void_p
            lib.EVP_MAC_fetch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
            lib.EVP_MAC_CTX_new.restype = ctypes.c_void_p
            lib.EVP_MAC_CTX_new.argtypes = [ctypes.c_void_p]
            lib.EVP_MAC_CTX_free.restype = None
            lib.EVP_MAC_CTX_free.argtypes = [ctypes.c_void_p]
            lib.EVP_MAC_init.restype = ctypes.c_int
            lib.EVP_MAC_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p]
            lib.EVP_MAC_update.restype = ctypes.c_int
            lib.EVP_MAC_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            lib.EVP_MAC_final.restype = ctypes.c_int
            lib.EVP_MAC_final.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.c_size_t]
            mac = lib.EVP_MAC_fetch(None, b"POLY1305", None)
            if not mac:
                raise OSError("this OpenSSL has no POLY1305 MAC")
            loaded = (lib, mac)
            if _tag_with(loaded, _RFC_KEY, [_RFC_MSG]) != _RFC_TAG:    # refuse a binding that computes garbage
                raise OSError("libcrypto's POLY1305 failed the RFC 8439 test vector")
            _loaded = loaded
        except Exception as exc:   # noqa: BLE001 - whatever the binding hits, the transfer keeps HMAC frames
            _failed = str(exc) or type(exc).__name__
    return _loaded


def _open_libcrypto() -> Any:
    """The libcrypto this process already has (the one ``hashlib`` links, when it links one dynamically), else
    the system's OpenSSL 3 by its soname. No fixed path: a host without it (a slim image, a Python linked
    statically with its own OpenSSL) just has no Poly1305. Linux only: elsewhere an unversioned libcrypto may
    abort the process on load (macOS), so HMAC frames are used."""
    if not sys.platform.startswith("linux"):
        raise OSError(f"the Poly1305 binding is Linux-only (this is {sys.platform})")
    errors = []
    for name in [*_mapped_libcrypto(), "libcrypto.so.3", ctypes.util.find_library("crypto")]:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        if hasattr(lib, "EVP_MAC_fetch"):
            return lib
        errors.append(f"{name} has no EVP_MAC (OpenSSL < 3)")
    raise OSError(f"no OpenSSL 3 libcrypto ({'; '.join(errors) or 'not found'})")


def _mapped_libcrypto() -> list[str]:
    try:
        import _hashlib  # noqa: F401  (maps the libcrypto hashlib uses, if it is a shared library)
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "/libcrypto" in line}
    except (ImportError, OSError):
        return []
    return sorted(p for p in paths if p.startswith("/") and os.path.exists(p))


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str:
    _load()
    return _failed or ""


def tag(key: bytes, pieces: list[Any]) -> bytes:
    """The 16-byte Poly1305 tag of the concatenation of ``pieces`` (bytes, or writable buffers such as the
    memoryviews of tensors: read in place, not copied) under the one-time ``key`` (32 bytes)."""
    loaded = _load()
    if loaded is None:
        raise RuntimeError(f"Poly1305 is not available here: {_failed}")
    return _tag_with(loaded, key, pieces)


def _tag_with(loaded: tuple[Any, int], key: bytes, pieces: list[Any]) -> bytes:
    lib, mac = loaded
    if len(key) != KEY_LEN:
        raise ValueError(f"a Poly1305 key has {KEY_LEN} bytes, not {len(key)}")
    ctx = lib.EVP_MAC_CTX_new(mac)
    if not ctx:
        raise MemoryError("EVP_MAC_CTX_new failed")
    try:
        if lib.EVP_MAC_init(ctx, key, KEY_LEN, None) != 1:
            raise RuntimeError("EVP_MAC_init(POLY1305) failed")
        for piece in pieces:
            _update(lib, ctx, piece)
        out = ctypes.create_string_buffer(TAG_LEN)
        size = ctypes.c_size_t(0)
        if lib.EVP_MAC_final(ctx, out, ctypes.byref(size), TAG_LEN) != 1 or size.value != TAG_LEN:
            raise RuntimeError("EVP_MAC_final(POLY1305) failed")
        return out.raw
    finally:
        lib.EVP_MAC_CTX_free(ctx)


def _update(lib: Any, ctx: int, piece: Any) -> None:
    if isinstance(piece, bytes):
        ok = lib.EVP_MAC_update(ctx, piece, len(piece)) if piece else 1
    else:
        view = memoryview(piece).cast("B")
        if not view.nbytes:
            return
        if view.readonly:   # a read-only buffer has no address ctypes hands out: copy it (small pieces only)
            data = view.tobytes()
            ok = lib.EVP_MAC_update(ctx, data, len(data))
        else:
            buf = (ctypes.c_char * view.nbytes).from_buffer(view)
            ok = lib.EVP_MAC_update(ctx, ctypes.addressof(buf), view.nbytes)
            del buf
    if ok != 1:
        raise RuntimeError("EVP_MAC_update(POLY1305) failed")


# RFC 8439 section 2.5.2
_RFC_KEY = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
_RFC_MSG = b"Cryptographic Forum Research Group"
_RFC_TAG = bytes.fromhex("a8061dc1305136c6c22b8baf0c0127a9")

__all__ = ["KEY_LEN", "TAG_LEN", "available", "tag", "unavailable_reason"]
