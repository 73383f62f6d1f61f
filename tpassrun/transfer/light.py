"""The per-step light snapshot: every RNG a step may draw from, the step, and the per-rank tracked objects.

Every managed rank takes one at the start of every step (so a failed step can be rolled back, and the agent
holds a dead rank's copy in shared memory), which makes it the one cost tpassrun adds to a healthy step. The
general handoff codec (:func:`tpassrun.transfer.handoff.capture` + ``encode_small``) spent ~220 µs on it, most of it
numpy's ``get_state`` (it copies its 624-word key one element at a time) and turning the RNG dict into a tree.
This module writes the RNG states as raw words instead, and reads numpy's generator straight from its C state
when the step did not touch it.

Frame (little endian)::

    "TPL1" | u32 head_len | head (JSON) | python words (625 x u32) | numpy key (624 x u32, if numpy)
           | torch state | cuda states... | objects frame (handoff ``encode_small``, RNG-less)
           | "TPLE" | u32 crc32 of everything before

``head`` = ``{"step", "py": [version, gauss_next], "np": null | [pos, has_gauss, gauss], "torch": nbytes,
"cuda": [nbytes...], "cuda_at": the current CUDA device or null,
"objects": nbytes}``. :func:`decode` returns the same :class:`StateBundle` that
``capture(objects, step=step, rng=capture_rng())`` would have given, so whoever applies it cannot tell.
Bytes after the trailer are ignored (a fixed-size shared-memory slot); a torn or corrupted frame is a
:class:`ChecksumError`.
"""

from __future__ import annotations

import ctypes
import json
import random
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from tpassrun.transfer.codec import ChecksumError, StateBundle, decode_tree
from tpassrun.transfer.handoff import RNG_VERSION, capture, decode_small, encode_small

try:  # optional: numpy is not a dependency. Without it there is no numpy generator to carry.
    import numpy as np
except ImportError:
    np = None  # type: ignore[assignment]

MAGIC, END = b"TPL1", b"TPLE"
_LEN = struct.Struct("<I")
_PY_WORDS = struct.Struct("<625I")
_NP_KEY_BYTES = 624 * 4
_NP_RAW_BYTES = _NP_KEY_BYTES + 4      # numpy's mt19937_state: uint32 key[624]; int pos


class _NumpyGlobal:
    """numpy's global ``RandomState``, read cheaply when unchanged.

    ``get_state()`` costs ~50-100 µs. The generator's C state (key and position) can be read in ~1 µs
    through ``ctypes.state_address``; when it equals the last full read, the generator did not advance, and
    the Gaussian cache (``has_gauss``/``gauss``) cannot have been *filled* since (that draws from the
    generator). It can have been *consumed* without advancing it, so a cached Gaussian forces a full read.
    """

    def __init__(self) -> None:
        self._bitgen: Any = None
        self._address = 0
        self._raw = b""
        self._state: dict[str, Any] | None = None

    def state(self) -> dict[str, Any]:
        rs = np.random.mtrand._rand
        bitgen = rs._bit_generator
        if bitgen is not self._bitgen:
            self._bitgen, self._raw, self._state = bitgen, b"", None
            self._address = _state_address(bitgen)
        if self._address:
            raw = ctypes.string_at(self._address, _NP_RAW_BYTES)
            if raw == self._raw and self._state is not None and not self._state["has_gauss"]:
                return self._state
        state = rs.get_state(legacy=False)
        if self._address:
            raw = ctypes.string_at(self._address, _NP_RAW_BYTES)
            if not _matches(raw, state):   # not the layout we expect: never trust the shortcut again
                self._address = 0
        self._raw, self._state = (raw if self._address else b""), state
        return state


def _state_address(bitgen: Any) -> int:
    if type(bitgen).__name__ != "MT19937":
        return 0
    try:
        return int(bitgen.ctypes.state_address)
    except Exception:  # noqa: BLE001 - no ctypes interface: always read through get_state
        return 0


def _matches(raw: bytes, state: dict[str, Any]) -> bool:
    inner = state.get("state", {})
    key = inner.get("key")
    return (state.get("bit_generator") == "MT19937" and key is not None
            and raw[:_NP_KEY_BYTES] == np.asarray(key, dtype="<u4").tobytes()
            and int.from_bytes(raw[_NP_KEY_BYTES:], "little", signed=True) == int(inner.get("pos", -1)))


