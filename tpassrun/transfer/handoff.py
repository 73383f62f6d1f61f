"""Per-rank state handoff: capture a rank's state, stream it point to point, verify it, apply it.

Two situations use it (see docs/DESIGN.md and the worker API in ``tpassrun/worker/__init__.py``):

* **planned swap**: the leaving rank is paused between two steps and streams *all* of its state
  (model, optimizer, scheduler, sampler, RNG, step) straight to the joiner;
* **unplanned failure**: a healthy data-parallel replica (the donor) streams model/optimizer
  state, and the dead rank's light state (RNG, data position) comes from the per-step snapshot
  it left in shared memory (``encode_small``/``decode_small``).

Typical use::

    # leaver / donor                                   # joiner
    bundle = capture(objs, step=s, rng=capture_rng())  listener, port = listen_for_bundle()
    connect_and_send(addr, port, bundle, timeout=60)   bundle, stats = accept_and_recv(listener, timeout=60)
                                                       step = apply(bundle, objs)

Objects follow the ``Stateful`` protocol (``state_dict()`` / ``load_state_dict()``). Nothing is
pickled: the state tree travels as versioned JSON plus raw tensor bytes (see ``handoff_codec``
and ``handoff_wire`` for the formats).
"""

from __future__ import annotations

import array
import random
from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from tpassrun.transfer.codec import META_VERSION, ChecksumError, HandoffError, StateBundle, TreeEncoder, decode_tree
from tpassrun.transfer.wire import (
    AuthError,
    TransferAuth,
    TransferStats,
    accept_and_recv,
    connect_and_send,
    decode_small,
    encode_small,
    listen_for_bundle,
    recv_bundle,
    send_bundle,
)

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

__all__ = [
    "AuthError", "ChecksumError", "HandoffError", "StateBundle", "Stateful", "TransferAuth", "TransferStats",
    "accept_and_recv", "apply", "capture", "capture_rng", "connect_and_send", "cuda_rng_targets", "decode_small",
    "encode_small", "listen_for_bundle", "recv_bundle", "restore_rng", "send_bundle",
]

RNG_VERSION = 1
# Python's Mersenne Twister state is 624 words plus an index, each < 2**32: as raw uint32 words
# (a numpy array when numpy is there, else bytes) it encodes an order of magnitude faster than
# as 625 JSON integers, and capture_rng() runs every step.
_U32 = "I" if array.array("I").itemsize == 4 else "L"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state_dict: Any) -> Any: ...


# ---------------------------------------------------------------------------------------------
# RNG


def capture_rng() -> dict[str, Any]:
    """Every global RNG a training step may draw from, as plain values and tensors.

    Keys: ``python`` (``random``), ``numpy`` (its legacy global ``RandomState``, only when numpy
    is importable), ``torch`` (CPU generator), ``cuda`` (one state per visible device, only when CUDA is
    available) with ``cuda_current``, the device this process computes on (:func:`cuda_rng_targets`). The
    tensors returned are copies: capturing never aliases live generator state.
    """
    version, internal, gauss_next = random.getstate()
    words = array.array(_U32, internal)
    state: dict[str, Any] = {
        "v": RNG_VERSION,
        "python": {"version": version, "internal": words.tobytes() if np is None else np.frombuffer(words, np.uint32),
                   "gauss_next": gauss_next},
        "torch": torch.get_rng_state(),
    }
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=False)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_current"] = torch.cuda.current_device()
    return state


def cuda_rng_targets(states: int, sender_current: int | None, devices: int, current: int) -> list[tuple[int, int]]:
    """Which captured CUDA generator state goes to which local device: ``(state index, device)`` pairs.

    A rank computes on one GPU, and the process replacing it may see another set of them: a spare sees only
    its own GPU (as ``cuda:0``), while the rank it replaces may have seen all of the node's (torchrun's
    ``LOCAL_RANK`` indexing, the state of its ``cuda:LOCAL_RANK`` is the one its dropout drew from). The same
    view (as many devices, the same current one) restores every state as it was; any other view restores the
    sender's current device's state into the receiver's current device, and leaves the others alone."""
    if devices <= 0:
        raise HandoffError(f"the RNG state holds {states} CUDA generator(s) but CUDA is not available here")
    if states == devices and sender_current in (None, current):
        return [(i, i) for i in range(states)]
    if sender_current is None:
        if states == 1:
            return [(0, current)]
        raise HandoffError(f"the RNG state holds {states} CUDA generators without the device they were used on, "
                           f"and this process sees {devices}")
    if not 0 <= sender_current < states:
        raise HandoffError(f"the RNG state's current CUDA device {sender_current} is not among its {states} states")
    return [(sender_current, current)]


