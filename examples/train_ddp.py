"""A small, self-contained DDP training job that survives a live swap.

Everything a real job carries is here: dropout (so RNG matters), per-rank seeds, AdamW, an LR schedule, and
shuffled data through a stateful sampler. Run it under torchrun or tpassrun unchanged:

    tpassrun --standalone --nproc-per-node 4 --spares-per-node 1 examples/train_ddp.py --steps 200

With tpassrun, ``tpassctl taint --rank 1 ...`` (or a failing GPU) moves rank 1 to the spare between two
steps; the other ranks keep their processes and memory, and the run ends bit-identical to one without the
swap. ``--out DIR`` writes the per-step losses and the final state of every rank there.

``--device cuda``: the model, data and optimizer on this worker's GPU (``LOCAL_RANK``; a spare's is its own),
dropout drawing from the CUDA generator; ``--backend nccl`` or gloo with CUDA tensors (``scripts/gpu_check.sh``).

``--zero``: the optimizer state is sharded by hand, ZeRO-1 style (:class:`ZeroAdamW`): no other rank holds a
rank's slice, so the script tracks it with ``sess.track_sharded`` and tpassrun mirrors it to a buddy's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import tpassrun
from tpassrun.worker.faultpoints import fault_point


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


class ZeroAdamW:
    """ZeRO-1 by hand (what DeepSpeed's stage 1 does): every rank keeps the whole model, and the fp32 master copy
    and AdamW state of one 1/world slice of the flattened parameters only. :meth:`step` updates this rank's slice
    from the (all-reduced) gradients, then all-gathers every slice into the model."""

    def __init__(self, params, rank: int, world: int, **adamw) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world = rank, world
        self.size = -(-sum(p.numel() for p in self.params) // world)
        self.shard = torch.nn.Parameter(self._flat([p.detach() for p in self.params])[self._mine()].clone())
        self.inner = torch.optim.AdamW([self.shard], **adamw)

    def _mine(self) -> slice:
        return slice(self.rank * self.size, (self.rank + 1) * self.size)

    def _flat(self, tensors) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return F.pad(flat, (0, self.size * self.world - flat.numel()))

    def step(self) -> None:
        self.shard.grad = self._flat([p.grad for p in self.params])[self._mine()].clone()
        self.inner.step()
        mine = self.shard.detach()
        if mine.is_cuda and dist.get_backend() == "gloo":
            mine = mine.cpu()              # gloo's all_gather takes CPU tensors only
        parts = [torch.empty(self.size, device=mine.device) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        full = torch.cat(parts).to(self.shard.device)
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.shard.grad = None

    drop_grads = zero_grad          # tpassrun: a failed step's gradients are forgotten

    def commit_optimizers(self) -> list:
        return [self.inner]         # tpassrun: its step() is where this rank's slice starts changing

    copy_at_start = True            # tpassrun: state_dict() changes nothing before the first step: step 0 is
                                    # mirrored too, a death inside it recovered live

    def state_dict(self) -> dict:
        return {"rank": self.rank, "world": self.world, "shard": self.shard.detach(), "inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if (state["rank"], state["world"]) != (self.rank, self.world):
            raise ValueError(f"slice {state['rank']}/{state['world']} handed to {self.rank}/{self.world}")
        with torch.no_grad():
            self.shard.copy_(state["shard"])
        self.inner.load_state_dict(state["inner"])


class Pending:
    """Per-step records kept until the optimizer step."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def state_dict(self) -> dict:
        return {"rows": [dict(r) for r in self.rows]}

    def load_state_dict(self, d: dict) -> None:
        self.rows = [dict(r) for r in d["rows"]]


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
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: this worker's GPU (torch.cuda.set_device(LOCAL_RANK))")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--zero", action="store_true", help="shard the optimizer state by hand (ZeRO-1, ZeroAdamW)")
    p.add_argument("--ddp", choices=("session", "torch"), default="session",
                   help="session: sess.ddp(model); torch: DistributedDataParallel(model), re-created on reconfigure")
    # the usual shapes of a training script, each off by default
    p.add_argument("--compile", action="store_true", help="torch.compile the model, then wrap it in DDP")
    p.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off",
                   help="CPU autocast in this dtype, with a torch.amp.GradScaler")
    p.add_argument("--micro", type=int, default=1,
                   help="micro-batches per step (gradient accumulation inside a step, no_sync on all but the last)")
    p.add_argument("--accum-steps", type=int, default=1,
                   help="an optimizer step every k-th step (no_sync on the others)")
    p.add_argument("--loader-workers", type=int, default=None,
                   help="draw batches from a DataLoader with a DistributedSampler and this many worker processes")
    p.add_argument("--metric-allreduce", choices=("off", "after_opt", "end"), default="off",
                   help="all-reduce the loss for logging right after the optimizer step, or at the end of the step")
    args = p.parse_args()

    if args.device == "cuda":    # before init: NCCL binds to the current device (fewer GPUs than ranks: shared)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sess = tpassrun.init(backend=args.backend)
    rank, world = sess.rank, sess.world_size

    torch.manual_seed(args.seed)                       # identical initial weights on every rank
    model = Net(args.dim, args.hidden).to(device)
    sess.track(model=model)                            # before DDP: a joiner loads its weights first
    net = torch.compile(model) if args.compile else model
    if args.ddp == "session":
        ddp = sess.ddp(net)                            # rebuilt automatically after a swap
    else:                                              # what a torchrun script does, rebuilt by hand
        ddp = DistributedDataParallel(net)

        @sess.on_reconfigure
        def _rebuild_ddp() -> None:
            nonlocal ddp
            ddp = DistributedDataParallel(net)
    if args.zero:                                      # this rank's optimizer slice is its alone: mirrored
        opt = ZeroAdamW(model.parameters(), rank, world, lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt.inner, lambda s: 1.0 / (1.0 + 0.01 * s))
        sess.track_sharded(optimizer=opt)
        sess.track(scheduler=sched)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
        sess.track(optimizer=opt, scheduler=sched)
    scaler = None
    if args.amp != "off":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)   # skips some steps (inf)
        sess.track(scaler=scaler)
    autocast = ((lambda: torch.autocast("cpu", dtype=getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[args.amp])))
                if args.amp != "off" else contextlib.nullcontext)

    g = torch.Generator().manual_seed(args.seed + 7)   # the dataset, the same everywhere
    xs = torch.randn(args.samples, args.dim, generator=g)
    ys = (xs.sum(dim=1, keepdim=True) * 0.1).sin()
    xs, ys = xs.to(device), ys.to(device)
    if args.loader_workers is None:
        sampler = ShuffledSampler(args.samples, rank, world, args.seed)

        def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
            idx = sampler.next(args.batch)
            return xs[idx], ys[idx]
    else:                                              # the most common data path
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

        from tpassrun.adapters.data import ResumableLoader

        dataset = TensorDataset(xs, ys)
        loader = DataLoader(dataset, batch_size=args.batch, num_workers=args.loader_workers, drop_last=True,
                            sampler=DistributedSampler(dataset, num_replicas=world, rank=rank, seed=args.seed))
        sampler = ResumableLoader(loader)              # the batches taken so far travel, not the workers' prefetch
        next_batch = sampler.next
    sess.track(sampler=sampler)
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
    # (torch.compile must call, not trace, it: a fault point has side effects)
    model.register_forward_pre_hook(torch.compiler.disable(lambda *_: fault_point(sess.rank, current[0], "forward")))
    (opt.inner if args.zero else opt).register_step_post_hook(lambda *_: fault_point(sess.rank, current[0], "opt_step"))

    # The records of the steps since the last optimizer step (gradient accumulation across steps): per-rank
    # state, written out at the optimizer step, so a window re-executed after a failure is logged once.
    pending = Pending()
    if args.accum_steps > 1:
        sess.track_per_rank(pending=pending)

    def step(i: int) -> None:
        current[0] = i
        fault_point(sess.rank, i, "step")
        commit = (i + 1) % args.accum_steps == 0 or i == args.steps - 1
        if i % args.accum_steps == 0:
            opt.zero_grad(set_to_none=True)
        total, rows = 0.0, []
        for m in range(args.micro):
            x, y = next_batch()
            fault_point(sess.rank, i, "load")
            last = m == args.micro - 1
            with (ddp.no_sync() if not (commit and last) else contextlib.nullcontext()):
                with autocast():
                    loss = F.mse_loss(ddp(x).float(), y) / (args.micro * args.accum_steps)
                total += loss.item()
                if last:   # the records are per-rank state: settled before the last backward ends
                    pending.rows.append({"step": i, "loss": total})
                    if commit:
                        rows, pending.rows = pending.rows, []
                (scaler.scale(loss) if scaler is not None else loss).backward()
        fault_point(sess.rank, i, "synced")     # the step's collectives done, before its records and its commit
        if commit:
            if loss_log is not None:
                # the step's record, written once its collectives are done and before it commits: a step that
                # is re-executed after a failure logged nothing the first time, one that committed logged already
                for row in rows:
                    loss_log.write(json.dumps({**row, "pid": os.getpid(), "t": time.time(),
                                               "generation": sess.generation}) + "\n")
            fault_point(sess.rank, i, "logged")      # as "synced", its records written
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            fault_point(sess.rank, i, "after_opt")
            if args.metric_allreduce == "after_opt":
                dist.all_reduce(torch.tensor([total], device=device))
            sched.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)   # the user's own work after the step (logging, evaluation, saving)
        fault_point(sess.rank, i, "user")
        if args.metric_allreduce == "end":
            dist.all_reduce(torch.tensor([total], device=device))     # a logging collective after the optimizer step
        if not args.quiet and sess.rank == 0 and i % 50 == 0:
            print(f"step {i} loss {total:.6f} world {sess.world_size} swaps {sess.swaps}", flush=True)
        fault_point(sess.rank, i, "end")

    fault_point(sess.rank, 0, "init")    # before the first step
    sess.run(step, args.steps)
    fault_point(sess.rank, args.steps, "done")    # after the training loop, before the script's own final save
    if args.out:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                    "sampler": sampler.state_dict(), "scaler": scaler.state_dict() if scaler is not None else None,
                    "pid": os.getpid(), "joined": sess.joined, "steps": sess.step}, os.path.join(args.out,
                    f"final_rank{sess.rank}.pt"))
    if not args.quiet and sess.rank == 0:
        print(f"done: {sess.step} steps, world {sess.world_size}", flush=True)
    if hasattr(sampler, "close"):
        sampler.close()    # DataLoader workers exit by themselves, not killed with us (tpassrun.adapters.data)
    dist.destroy_process_group()


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
