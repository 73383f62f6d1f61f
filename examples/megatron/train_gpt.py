"""A megatron-core GPT pre-training loop that survives a rank swap under tpassrun.

On GPUs (NCCL, bf16, gradient clipping, optionally the DistributedOptimizer), one 8-GPU node, 6 ranks + 2 spares:

    tpassrun --standalone --nproc-per-node 6 --spares-per-node 2 examples/megatron/train_gpt.py --tp 2

On a machine without CUDA the same loop runs on gloo in fp32 (megatron-core 0.16.1's GPU-only calls pointed at the
CPU by ``cpu_shims.py``, the one place they live), e.g. TP=2 x DP=2 with a spare:

    tpassrun --standalone --nproc-per-node 4 --spares-per-node 1 examples/megatron/train_gpt.py --tp 2 \\
        --layers 2 --hidden 32 --heads 4 --seq 16 --vocab 128 --steps 20

megatron-core's own parts: ``parallel_state``, ``GPTModel`` (local layer spec), Megatron's
``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam; ``--use-distributed-optimizer``: Megatron's
DistributedOptimizer, its shards mirrored in a buddy's memory and recovered live from there), the
``OptimizerParamScheduler``, the RNG tracker (``model_parallel_cuda_manual_seed``; dropout in tensor-parallel
regions forks it) and the pipeline schedule (``get_forward_backward_func``). Synthetic tokens are a pure function
of the sample index, and the data iterator is rebuilt from ``consumed_train_samples`` exactly as Megatron's
pre-training sampler is. Lines marked ``# tpassrun`` are the integration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from functools import partial
from typing import Any, Iterator

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="tensor model parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline model parallel size")
    p.add_argument("--cp", type=int, default=1, help="context parallel size")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--num-microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dropout", type=float, default=0.1, help="attention and hidden dropout")
    p.add_argument("--clip-grad", type=float, default=None, help="default 1.0 on GPUs, 0 (off) on CPU")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--use-distributed-optimizer", "--distributed-optimizer", dest="distributed_optimizer",
                   action="store_true", help="shard optimizer state over DP (Megatron's DistributedOptimizer)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="the user's own work after each step")
    p.add_argument("--out", default=None, help="write per-step losses and the final state here")
    return p.parse_args()


def synthetic_batch(sample_index: int, micro_batch: int, seq: int, vocab: int, device: Any) -> dict[str, Any]:
    """Tokens for samples [sample_index, sample_index + micro_batch): a pure function of the index."""
    g = torch.Generator().manual_seed(sample_index)
    tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(micro_batch, -1)
    causal = torch.triu(torch.ones(1, 1, seq, seq), diagonal=1).bool()   # True: masked (Megatron's convention)
    return {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
            "position_ids": position_ids.to(device), "attention_mask": causal.to(device),
            "loss_mask": torch.ones(micro_batch, seq, device=device)}


def batches(consumed: int, args: argparse.Namespace, dp_rank: int, dp_size: int, device: Any) -> Iterator[dict]:
    """Micro-batches from ``consumed`` samples on, this DP rank's share of each global batch: what Megatron's
    pre-training sampler yields, so the position is ``consumed_train_samples`` and nothing else."""
    global_batch = args.micro_batch * args.num_microbatches * dp_size
    while True:
        start = consumed + dp_rank * args.micro_batch * args.num_microbatches
        for i in range(args.num_microbatches):
            yield synthetic_batch(start + i * args.micro_batch, args.micro_batch, args.seq, args.vocab, device)
        consumed += global_batch


def build_gpt(args: argparse.Namespace, *, cpu: bool) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.float32 if cpu else torch.bfloat16
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, context_parallel_size=args.cp,
        attention_dropout=args.dropout, hidden_dropout=args.dropout, use_cpu_initialization=cpu,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=not cpu)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    return model if cpu else model.cuda()


def train(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import tpassrun                                                         # tpassrun
    from tpassrun.adapters.megatron import MegatronAdapter, MegatronProgress    # tpassrun
    from tpassrun.worker.faultpoints import fault_point

    cpu = not torch.cuda.is_available()
    on_device: Any = contextlib.nullcontext
    if cpu:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import cpu_shims

        cpu_shims.install()
        on_device = cpu_shims.cuda_factories_on_cpu
    device = "cpu" if cpu else "cuda"

    sess = tpassrun.init(backend="gloo" if cpu else "nccl")                 # tpassrun (was: init_process_group)
    if not cpu:
        torch.cuda.set_device(sess.local_rank)
    ps.initialize_model_parallel(args.tp, args.pp, context_parallel_size=args.cp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed + 100 * ps.get_pipeline_model_parallel_rank())
    torch.manual_seed(args.seed)

    model = build_gpt(args, cpu=cpu)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.distributed_optimizer,
                                               overlap_grad_reduce=False, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.no_sync_func = model.no_sync                      # as Megatron's training loop sets them up:
    model.config.finalize_model_grads_func = finalize_model_grads  # the schedule all-reduces the gradients
    clip = args.clip_grad if args.clip_grad is not None else (0.0 if cpu else 1.0)
    with on_device():
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr / 10, bf16=not cpu,
                            use_distributed_optimizer=args.distributed_optimizer, clip_grad=clip), [model])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    global_batch = args.micro_batch * args.num_microbatches * dp
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10,
                                        lr_warmup_steps=3 * global_batch, lr_decay_steps=args.steps * global_batch,
                                        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=args.steps * global_batch, wd_incr_style="constant")
    progress = MegatronProgress()        # tpassrun (Megatron keeps iteration, consumed_train_samples in args)
    # A joiner receives model, optimizer, scheduler, RNG tracker, counters and data position right here.
    data = batches(progress.consumed_train_samples, args, dp_rank, dp, device)
    adapter = MegatronAdapter(sess, [model], optimizer, scheduler, progress=progress, data_iterator=data,  # tpassrun
                              rebuild_data_iterator=lambda consumed: batches(consumed, args, dp_rank, dp, device))
    if sess.rank == 0 and not adapter.live_recovery:
        print(f"note: unplanned failures restart the group: {adapter.distopt_limit}", flush=True)

    forward_backward = get_forward_backward_func()
    log = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, f"loss_rank{sess.rank}.jsonl"), "a", buffering=1)

    def forward_step(data_iterator: Any, gpt: Any) -> tuple[Any, Any]:
        batch = next(data_iterator)
        output = gpt(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

        def loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"lm loss": loss.detach().clone()}

        return output, partial(loss_func, batch["loss_mask"])

    def step(iteration: int) -> None:                                       # tpassrun (the loop body)
        fault_point(sess.rank, iteration, "step")
        with on_device():
            model.zero_grad_buffer()
            optimizer.zero_grad()
            # the step consumes a global batch: count it before the step's first collective, so that the step's
            # whole per-rank state is known when its backward pass seals it (a death after that is recovered live)
            progress.advance(global_batch)                                  # tpassrun
            losses = forward_backward(forward_step_func=forward_step, data_iterator=adapter.data_iterator,  # tpassrun
                                      model=[model], num_microbatches=args.num_microbatches, seq_length=args.seq,
                                      micro_batch_size=args.micro_batch, forward_only=False)
            if log is not None:
                log.write(json.dumps({"step": iteration, "loss": [x["lm loss"].item() for x in losses],
                                      "pid": os.getpid(), "generation": sess.generation}) + "\n")
            ok, _grad_norm, _zeros = optimizer.step()
        if ok:
            scheduler.step(increment=global_batch)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if sess.rank == 0 and iteration % 10 == 0 and losses:
            print(f"iter {iteration} loss {losses[-1]['lm loss'].item():.4f} swaps {sess.swaps}", flush=True)

    sess.run(step, args.steps)                                              # tpassrun (was: for iteration in ...)
    if args.out:
        save_final(os.path.join(args.out, f"final_rank{sess.rank}.pt"), model, optimizer, scheduler, progress)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def save_final(path: str, model: Any, optimizer: Any, scheduler: Any, progress: Any) -> None:
    """What the tests compare with torchrun's run: model, optimizer, scheduler, RNG tracker, counters, CPU RNG."""
    from megatron.core import tensor_parallel

    torch.save({"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()
                          if isinstance(v, torch.Tensor)},
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
                "progress": progress.state_dict(), "rng": torch.get_rng_state()}, path)


def main() -> None:
    args = parse_args()
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        sys.exit("train_gpt.py: megatron-core is not installed (pip install megatron-core==0.16.1)")
    train(args)


if __name__ == "__main__":   # Megatron's async checkpoint writer spawns processes: keep this guard
    main()
