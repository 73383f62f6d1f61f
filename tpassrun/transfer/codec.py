"""Handoff codec: state trees <-> a JSON-able meta tree plus a flat list of tensors.

A ``state_dict()`` is a tree of python values with tensors at the leaves. We split it in two:
the *meta* tree is plain JSON (so it can be read, versioned and never unpickled) and the
tensors are kept aside, referenced by index, so the wire layer can stream their memory as is.

Encoding of the meta tree (every tagged value is a JSON object with exactly one key that starts
with ``$``; a plain JSON object is a ``dict`` whose keys are all strings not starting with ``$``)::

    None, bool, int, str, finite float     -> themselves
    nan / inf / -inf                       -> {"$f": "nan" | "inf" | "-inf"}
    list                                   -> [...]
    tuple                                  -> {"$t": [...]}
    dict (other keys)                      -> {"$d": [[key, value], ...]}
    collections.OrderedDict                -> {"$od": [[[key, value], ...], _metadata or null]}
    bytes                                  -> {"$b": base64}
    torch.Size / torch.dtype / device      -> {"$size": [...]} / {"$dtype": "bfloat16"} / {"$device": "cuda:0"}
    torch.Tensor                           -> {"$T": index}
    numpy array                            -> {"$np": [index, dtype.str, shape]}   (raw bytes as a uint8 tensor)
    numpy scalar                           -> {"$npscalar": [dtype.str, base64 of its bytes]}

Types are matched exactly (``type(x) is int``), so a subclass such as an ``IntEnum`` is refused
instead of silently coming back as a plain ``int``. Nothing is ever pickled.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

# the codec's errors, torch-free, so the agent's mirror store (which never imports torch) raises the same errors
from tpassrun.transfer.auth import ChecksumError as ChecksumError
from tpassrun.transfer.auth import HandoffError as HandoffError

try:  # numpy is optional: without it numpy leaves are simply never produced
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every torch wheel we support
    np = None  # type: ignore[assignment]

META_VERSION = 1


@dataclass
class StateBundle:
    """Everything one rank hands over: a JSON-able ``meta`` tree and the tensors it references.

    ``meta`` is ``{"v": 1, "step": int, "objects": {name: tree}, "rng": tree | None,
    "extra": tree | None}``; ``tensors[i]`` is the leaf that ``{"$T": i}`` points at.
    """

    meta: dict[str, Any]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what dominates the transfer)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def extra(self) -> dict[str, Any]:
        """The decoded ``extra`` mapping passed to :func:`tpassrun.transfer.handoff.capture` ({} if none)."""
        tree = self.meta.get("extra")
        return {} if tree is None else decode_tree(tree, self.tensors)


# ---------------------------------------------------------------------------------------------
# encoding


class TreeEncoder:
    """Walks python trees, emitting JSON-able meta and collecting tensor leaves.

    One encoder per bundle: the same tensor object met twice (tied weights, a shared ``step``)
    is stored once and referenced twice, as ``torch.save`` would.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self._index_by_id: dict[int, int] = {}

    def encode(self, value: Any, path: Any) -> Any:
        """Encode ``value``. ``path`` is a nested ``(parent, key)`` tuple, only spelled out on error
        (building path strings eagerly would cost more than the encoding of a light snapshot)."""
        kind = type(value)
        if value is None or kind is bool or kind is int or kind is str:
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$f": repr(value)}
        if kind is list:
            return [self.encode(v, (path, i)) for i, v in enumerate(value)]
        if kind is tuple:
            return {"$t": [self.encode(v, (path, i)) for i, v in enumerate(value)]}
        if kind is dict:
            if all(type(k) is str and not k.startswith("$") for k in value):
                return {k: self.encode(v, (path, k)) for k, v in value.items()}
            return {"$d": self._pairs(value, path)}
        if kind is OrderedDict:
            # nn.Module.state_dict() returns an OrderedDict whose ``_metadata`` carries per-module
            # versions that load_state_dict uses for backward-compatible loading: keep both.
            metadata = getattr(value, "_metadata", None)
            encoded_metadata = None if metadata is None else self.encode(dict(metadata), (path, "_metadata"))
            return {"$od": [self._pairs(value, path), encoded_metadata]}
        if kind is bytes:
            return {"$b": base64.b64encode(value).decode("ascii")}
        if kind is torch.Size:
            return {"$size": list(value)}
        if kind is torch.dtype:
            return {"$dtype": str(value).removeprefix("torch.")}
        if kind is torch.device:
            return {"$device": str(value)}
        if isinstance(value, torch.Tensor):
            return {"$T": self._add_tensor(value, path)}
        if np is not None:
            if kind is np.ndarray:
                return self._encode_ndarray(value, path)
            if isinstance(value, np.generic):
                self._check_numpy_dtype(value.dtype, path)
                return {"$npscalar": [value.dtype.str, base64.b64encode(value.tobytes()).decode("ascii")]}
        raise HandoffError(
            f"cannot hand over {kind.__module__}.{kind.__qualname__} at {spell_path(path)!r}: "
            "only python scalars/containers, bytes, torch tensors/sizes/dtypes/devices and numpy "
            "arrays/scalars are supported (nothing is pickled)"
        )

    def _pairs(self, mapping: dict[Any, Any], path: Any) -> list[list[Any]]:
        return [[self.encode(k, (path, "<key>")), self.encode(v, (path, k))] for k, v in mapping.items()]

    def _add_tensor(self, tensor: torch.Tensor, path: Any) -> int:
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            # DTensor, FakeTensor, ...: their meaning lives outside the bytes, so refuse loudly.
            raise HandoffError(f"cannot hand over tensor subclass {type(tensor).__qualname__} at {spell_path(path)!r}")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type == "meta":
            raise HandoffError(
                f"cannot hand over tensor at {spell_path(path)!r}: layout={tensor.layout}, "
                f"quantized={tensor.is_quantized}, device={tensor.device} (only dense tensors with data)"
            )
        known = self._index_by_id.get(id(tensor))
        if known is not None:
            return known
        self._index_by_id[id(tensor)] = len(self.tensors)
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def _encode_ndarray(self, array: Any, path: Any) -> dict[str, Any]:
        self._check_numpy_dtype(array.dtype, path)
        contiguous = np.ascontiguousarray(array)
        if not contiguous.flags.writeable:  # torch.from_numpy warns on read-only memory
            contiguous = contiguous.copy()
        raw = torch.from_numpy(contiguous.reshape(-1).view(np.uint8))
        return {"$np": [self._add_tensor(raw, path), array.dtype.str, list(array.shape)]}

    @staticmethod
    def _check_numpy_dtype(dtype: Any, path: Any) -> None:
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
            raise HandoffError(f"cannot hand over numpy dtype {dtype} at {spell_path(path)!r} (object/structured)")


