"""A megatron-core GPT pre-training loop that survives a rank swap under tpassrun (GPUs + megatron-core).

    tpassrun --nnodes 2 --nproc-per-node 8 --spares-per-node 1 --rdzv-backend etcd \\
        --rdzv-endpoint ETCD:2379 --rdzv-id job examples/megatron/train_gpt.py --tp 2 --pp 2

Synthetic tokens (a pure function of the sample index) keep the example self-contained; swap in your dataset
and keep ``consumed_train_samples`` as the data position. On a machine without CUDA this exits with one line,
unless ``--cpu-smoke``, which runs only what megatron-core can do on CPU: ``parallel_state`` over gloo, a tiny
GPTModel built with ``use_cpu_initialization``, the adapter's capture/apply of the model state through the
handoff codec, and a parallel_state re-initialisation with cached groups re-pointed.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

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
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="shard optimizer state over DP (then only planned swaps are exact)")
    p.add_argument("--cpu-smoke", action="store_true", help="run the CPU-capable parts only (gloo, tiny model)")
    return p.parse_args()


def synthetic_batch(sample_index: int, micro_batch: int, seq: int, vocab: int, device: Any) -> dict[str, Any]:
    """Tokens for samples [sample_index, sample_index + micro_batch): a pure function of the index, so the
    data position is just ``consumed_train_samples`` and a joiner needs nothing else."""
    g = torch.Generator().manual_seed(sample_index)
    tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(micro_batch, -1)
    return {"tokens": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
            "position_ids": position_ids.to(device), "loss_mask": torch.ones(micro_batch, seq, device=device)}


def build_gpt(args: argparse.Namespace, *, cpu: bool) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, context_parallel_size=args.cp,
        use_cpu_initialization=cpu, params_dtype=torch.float32 if cpu else torch.bfloat16, bf16=not cpu,
        pipeline_dtype=torch.float32 if cpu else torch.bfloat16)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    return model if cpu else model.cuda()


def cpu_smoke(args: argparse.Namespace) -> None:
    import tpassrun
    from megatron.core import parallel_state as ps

    from tpassrun import handoff
    from tpassrun.adapters.megatron import MegatronAdapter, ModelChunksState

    sess = tpassrun.init(backend="gloo")
    ps.initialize_model_parallel(args.tp, args.pp, context_parallel_size=args.cp)
    torch.manual_seed(args.seed)
    model = build_gpt(args, cpu=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)   # Megatron's optimizers need CUDA
    adapter = MegatronAdapter(sess, model, optimizer, None)
    bundle = handoff.capture({"model": adapter.model_state}, step=0)
    data = handoff.encode_small(bundle)
    torch.manual_seed(args.seed + 1)
    joiner = build_gpt(args, cpu=True)
    handoff.apply(handoff.decode_small(data), {"model": ModelChunksState(joiner)}, restore_rng_state=False)
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), joiner.state_dict().values())
               if isinstance(a, torch.Tensor))
    replaced = adapter.reconfigure()
    print(f"rank {sess.rank}: tp={ps.get_tensor_model_parallel_world_size()} "
          f"pp={ps.get_pipeline_model_parallel_world_size()} dp={ps.get_data_parallel_world_size()} "
          f"params={sum(p.numel() for p in model.parameters())} handoff={len(data)}B identical={same} "
          f"regrouped={replaced} donor={adapter.donor_for(sess.rank, sess.world_size)}", flush=True)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    if not same:
        sys.exit(1)


def train(args: argparse.Namespace) -> None:
    import tpassrun
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tpassrun.adapters.megatron import MegatronAdapter

    sess = tpassrun.init(backend="nccl")
    torch.cuda.set_device(sess.local_rank)
    ps.initialize_model_parallel(args.tp, args.pp, context_parallel_size=args.cp)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed + 100 * ps.get_pipeline_model_parallel_rank())
    torch.manual_seed(args.seed)

    model = build_gpt(args, cpu=False)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.distributed_optimizer,
                                               overlap_grad_reduce=False, grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=True, use_distributed_optimizer=args.distributed_optimizer,
                        clip_grad=1.0), [model])
    dp = ps.get_data_parallel_world_size()
    global_batch = args.micro_batch * args.num_microbatches * dp
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10,
                                        lr_warmup_steps=100 * global_batch, lr_decay_steps=args.steps * global_batch,
                                        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=args.steps * global_batch, wd_incr_style="constant")
    # A joiner receives model, optimizer, scheduler, RNG tracker and counters right here.
    adapter = MegatronAdapter(sess, [model], optimizer, scheduler)
    if sess.rank == 0 and not adapter.replicated:
        print("note: DistributedOptimizer shards are unique; unplanned failures cannot be replayed exactly",
              flush=True)

    forward_backward = get_forward_backward_func()
    dp_rank = ps.get_data_parallel_rank()

    def micro_batches() -> Any:
        start = adapter.progress.consumed_train_samples + dp_rank * args.micro_batch * args.num_microbatches
        for i in range(args.num_microbatches):
            yield synthetic_batch(start + i * args.micro_batch, args.micro_batch, args.seq, args.vocab, "cuda")

    def forward_step(data_iterator: Any, gpt: Any) -> tuple[Any, Any]:
        batch = next(data_iterator)
        output = gpt(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
            loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"lm loss": loss.detach()}

        return output, partial(loss_func, batch["loss_mask"])

    def step(iteration: int) -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=micro_batches(), model=[model],
                                  num_microbatches=args.num_microbatches, seq_length=args.seq,
                                  micro_batch_size=args.micro_batch, forward_only=False)
        ok, _grad_norm, _zeros = optimizer.step()
        if ok:
            scheduler.step(increment=global_batch)
        adapter.progress.advance(global_batch)
        if sess.rank == 0 and iteration % 10 == 0 and losses:
            print(f"iter {iteration} loss {losses[-1]['lm loss'].item():.4f} swaps {sess.swaps}", flush=True)

    sess.step = adapter.progress.iteration    # a joiner resumes at the leaver's iteration
    sess.run(step, args.steps)
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def main() -> None:
    args = parse_args()
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        sys.exit("train_gpt.py: megatron-core is not installed (pip install megatron-core)")
    if args.cpu_smoke:
        cpu_smoke(args)
        return
    if not torch.cuda.is_available():
        sys.exit("train_gpt.py: megatron-core training needs CUDA GPUs; use --cpu-smoke for the CPU-capable parts")
    train(args)


if __name__ == "__main__":   # Megatron's async checkpoint writer spawns processes: keep this guard
    main()
