"""A step shaped like torchtitan 0.3.0's ``Trainer.train_step``, for the failure-cause tests (tests/test_cause_e2e.py).

The model, data and mesh are examples/torchtitan/train.py's (ParallelDims, FSDP2 per block, torchtitan's optimizer and
LR containers); the step is the Trainer's: the global token count through ``dist_utils.dist_sum_tensor`` (functional
collectives: ``funcol.all_reduce`` + ``funcol.wait_tensor``), the loss normalised by it, grad clipping with
``dist_utils.clip_grad_norm_`` (a DTensor norm, ``full_tensor()``), the optimizer and LR steps, then the metrics:
``dist_sum``/``dist_max`` of the loss and the tokens seen over the loss mesh, and the Trainer's crash on a non-finite
loss. A peer's death surfaces in those reductions as gloo's "Connection reset by peer" raised from ``torch/_ops.py``.
``--wait-in-script``: one more reduction, started ``async_op=True`` and waited here (``handle.wait()`` in the
script's own file, as Megatron's ``tensor_parallel/layers.py`` does). Runs unchanged under torchrun.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils

import tpassrun
from tpassrun.adapters.torchtitan import TorchTitanAdapter
from tpassrun.worker.faultpoints import fault_point

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "torchtitan",
                        "train.py")
_spec = importlib.util.spec_from_file_location("titan_example", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
sys.modules["titan_example"] = example       # (its dataclasses look their module up)
_spec.loader.exec_module(example)


def wait(handle: dist.Work) -> None:
    handle.wait()          # a collective's wait from a file that is not torch's


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dp-replicate", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--wait-in-script", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    importlib.import_module("torchtitan.distributed.parallel_dims").device_type = "cpu"
    sess = tpassrun.init(backend="gloo")
    dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=-1, cp=1, tp=1, pp=1, ep=1,
                        world_size=sess.world_size)
    dims.build_mesh()
    dp_mesh = dims.get_mesh(["dp_replicate", "dp_shard"] if dims.dp_replicate_enabled else "dp_shard")
    torch.manual_seed(args.seed)
    model = example.TinyLlama(args.vocab, args.dim, 2, heads=4)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizers = default_adamw(lr=3e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=args.steps)
    train_state = example.TrainState()
    batch_mesh = dims.get_optional_mesh("batch")
    data = example.TokenStream(args.vocab, args.batch, args.seq,
                               batch_mesh.get_local_rank() if batch_mesh is not None else 0, args.seed)
    TorchTitanAdapter(sess, [model], optimizers, lr_schedulers, data, train_state, parallel_dims=dims)
    log = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, f"loss_rank{sess.rank}.jsonl"), "a", buffering=1)

    def step(i: int) -> None:
        fault_point(sess.rank, i, "step")
        optimizers.zero_grad()
        train_state.step += 1
        tokens = data.next()
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        local_valid_tokens = (labels != -100).sum()
        global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens, batch_mesh)
        if args.wait_in_script:
            check = local_valid_tokens.clone()
            # tests: a rank dies here, before its part of the reduction is sent, and its peers fail in the wait
            # below. (Had it started its own all_reduce first, gloo's background thread could finish the
            # reduction before the SIGKILL lands, so the peers would fail later, in torch's own files.)
            fault_point(sess.rank, i, "wait")
            handle = dist.all_reduce(check, async_op=True)
            wait(handle)
        train_state.ntokens_seen += labels.numel()    # (the Trainer counts them in forward_backward_step)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, args.vocab).float(), labels.reshape(-1),
                               reduction="sum") / global_valid_tokens
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_([q for q in model.parameters()], 1.0, foreach=True)
        if log is not None:
            log.write(json.dumps({"step": i, "loss": loss.item(), "grad_norm": grad_norm.item(),
                                  "pid": os.getpid(), "generation": sess.generation}) + "\n")
        optimizers.step()
        lr_schedulers.step()
        loss_mesh = dims.get_optional_mesh("loss")
        accumulated = loss.detach().clone()
        local_avg = accumulated * global_valid_tokens / local_valid_tokens
        global_avg = dist_utils.dist_sum(accumulated, loss_mesh)
        dist_utils.dist_max(local_avg, loss_mesh)
        dist_utils.dist_sum(torch.tensor(train_state.ntokens_seen, dtype=torch.int64), loss_mesh)
        if not math.isfinite(global_avg):
            raise RuntimeError(f"Loss is not finite (global_avg_loss={global_avg}) at step {train_state.step}.")
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)

    sess.run(step, args.steps)
    if args.out:
        example.save_final(os.path.join(args.out, f"final_rank{sess.rank}.pt"), model, optimizers, lr_schedulers,
                           train_state, data)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    example.leave_now()