class LightSnapshotter:
    """One per worker: ``take(objects, step) -> bytes``; keeps numpy's last state between steps."""

    def __init__(self) -> None:
        self._numpy = _NumpyGlobal() if np is not None else None

    def take(self, objects: Mapping[str, Any], step: int) -> bytes:
        version, internal, gauss_next = random.getstate()
        parts: list[Any] = [b"", b"", _PY_WORDS.pack(*internal)]
        np_head = None
        if self._numpy is not None:
            st = self._numpy.state()
            np_head = [int(st["state"]["pos"]), int(st["has_gauss"]), float(st["gauss"])]
            parts.append(np.ascontiguousarray(st["state"]["key"], dtype="<u4").tobytes())
        torch_state = _bytes_of(torch.get_rng_state())
        parts.append(torch_state)
        cuda = [_bytes_of(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else []
        parts += cuda
        cuda_at = torch.cuda.current_device() if cuda else None
        objs = encode_small(capture(objects, step=step)) if objects else b""
        parts.append(objs)
        head = json.dumps({"step": step, "py": [version, gauss_next], "np": np_head, "torch": len(torch_state),
                           "cuda": [len(c) for c in cuda], "cuda_at": cuda_at, "objects": len(objs)},
                          separators=(",", ":")).encode()
        parts[0], parts[1] = MAGIC + _LEN.pack(len(head)), head
        body = b"".join(parts)
        return body + END + _LEN.pack(zlib.crc32(body))


def _bytes_of(state: torch.Tensor) -> bytes:
    """A generator state (a fresh, contiguous CPU uint8 tensor) as bytes, without ``Tensor.numpy()``, which
    raises when numpy is not installed; one memcpy either way."""
    return ctypes.string_at(state.data_ptr(), state.numel()) if state.numel() else b""


def decode(data: bytes | bytearray | memoryview) -> StateBundle:
    """The frame as the :class:`StateBundle` ``capture(objects, step=, rng=capture_rng())`` gives."""
    view = memoryview(data).cast("B")
    if len(view) < 8 or bytes(view[:4]) != MAGIC:
        raise ChecksumError("not a light snapshot (bad magic)")
    head_len = _LEN.unpack_from(view, 4)[0]
    if 8 + head_len > len(view):
        raise ChecksumError("light snapshot torn inside its head")
    try:
        head = json.loads(bytes(view[8:8 + head_len]))
        sizes = [_PY_WORDS.size, _NP_KEY_BYTES if head["np"] is not None else 0, int(head["torch"]),
                 *map(int, head["cuda"]), int(head["objects"])]
    except (ValueError, KeyError, TypeError) as exc:
        raise ChecksumError(f"light snapshot head unreadable: {exc}") from None
    end = 8 + head_len + sum(sizes)
    if end + 8 > len(view) or bytes(view[end:end + 4]) != END:
        raise ChecksumError("light snapshot torn (no trailer where its head says)")
    if zlib.crc32(view[:end]) != _LEN.unpack_from(view, end + 4)[0]:
        raise ChecksumError("light snapshot corrupted (crc32 mismatch)")
    pos = 8 + head_len
    chunks = []
    for n in sizes:
        chunks.append(bytes(view[pos:pos + n]))
        pos += n
    py_words, np_key, torch_state, *rest = chunks
    cuda_states, objs = rest[:-1], rest[-1]

    version, gauss_next = head["py"]
    words = np.frombuffer(py_words, dtype="<u4").astype(np.uint32) if np is not None else py_words
    rng: dict[str, Any] = {"v": RNG_VERSION,
                           "python": {"version": version, "internal": words, "gauss_next": gauss_next},
                           "torch": torch.frombuffer(bytearray(torch_state), dtype=torch.uint8)}
    if head["np"] is not None:
        np_pos, has_gauss, gauss = head["np"]
        rng["numpy"] = {"bit_generator": "MT19937",
                        "state": {"key": np.frombuffer(np_key, dtype="<u4").astype(np.uint32), "pos": np_pos},
                        "has_gauss": has_gauss, "gauss": gauss}
    if head["cuda"]:
        rng["cuda"] = [torch.frombuffer(bytearray(c), dtype=torch.uint8) for c in cuda_states]
        if head.get("cuda_at") is not None:
            rng["cuda_current"] = int(head["cuda_at"])
    objects: dict[str, Any] = {}
    if objs:
        inner = decode_small(objs)
        objects = {name: _Held(decode_tree(tree, inner.tensors)) for name, tree in inner.meta["objects"].items()}
    return capture(objects, step=int(head["step"]), rng=rng)


class _Held:
    """A decoded state dict posing as the object it came from, so :func:`capture` can re-encode it."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state

    def load_state_dict(self, state: Any) -> None:  # pragma: no cover - never loaded into
        self._state = state
