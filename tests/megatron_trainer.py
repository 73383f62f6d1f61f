"""A megatron-core 0.16 training script written the way Megatron-LM's own ``pretrain_gpt.py`` and
``megatron/training/training.py`` are (not the shape of ``examples/megatron/train_gpt.py``), for the tests and
``bench/frameworks.py``: TP x DP on gloo (CPU), one spare.

What Megatron-LM does and this script does too: ``model_provider`` builds a ``GPTModel``; the model is a list of
chunks wrapped in Megatron's ``DistributedDataParallel``; ``config.no_sync_func``, ``config.grad_scale_func``,
``config.finalize_model_grads_func`` wired as ``training.setup_model_and_optimizer`` wires them; the data is a
``DataLoader`` over a ``MegatronPretrainingSampler`` (a copy of Megatron-LM's: megatron-core does not ship it)
built on tensor-parallel rank 0 only, and ``get_batch`` broadcasts each micro-batch to the other TP ranks
(``get_batch_on_this_tp_rank``); ``loss_func`` returns ``(loss, num_tokens, {"lm loss": [sum, count]})``;
``train_step`` zeroes the grad buffers, runs ``get_forward_backward_func()``, steps the optimizer and the
``OptimizerParamScheduler`` and all-reduces the reported loss over the data-parallel group (a collective after
the optimizer step). The integration (``# tpassrun``) is the adapter's: ``tpassrun.init``, ``MegatronAdapter``,
``sess.run``, and the counters in a ``MegatronProgress`` advanced at the step's start, before its first
collective (the adapter's example: the step's whole per-rank state is then known when its backward pass seals
it).

Writes ``loss_rank<R>.jsonl`` (per step: the local per-micro-batch losses, the DP-reduced loss, pid) and
``final_rank<R>.pt`` under ``--out``. Fault points (``TPASSRUN_FAULTS``): ``step`` (a step's start),
``backward`` (in the backward pass), ``finalize`` and ``finalized`` (after the backward pass, before and after the
data-parallel gradient all-reduce). ``--steps`` is ``--train-iters`` (``bench/mirror.py --script`` passes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples", "megatron"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tensor-model-parallel-size", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--train-iters", "--steps", dest="train_iters", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--use-distributed-optimizer", action="store_true", help="shard the optimizer over DP")
    p.add_argument("--clip-grad", type=float, default=0.0, help="gradient clipping (Megatron-LM's default: 1.0)")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", required=True)
    return p.parse_args()


class SyntheticDataset(torch.utils.data.Dataset):
    """Sample ``i``: seq + 1 tokens drawn from a generator seeded with ``i`` (a pure function of the index)."""

    def __init__(self, size: int, seq: int, vocab: int) -> None:
        self.size, self.seq, self.vocab = size, seq, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(idx)
        return {"text": torch.randint(0, self.vocab, (self.seq + 1,), generator=g)}


class MegatronPretrainingSampler:
    """Megatron-LM's ``megatron/training/datasets/data_samplers.py`` sampler: from ``consumed_samples`` on, each
    data-parallel rank takes its micro-batch slice of every ``micro_batch_size * data_parallel_size`` samples."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int) -> None:
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.data_parallel_rank = micro_batch_size, data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self):
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.micro_batch_times_data_parallel_size:
                start = self.data_parallel_rank * self.micro_batch_size
                yield batch[start:start + self.micro_batch_size]
                batch = []


def build_pretraining_data_loader(dataset: Any, consumed_samples: int, args: argparse.Namespace) -> Any:
    from megatron.core import parallel_state as mpu

    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, args.micro_batch_size,
                                         mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=0)


def train_data_iterator(consumed_samples: int, args: argparse.Namespace) -> Any:
    """Built on tensor-parallel rank 0 only (``is_dataset_built_on_rank``); the others receive each batch."""
    from megatron.core import parallel_state as mpu

    if mpu.get_tensor_model_parallel_rank() != 0:
        return None
    samples = args.global_batch_size * (args.train_iters + 1)
    dataset = SyntheticDataset(samples, args.seq_length, args.vocab_size)
    return iter(build_pretraining_data_loader(dataset, consumed_samples, args))


