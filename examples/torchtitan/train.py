"""A TorchTitan-style training job built from torchtitan's own components that survives a live swap.

torchtitan 0.3.0's ``ParallelDims`` builds the device mesh (FSDP2, or HSDP with ``--dp-replicate 2``), the model
(a small llama-style decoder: RMSNorm, rotary-free causal attention, SwiGLU) is sharded with FSDP2's
``fully_shard`` per block and at the root (by hand: torchtitan's ``apply_fsdp_to_decoder`` wants its ``Decoder``
model and did not run on CPU here), the optimizer is torchtitan's
``OptimizersContainer`` (``default_adamw``), the LR schedule its ``LRSchedulersContainer`` (warmup + linear decay),
and the step/token counters a ``TrainState`` with torchtitan's Stateful contract. Lines marked ``# tpassrun`` are the
whole integration. Under plain torchrun (the reference) the same file runs unchanged:

    torchrun --standalone --nproc-per-node 4 examples/torchtitan/train.py --dp-replicate 2
    tpassrun --standalone --nproc-per-node 4 --spares-per-node 1 examples/torchtitan/train.py --dp-replicate 2
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.distributed import ParallelDims

import tpassrun                                                       # tpassrun
from tpassrun.adapters.torchtitan import TorchTitanAdapter            # tpassrun
from tpassrun.worker.faultpoints import fault_point


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


@dataclass
class TrainState:
    """torchtitan's TrainState contract (Stateful: step, tokens seen)."""

    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = int(sd["step"]), int(sd["ntokens_seen"])


class TokenStream:
    """A deterministic per-DP-rank stream of token batches (stands in for torchtitan's ParallelAwareDataloader:
    same Stateful contract, no dataset download)."""

    def __init__(self, vocab: int, batch: int, seq: int, dp_rank: int, seed: int) -> None:
        self.vocab, self.batch, self.seq, self.dp_rank, self.seed = vocab, batch, seq, dp_rank, seed
        self.pos = 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + self.dp_rank * 104729 + self.pos)
        self.pos += 1
        return torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)

    def state_dict(self) -> dict:
        return {"dp_rank": self.dp_rank, "pos": self.pos}

    def load_state_dict(self, sd: dict) -> None:
        self.dp_rank, self.pos = int(sd["dp_rank"]), int(sd["pos"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dp-replicate", type=int, default=1, help="2: HSDP (two replica groups of FSDP shards)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    if not torch.cuda.is_available():
        # CPU only: torchtitan 0.3.0 falls back to device "cuda" when it finds no accelerator; build a CPU mesh.
        importlib.import_module("torchtitan.distributed.parallel_dims").device_type = "cpu"
    sess = tpassrun.init(backend="gloo")                              # tpassrun (was: init_process_group)
    world = sess.world_size
    dims = ParallelDims(dp_replicate=args.dp_replicate, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=world)
    dims.build_mesh()
    dp_mesh = dims.get_mesh(["dp_replicate", "dp_shard"] if dims.dp_replicate_enabled else "dp_shard")

    torch.manual_seed(args.seed)
    model = TinyLlama(args.vocab, args.dim, args.layers, heads=4)
    for block in model.layers:                                        # one FSDP unit per block, then the root
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizers = default_adamw(lr=3e-3).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3, decay_ratio=0.5).build(
        optimizers=optimizers, training_steps=args.steps)
    train_state = TrainState()
    batch_mesh = dims.get_optional_mesh("batch")
    dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    data = TokenStream(args.vocab, args.batch, args.seq, dp_rank, args.seed)
    TorchTitanAdapter(sess, [model], optimizers, lr_schedulers, data, train_state,     # tpassrun
                      parallel_dims=dims)

    log = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, f"loss_rank{sess.rank}.jsonl"), "a", buffering=1)

    # named fault points for tests (no effect unless TPASSRUN_FAULTS names them): inside the forward (before the
    # last block's all-gather), mid-backward (the last block's gradients already reduce-scattered), inside the
    # optimizer step (after the update)
    current = [0]

    def die_in_backward(_module: nn.Module, _inputs: object, out: torch.Tensor) -> None:
        out.register_hook(lambda _grad: fault_point(sess.rank, current[0], "backward"))

    model.layers[-1].register_forward_pre_hook(lambda *_: fault_point(sess.rank, current[0], "forward"))
    model.layers[0].register_forward_hook(die_in_backward)
    optimizers.optimizers[0].register_step_post_hook(lambda *_: fault_point(sess.rank, current[0], "opt_step"))

    def step(i: int) -> None:                                         # tpassrun (the loop body as a function)
        current[0] = i
        fault_point(sess.rank, i, "step")
        train_state.step += 1                     # as torchtitan's Trainer: the counters move as the step starts
        tokens = data.next()
        train_state.ntokens_seen += tokens.numel()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        if log is not None:
            # the step's record, once its collectives are done and before it commits (a step re-executed after
            # a failure logged nothing the first time; one that committed has logged)
            log.write(json.dumps({"step": i, "loss": loss.item(), "pid": os.getpid(),
                                  "generation": sess.generation}) + "\n")
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        fault_point(sess.rank, i, "after_opt")
        if args.step_sleep:
            time.sleep(args.step_sleep)           # the user's own work after the step (logging, evaluation)

    sess.run(step, args.steps)                                        # tpassrun (was: for i in range(steps))
    if args.out:
        save_final(os.path.join(args.out, f"final_rank{sess.rank}.pt"), model, optimizers, lr_schedulers,
                   train_state, data)
    torch.distributed.destroy_process_group()   # else gloo's threads may outlive the interpreter: SIGABRT at exit


def save_final(path: str, model: nn.Module, optimizers: object, lr_schedulers: object, train_state: TrainState,
               data: TokenStream) -> None:
    """This rank's final state (its local shards), for the tests to compare with torchrun's."""
    torch.save({"model": {k: v.to_local().clone() for k, v in model.state_dict().items()},
                "optim": {k: (v.to_local().clone() if hasattr(v, "to_local") else v)
                          for k, v in optimizers.state_dict().items()},
                "lr": lr_schedulers.state_dict(), "train_state": train_state.state_dict(),
                "data": data.state_dict()}, path)


def leave_now() -> None:
    """Leave without the interpreter's teardown (everything is written and the process group destroyed). With
    torch 2.13 and gloo, a collective's tensors may still be released by gloo's threads while the interpreter
    shuts down, and the process dies of SIGABRT ("terminate called without an active exception", no Python
    frame) after a successful run: ~1 plain-torchrun run in 5 of train_ddp.py with --zero on 4 ranks here. What
    multiprocessing does at exit still runs first, its finalizers: its temp dir ($TMPDIR/pymp-*, a resource
    sharer's listener) is removed, which os._exit alone would leave behind. (Its children are not joined: a
    DataLoader's workers are stopped by closing the loader, and any left notice this process is gone.)"""
    from multiprocessing import util

    util._run_finalizers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    leave_now()