def spell_path(path: Any) -> str:
    """``(("opt", "state"), 3)`` -> ``"opt.state[3]"``: the location named in error messages."""
    parts: list[str] = []
    while isinstance(path, tuple):
        path, key = path
        parts.append(f".{key}" if type(key) is str and key.isidentifier() else f"[{key!r}]")
    return str(path) + "".join(reversed(parts))


# ---------------------------------------------------------------------------------------------
# decoding


def decode_tree(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :meth:`TreeEncoder.encode`; tensor leaves are taken from ``tensors`` (not copied)."""
    kind = type(tree)
    if kind is list:
        return [decode_tree(v, tensors) for v in tree]
    if kind is not dict:
        return tree
    if len(tree) == 1:
        (key,) = tree
        if key.startswith("$"):
            return _decode_tagged(key, tree[key], tensors)
    return {k: decode_tree(v, tensors) for k, v in tree.items()}


def _decode_tagged(tag: str, body: Any, tensors: list[torch.Tensor]) -> Any:
    if tag == "$T":
        return _tensor_at(tensors, body)
    if tag == "$t":
        return tuple(decode_tree(v, tensors) for v in body)
    if tag == "$d":
        return {_hashable(decode_tree(k, tensors)): decode_tree(v, tensors) for k, v in body}
    if tag == "$od":
        pairs, metadata = body
        result: OrderedDict[Any, Any] = OrderedDict((_hashable(decode_tree(k, tensors)), decode_tree(v, tensors))
                                                    for k, v in pairs)
        if metadata is not None:
            result._metadata = decode_tree(metadata, tensors)  # type: ignore[attr-defined]
        return result
    if tag == "$f":
        return float(body)
    if tag == "$b":
        return base64.b64decode(body)
    if tag == "$size":
        return torch.Size(body)
    if tag == "$dtype":
        return dtype_from_name(body)
    if tag == "$device":
        return torch.device(body)
    if tag == "$np":
        index, dtype, shape = body
        return _require_numpy().asarray(_tensor_at(tensors, index).numpy()).view(np.dtype(dtype)).reshape(shape)
    if tag == "$npscalar":
        dtype, raw = body
        return _require_numpy().frombuffer(base64.b64decode(raw), dtype=np.dtype(dtype))[0]
    raise HandoffError(f"unknown tag {tag!r} in handoff meta (written by a newer tpassrun?)")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):  # only a hand-written meta can do this: tuple keys always come back tagged
        raise HandoffError(f"dict key decoded to an unhashable list: {key!r}")
    return key


def _tensor_at(tensors: list[torch.Tensor], index: Any) -> torch.Tensor:
    if type(index) is not int or not 0 <= index < len(tensors):
        raise HandoffError(f"meta references tensor #{index!r} but the bundle holds {len(tensors)}")
    return tensors[index]


def _require_numpy() -> Any:
    if np is None:
        raise HandoffError("the bundle holds numpy values but numpy is not importable here")
    return np


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise HandoffError(f"unknown torch dtype {name!r}")
    return dtype