def get_batch(data_iterator: Any, args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """``get_batch_on_this_tp_rank``: TP rank 0 reads the micro-batch and broadcasts it over the TP group."""
    from megatron.core import parallel_state as mpu

    mbs, seq = args.micro_batch_size, args.seq_length
    if mpu.get_tensor_model_parallel_rank() == 0:
        text = next(data_iterator)["text"]
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        loss_mask = torch.ones(mbs, seq)
        attention_mask = torch.triu(torch.ones(mbs, 1, seq, seq), diagonal=1).bool()
        position_ids = torch.arange(seq).unsqueeze(0).expand(mbs, -1).contiguous()
    else:
        tokens, labels = torch.empty(mbs, seq, dtype=torch.int64), torch.empty(mbs, seq, dtype=torch.int64)
        loss_mask = torch.empty(mbs, seq)
        attention_mask = torch.empty(mbs, 1, seq, seq, dtype=torch.bool)
        position_ids = torch.empty(mbs, seq, dtype=torch.int64)
    for item in (tokens, labels, loss_mask, attention_mask, position_ids):
        torch.distributed.broadcast(item, mpu.get_tensor_model_parallel_src_rank(),
                                    group=mpu.get_tensor_model_parallel_group())
    return tokens, labels, loss_mask, attention_mask, position_ids


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[Any, Any, dict]:
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": reporting_loss}


def forward_step(args: argparse.Namespace, data_iterator: Any, model: Any) -> tuple[Any, Any]:
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, args)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def model_provider(args: argparse.Namespace, pre_process: bool = True, post_process: bool = True) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads,
                               tensor_model_parallel_size=args.tensor_model_parallel_size,
                               attention_dropout=args.dropout, hidden_dropout=args.dropout,
                               use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    return GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab_size,
                    max_sequence_length=args.seq_length, pre_process=pre_process, post_process=post_process)


def main() -> None:
    args = parse_args()
    import cpu_shims
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from train_gpt import save_final

    import tpassrun  # tpassrun
    from tpassrun.adapters.megatron import MegatronAdapter, MegatronProgress  # tpassrun
    from tpassrun.worker.faultpoints import fault_point

    cpu_shims.install()
    sess = tpassrun.init(backend="gloo")                                             # tpassrun
    mpu.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)

    # setup_model_and_optimizer
    model = [model_provider(args)]
    config = model[0].config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=args.overlap_grad_reduce,
                                               overlap_param_gather=args.overlap_param_gather,
                                               use_distributed_optimizer=args.use_distributed_optimizer)
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk) for chunk in model]
    with cpu_shims.cuda_factories_on_cpu():
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr / 10,
                                                           weight_decay=0.1, clip_grad=args.clip_grad,
                                                           use_distributed_optimizer=args.use_distributed_optimizer),
                                           model)
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10,
                                        lr_warmup_steps=2 * args.global_batch_size,
                                        lr_decay_steps=args.train_iters * args.global_batch_size,
                                        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=args.train_iters * args.global_batch_size,
                                        wd_incr_style="constant")
    config.no_sync_func = model[0].no_sync
    config.grad_scale_func = optimizer.scale_loss
    rank = sess.rank

    def finalize(*a: Any, **kw: Any) -> Any:
        fault_point(rank, sess.step, "finalize")
        out = finalize_model_grads(*a, **kw)
        fault_point(rank, sess.step, "finalized")
        return out

    config.finalize_model_grads_func = finalize
    # the "backward" fault point: in the backward pass of the step's first micro-batch's last layer
    last = [p for p in model[0].parameters() if p.requires_grad][-1]
    last.register_hook(lambda grad: fault_point(rank, sess.step, "backward"))

    progress = MegatronProgress()                                                    # tpassrun
    train_iterator = train_data_iterator(progress.consumed_train_samples, args)
    adapter = MegatronAdapter(sess, model, optimizer, scheduler, progress=progress,   # tpassrun
                              data_iterator=train_iterator,
                              rebuild_data_iterator=lambda consumed: train_data_iterator(consumed, args))
    dp = mpu.get_data_parallel_world_size()
    num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    forward_backward_func = get_forward_backward_func()

    def train_step() -> tuple[dict[str, float], list[float]]:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        progress.advance(args.global_batch_size)                                     # tpassrun
        losses_reduced = forward_backward_func(
            forward_step_func=partial(forward_step, args), data_iterator=adapter.data_iterator,   # tpassrun
            model=model, num_microbatches=num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=False)
        update_successful, _grad_norm, _num_zeros = optimizer.step()
        if update_successful:
            scheduler.step(increment=args.global_batch_size)
        local = [float(x["lm loss"][0] / x["lm loss"][1]) for x in losses_reduced]
        loss_reduced = {}
        for key in losses_reduced[0]:
            val = torch.vstack([x[key].view(-1) for x in losses_reduced]).sum(dim=0)
            torch.distributed.all_reduce(val, group=mpu.get_data_parallel_group(with_context_parallel=True))
            loss_reduced[key] = float(val[0] / val[1])
        return loss_reduced, local

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, f"loss_rank{rank}.jsonl"), "a", buffering=1)

    def step(iteration: int) -> None:                                                 # tpassrun (the loop body)
        fault_point(sess.rank, iteration, "step")
        with cpu_shims.cuda_factories_on_cpu():
            loss_reduced, local = train_step()
        log.write(json.dumps({"step": iteration, "loss": local, "lm_loss": loss_reduced["lm loss"],
                              "pid": os.getpid(), "generation": sess.generation, "t": time.time()}) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)

    sess.run(step, args.train_iters)                                                   # tpassrun
    save_final(os.path.join(args.out, f"final_rank{sess.rank}.pt"), model[0], optimizer, scheduler, progress)
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
