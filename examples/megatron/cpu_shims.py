"""CPU stand-ins for megatron-core 0.16.1's GPU-only calls: the one place they live. ``train_gpt.py`` uses them
only when the machine has no CUDA; on GPUs nothing here is imported.

megatron-core's training path assumes CUDA in a handful of places, found by running ``train_gpt.py`` on a machine
without CUDA until it trained. Each stand-in below replaces exactly one of those calls, nothing else:

=====================================================  ================================================  ==========
GPU-only call                                          used by                                           stand-in
=====================================================  ================================================  ==========
``torch.cuda.current_device()`` as a tensor device     global memory buffer (attention), DDP grad        ``"cpu"``
                                                       buffers (``param_and_grad_buffer``)
``torch.cuda.get_rng_state`` / ``manual_seed``,        the RNG tracker (``model_parallel_cuda_manual_    the CPU
``tensor_parallel.random._get/_set_cuda_rng_state``    seed``, ``get_cuda_rng_tracker().fork()`` around  default
                                                       tensor-parallel dropout)                          generator
``torch.tensor/zeros(..., device="cuda")``             ``FP32Optimizer.__init__``, the grad-norm of      ``"cpu"``
                                                       ``ChainedOptimizer.step``, the schedule's token   (scoped:
                                                       count                                             see below)
``torch.cuda.synchronize()``                           ``dist_checkpointing``                            no-op
``Tensor.type()`` compared with ``"torch.cuda.Float``  the DistributedOptimizer's parameter sort         the CUDA
``Tensor"`` (or ``HalfTensor``, ``BFloat16Tensor``)    (``distrib_optimizer.py``), ``FP32Optimizer``/    type name
                                                       ``Float16Optimizer``, gradient clipping's         (scoped:
                                                       assertion (``clip_grads.py``)                     see below)
=====================================================  ================================================  ==========

The hard-coded ``device="cuda"`` factories are rewritten only inside :func:`cuda_factories_on_cpu` (a
``TorchFunctionMode``), which ``train_gpt.py`` enters around building the optimizer and around each training
step. ``Tensor.type()`` answers with the CUDA type name only to a call without arguments made from
``megatron.core.optimizer`` itself; everywhere else it is torch's own. On CPU the "CUDA" RNG streams are states
of the CPU default generator, so megatron's check that the CPU generator is unchanged inside ``fork()`` always
trips: its warning is silenced.

With these the DistributedOptimizer (``--use-distributed-optimizer``) and gradient clipping train on CPU in fp32.
Still impossible on CPU, shim or not: bf16/fp16 mixed precision (``Float16OptimizerWithFloat16Params``),
Transformer Engine layers, NCCL.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

TESTED_MEGATRON_CORE = "0.16.1"


def install() -> None:
    """Point megatron-core's GPU-only calls at the CPU (process-wide; call once, before building anything)."""
    from megatron.core.tensor_parallel import random as mrandom

    for name in ("_get_cuda_rng_state", "_set_cuda_rng_state"):
        if not hasattr(mrandom, name):
            raise RuntimeError(f"cpu_shims: megatron.core.tensor_parallel.random.{name} is gone (tested with "
                               f"megatron-core {TESTED_MEGATRON_CORE})")
    torch.cuda.current_device = lambda: "cpu"                         # type: ignore[assignment]
    torch.cuda.synchronize = lambda *_a, **_k: None                   # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()     # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)     # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    _install_cuda_type_names()


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _install_cuda_type_names() -> None:
    """``Tensor.type()`` without arguments, called from ``megatron.core.optimizer``, names a CPU float tensor by its
    CUDA type (the DistributedOptimizer sorts parameters and ``clip_grads`` asserts on those names). Any other
    call, or any other caller, gets torch's own answer."""
    original = torch.Tensor.type
    if getattr(original, "_cpu_shim", False):
        return

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs:
            return name
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("megatron.core.optimizer"):
            return _CUDA_TYPE_NAMES.get(name, name)
        return name

    type_._cpu_shim = True   # type: ignore[attr-defined]
    torch.Tensor.type = type_   # type: ignore[method-assign]


class _CudaFactoriesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_factories_on_cpu() -> Iterator[None]:
    """Inside: a tensor megatron-core creates with ``device="cuda"`` is created on the CPU."""
    with _CudaFactoriesOnCpu():
        yield
