"""Megatron's DistributedOptimizer state through tpassrun's codec in a world of one process (gloo, CPU, through
``examples/megatron/cpu_shims.py``), for ``tests/test_adapters.py`` (a process of its own: the shims are
process-wide). A snapshot taken as the shard mirror takes it (``ModelChunksState`` + ``MegatronOptimizerState``,
captured and encoded), then two more steps; the snapshot loaded back into the same objects (a survivor rolled
back) and into freshly built ones (a joiner), the same two steps again: the model ``torch.equal`` both times. Once
after two steps, once at step 0 (the optimizer has no state yet). Prints one ``check: result`` line per check."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "megatron"))

import cpu_shims  # noqa: E402  (examples/megatron, put on the path above)


def build(seed: int) -> tuple[Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                   max_sequence_length=16)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp, module=gpt)
    config.finalize_model_grads_func = finalize_model_grads
    with cpu_shims.cuda_factories_on_cpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                           use_distributed_optimizer=True), [model])
    return model, optimizer


def step(model: Any, optimizer: Any, i: int) -> None:
    from megatron.core.distributed import finalize_model_grads

    with cpu_shims.cuda_factories_on_cpu():
        model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(i))
        mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)
        model(tokens[:, :-1], torch.arange(16).expand(2, -1), mask, labels=tokens[:, 1:]).float().mean().backward()
        finalize_model_grads([model])
        optimizer.step()


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def views(model: Any, optimizer: Any) -> dict[str, Any]:
    from tpassrun.adapters.megatron import MegatronOptimizerState, ModelChunksState

    return {"m": ModelChunksState([model], replicated=False), "o": MegatronOptimizerState(optimizer)}


def check(at: int, label: str) -> None:
    """Snapshot after ``at`` steps; then the survivor's and the joiner's next two steps against the original's."""
    from tpassrun.transfer import handoff

    model, optimizer = build(0)
    for i in range(at):
        step(model, optimizer, i)
    data = handoff.encode_small(handoff.capture(views(model, optimizer), step=at))
    print(f"{label}state_dict at step {at}: ok", flush=True)
    step(model, optimizer, at)
    step(model, optimizer, at + 1)
    want = weights(model)
    handoff.apply(handoff.decode_small(data), views(model, optimizer), restore_rng_state=False)
    step(model, optimizer, at)
    step(model, optimizer, at + 1)
    print(f"{label}survivor rollback equal: {equal(want, weights(model))}", flush=True)
    joiner, joiner_optimizer = build(5)
    handoff.apply(handoff.decode_small(data), views(joiner, joiner_optimizer), restore_rng_state=False)
    step(joiner, joiner_optimizer, at)
    step(joiner, joiner_optimizer, at + 1)
    print(f"{label}joiner equal: {equal(want, weights(joiner))}", flush=True)
    steps = [id(s["step"]) for s in joiner_optimizer.chained_optimizers[0].optimizer.state.values()]
    print(f"{label}joiner step tensors shared: {len(set(steps)) != len(steps)}", flush=True)


def main() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cpu_shims.install()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, 1, True), rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    check(2, "")
    check(0, "fresh ")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
