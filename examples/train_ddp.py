"""A small, self-contained DDP training job that survives a live swap.

Everything a real job carries is here: dropout (so RNG matters), per-rank seeds, AdamW, an LR schedule, and
shuffled data through a stateful sampler. Run it under torchrun or tpassrun unchanged:

    tpassrun --standalone --nproc-per-node 4 --spares-per-node 1 examples/train_ddp.py --steps 200

With tpassrun, ``tpassctl taint --rank 1 ...`` (or a failing GPU) moves rank 1 to the spare between two
steps; the other ranks keep their processes and memory, and the run ends bit-identical to one without the
swap. ``--out DIR`` writes the per-step losses and the final state of every rank there.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import tpassrun
from tpassrun.testing import fault_point


class ShuffledSampler:
    """Each rank walks its own shuffled permutation of the dataset, reshuffled every epoch."""

    def __init__(self, n: int, rank: int, world: int, seed: int) -> None:
        self.n, self.rank, self.world, self.seed = n, rank, world, seed
        self.epoch, self.pos = 0, 0

    def _perm(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
        return torch.randperm(self.n, generator=g)[self.rank::self.world]

    def next(self, batch: int) -> torch.Tensor:
        perm = self._perm()
        if self.pos + batch > len(perm):
            self.epoch, self.pos = self.epoch + 1, 0
            perm = self._perm()
        idx = perm[self.pos:self.pos + batch]
        self.pos += batch
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed, "rank": self.rank, "world": self.world}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self.pos = d["epoch"], d["pos"]
        self.seed, self.rank, self.world = d["seed"], d["rank"], d["world"]


class Net(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.drop(torch.relu(self.fc2(self.drop(torch.relu(self.fc1(x)))))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--out", default=None, help="directory for per-rank loss logs and final state")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--ddp", choices=("session", "torch"), default="session",
                   help="session: sess.ddp(model); torch: DistributedDataParallel(model), re-created on reconfigure")
    args = p.parse_args()

    sess = tpassrun.init(backend="gloo")
    rank, world = sess.rank, sess.world_size

    torch.manual_seed(args.seed)                       # identical initial weights on every rank
    model = Net(args.dim, args.hidden)
    sess.track(model=model)                            # before DDP: a joiner loads its weights first
    if args.ddp == "session":
        ddp = sess.ddp(model)                          # rebuilt automatically after a swap
    else:                                              # what a torchrun script does, rebuilt by hand
        ddp = DistributedDataParallel(model)

        @sess.on_reconfigure
        def _rebuild_ddp() -> None:
            nonlocal ddp
            ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
    sampler = ShuffledSampler(args.samples, rank, world, args.seed)
    sess.track(optimizer=opt, scheduler=sched, sampler=sampler)

    g = torch.Generator().manual_seed(args.seed + 7)   # the dataset, the same everywhere
    xs = torch.randn(args.samples, args.dim, generator=g)
    ys = (xs.sum(dim=1, keepdim=True) * 0.1).sin()
    torch.manual_seed(args.seed + 1 + rank)            # per-rank dropout streams

    loss_log = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        loss_log = open(os.path.join(args.out, f"loss_rank{rank}.jsonl"), "a", buffering=1)

    def bwd_hook(grad: torch.Tensor) -> torch.Tensor:
        fault_point(sess.rank, current[0], "backward")
        return grad

    current = [0]
    model.fc1.weight.register_hook(bwd_hook)
    # named fault points at each phase of a step (no effect unless TPASSRUN_FAULTS names them)
    model.register_forward_pre_hook(lambda *_: fault_point(sess.rank, current[0], "forward"))
    opt.register_step_post_hook(lambda *_: fault_point(sess.rank, current[0], "opt_step"))

    def step(i: int) -> None:
        current[0] = i
        fault_point(sess.rank, i, "step")
        idx = sampler.next(args.batch)
        fault_point(sess.rank, i, "load")
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(xs[idx]), ys[idx])
        loss.backward()
        if loss_log is not None:
            # the step's record, written once its collectives are done and before it commits: a step that is
            # re-executed after a failure logged nothing the first time, one that committed logged already
            loss_log.write(json.dumps({"step": i, "loss": loss.item(), "pid": os.getpid(), "t": time.time(),
                                       "generation": sess.generation}) + "\n")
        opt.step()
        fault_point(sess.rank, i, "after_opt")
        sched.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)   # the user's own work after the step (logging, evaluation, saving)
        fault_point(sess.rank, i, "user")
        if not args.quiet and sess.rank == 0 and i % 50 == 0:
            print(f"step {i} loss {loss.item():.6f} world {sess.world_size} swaps {sess.swaps}", flush=True)
        fault_point(sess.rank, i, "end")

    fault_point(sess.rank, 0, "init")    # before the first step
    sess.run(step, args.steps)
    if args.out:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "sampler": sampler.state_dict(), "pid": os.getpid(), "joined": sess.joined,
                    "steps": sess.step}, os.path.join(args.out, f"final_rank{sess.rank}.pt"))
    if not args.quiet and sess.rank == 0:
        print(f"done: {sess.step} steps, world {sess.world_size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
