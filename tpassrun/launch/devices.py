"""Which accelerator each local slot owns, and what a worker in that slot is told.

A node has ``--nproc-per-node`` active slots followed by ``--spares-per-node`` spare slots; slot ``i`` owns
the ``i``-th visible GPU (``CUDA_VISIBLE_DEVICES`` when set, else NVML's devices in order; the health monitor
maps a GPU back to a slot the same way, ``health.device_for_local_rank``). So a layout needs
``nproc + spares`` GPUs, and one that needs more than the node has is refused at start (:func:`check_layout`).

What a worker sees (:func:`slot_env`), when the node has GPUs:

* an active rank in its own slot (local rank ``k`` in slot ``k``): exactly torchrun's environment;
* an active rank whose slot is not its local rank (after a taint quarantined a slot, a restart places the
  ranks on the remaining healthy slots): ``LOCAL_RANK`` stays the rank's local rank, and
  ``CUDA_VISIBLE_DEVICES`` is the visible list with two entries exchanged so that entry ``LOCAL_RANK`` is the
  slot's GPU. ``torch.cuda.set_device(LOCAL_RANK)`` (what torchrun scripts do) lands on the slot's GPU, and
  never on the tainted one;
* a spare (it does not know yet which rank it will take over): ``CUDA_VISIBLE_DEVICES`` is its own GPU only
  and ``LOCAL_RANK=0``, as torchrun's ``--virtual-local-rank`` does, so ``cuda:0`` / ``set_device(LOCAL_RANK)``
  is the spare's GPU before and after it joins (a join changes ``RANK``/``WORLD_SIZE``, never ``LOCAL_RANK``);
* ``--virtual-local-rank``: ``LOCAL_RANK=0`` and ``CUDA_VISIBLE_DEVICES`` = the slot's GPU, for every slot.

Without GPUs (no NVML, ``CUDA_VISIBLE_DEVICES`` unset) nothing changes: ``LOCAL_RANK`` is the local rank, or
the slot index for a spare.

Slots sharing GPUs (``TPASSRUN_SHARE_GPUS=1``, opt-in, for tests and single-GPU workstations): a layout with
more slots than GPUs is not refused; slot ``i`` uses GPU ``i mod n`` (:func:`shared_devices`), and every slot
of a shared GPU sees only that GPU, as ``cuda:0`` with ``LOCAL_RANK=0`` (as a spare does), since
``CUDA_VISIBLE_DEVICES`` cannot name a GPU twice. NCCL cannot put two ranks of one communicator on one GPU:
a shared layout runs gloo (CUDA tensors or CPU), or NCCL only when no two *ranks* share a GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from tpassrun.settings import envnames as E

__all__ = ["check_layout", "node_devices", "shared_devices", "slot_env", "visible_devices"]


def visible_devices(cuda_visible: str | None, nvml_count: int | None) -> list[str] | None:
    """The node's GPUs as ``CUDA_VISIBLE_DEVICES`` entries, in slot order; ``None``: no GPU known (a CPU job).

    ``CUDA_VISIBLE_DEVICES`` wins when set (an empty value, or one starting with ``-1``, hides every GPU);
    else NVML's device count gives ``0..n-1``."""
    if cuda_visible is not None:
        entries = [e.strip() for e in cuda_visible.split(",")]
        visible: list[str] = []
        for entry in entries:
            if not entry or entry.startswith("-"):
                break  # CUDA stops at the first invalid entry
            visible.append(entry)
        return visible or None
    if nvml_count:
        return [str(i) for i in range(nvml_count)]
    return None


def node_devices(environ: Mapping[str, str], nvml_count: Callable[[], int | None] | None = None, *,
                 slots: int = 0) -> list[str] | None:
    """:func:`visible_devices` of this node (blocking: NVML is initialised once to count the GPUs); with
    ``TPASSRUN_SHARE_GPUS=1``, stretched over ``slots`` slots (:func:`shared_devices`)."""
    if nvml_count is None:
        from tpassrun.health import nvml_device_count
        nvml_count = nvml_device_count
    devices = visible_devices(environ.get(E.CUDA_VISIBLE_DEVICES), nvml_count())
    return shared_devices(devices, slots) if environ.get(E.TPASSRUN_SHARE_GPUS) == "1" else devices


def shared_devices(devices: list[str] | None, slots: int) -> list[str] | None:
    """Slot ``i``'s GPU is ``devices[i mod n]`` when there are fewer GPUs than ``slots`` (the opt-in of the
    module doc); unchanged otherwise (enough GPUs: every slot owns one, as without the opt-in)."""
    if not devices or slots <= len(devices):
        return devices
    return [devices[i % len(devices)] for i in range(slots)]


def check_layout(nproc: int, spares: int, devices: list[str] | None) -> str | None:
    """Why this layout cannot run on this node (one line), or None. Only spares are checked: with
    ``--spares-per-node 0`` tpassrun does what torchrun does with the same command line."""
    if not devices or spares <= 0 or nproc + spares <= len(devices):
        return None
    n = len(devices)
    fewer = (f"--nproc-per-node {n - spares} --spares-per-node {spares}" if n > spares else
             f"--spares-per-node {max(0, n - nproc)}")
    return (f"--nproc-per-node {nproc} + --spares-per-node {spares} needs {nproc + spares} GPUs, but this node "
            f"has {n} ({','.join(devices)}): each spare owns a GPU. Use fewer ranks per node ({fewer}), or keep "
            f"--nproc-per-node {nproc} --spares-per-node 0 and start the spares as their own node (--spare-node); "
            f"TPASSRUN_SHARE_GPUS=1 lets slots share GPUs (tests, one-GPU workstations)")


def slot_env(slot: int, local_rank: int, devices: list[str] | None, *, spare: bool,
             virtual_local_rank: bool) -> dict[str, str]:
    """``LOCAL_RANK`` / ``CUDA_VISIBLE_DEVICES`` for a worker in ``slot`` (see the module doc); ``{}``: keep
    what torchrun would set."""
    if not devices or slot >= len(devices):
        return {}
    if spare or virtual_local_rank or devices.count(devices[slot]) > 1:   # a shared GPU: only its own
        return {E.LOCAL_RANK: "0", E.CUDA_VISIBLE_DEVICES: devices[slot]}
    if slot == local_rank:
        return {}
    if local_rank >= len(devices):
        return {}  # more ranks than GPUs (possible without spares, as with torchrun): torchrun's environment
    order = list(devices)
    order[local_rank], order[slot] = order[slot], order[local_rank]
    return {E.CUDA_VISIBLE_DEVICES: ",".join(order)}