def restore_rng(state: dict[str, Any]) -> None:
    """Set every global RNG from :func:`capture_rng`'s output (after a handoff: decoded)."""
    if state.get("v") != RNG_VERSION:
        raise HandoffError(f"RNG state version {state.get('v')!r} is not supported (expected {RNG_VERSION})")
    targets: list[tuple[int, int]] = []
    if "cuda" in state:
        # A joiner that cannot continue the sender's CUDA streams is not a faithful replacement.
        available = torch.cuda.is_available()
        current = state.get("cuda_current")
        targets = cuda_rng_targets(len(state["cuda"]), None if current is None else int(current),
                                   torch.cuda.device_count() if available else 0,
                                   torch.cuda.current_device() if available else 0)
    if "numpy" in state and np is None:
        raise HandoffError("the RNG state holds numpy's generator but numpy is not importable here")
    python = state["python"]
    internal = python["internal"]
    internal = tuple(array.array(_U32, internal) if type(internal) is bytes else internal.tolist())
    random.setstate((python["version"], internal, python["gauss_next"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    for index, device in targets:
        torch.cuda.set_rng_state(state["cuda"][index], device)


# ---------------------------------------------------------------------------------------------
# capture / apply


def capture(objects: Mapping[str, Any], *, step: int, rng: dict[str, Any] | None = None,
            extra: Mapping[str, Any] | None = None) -> StateBundle:
    """Snapshot ``objects`` (by ``state_dict()``), plus the step, RNG and extra values.

    No tensor is copied: the caller (a paused leaver, a donor between steps) keeps its state
    still until the bundle has been sent or encoded. Raises HandoffError naming the type and
    path of any value that cannot travel without pickle.
    """
    if type(step) is not int:
        raise HandoffError(f"step must be an int, got {type(step).__name__}")
    encoder = TreeEncoder()
    encoded_objects = {}
    for name, obj in objects.items():
        if type(name) is not str:
            raise HandoffError(f"object names must be str, got {name!r}")
        # (duck typing by hand: isinstance against the runtime-checkable Protocol costs ~12 us, per object,
        # per step in the light snapshot)
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise HandoffError(f"{name!r} ({type(obj).__qualname__}) has no state_dict()/load_state_dict()")
        encoded_objects[name] = encoder.encode(obj.state_dict(), name)
    meta = {
        "v": META_VERSION,
        "step": step,
        "objects": encoded_objects,
        "rng": None if rng is None else encoder.encode(rng, "rng"),
        "extra": None if extra is None else encoder.encode(dict(extra), "extra"),
    }
    return StateBundle(meta=meta, tensors=encoder.tensors)


def apply(bundle: StateBundle, objects: Mapping[str, Any], *, restore_rng_state: bool = True) -> int:
    """Load the bundle into ``objects`` (``load_state_dict`` each), restore RNG, return the step.

    The names must match the captured ones exactly: a missing or unexpected name is a
    HandoffError listing both sides, raised before anything is loaded.
    """
    meta = bundle.meta
    if meta.get("v") != META_VERSION:
        raise HandoffError(f"bundle meta version {meta.get('v')!r} is not supported (expected {META_VERSION})")
    captured = set(meta["objects"])
    given = set(objects)
    if captured != given:
        raise HandoffError(
            "objects do not match the bundle: "
            f"missing from the bundle {sorted(given - captured)}, not given here {sorted(captured - given)}"
        )
    for name, obj in objects.items():
        state = decode_tree(meta["objects"][name], bundle.tensors)
        try:
            obj.load_state_dict(state)
        except Exception as exc:  # whatever the object raises, say which one failed
            raise HandoffError(f"loading the handed-over state into {name!r} failed: {exc}") from exc
    if restore_rng_state and meta.get("rng") is not None:
        restore_rng(decode_tree(meta["rng"], bundle.tensors))
    return int(meta["step"])
