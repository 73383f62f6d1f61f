"""A DeepSpeed training script, written the way DeepSpeed users write it, that survives a live swap.

``deepspeed.initialize`` with a JSON config (AdamW + WarmupLR, any ZeRO stage 0-3; ``ds_config_zero3.json``: ZeRO-3 with
gradient accumulation, gradient clipping and WarmupDecayLR), ``engine(x)``,
``engine.backward(loss)``, ``engine.step()``, data through a ``DataLoader`` with a ``DistributedSampler``. The lines
marked ``# tpassrun`` are all it takes (see README.md for the diff against the stock script). The same file runs
under plain ``torchrun`` (tpassrun.init() then just initialises the process group), which is the reference:

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 2 examples/deepspeed/train.py --zero-stage 1
    DS_ACCELERATOR=cpu tpassrun --standalone --nproc-per-node 2 --spares-per-node 1 examples/deepspeed/train.py --zero-stage 1

``--out DIR`` writes every rank's per-step losses and its final module and optimizer partition there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import deepspeed
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tpassrun                                                   # tpassrun
from tpassrun.adapters.data import ResumableLoader                # tpassrun
from tpassrun.adapters.deepspeed import DeepSpeedAdapter          # tpassrun
from tpassrun.adapters.deepspeed import zero3_partition           # (--out only: what the tests compare)
from tpassrun.worker.faultpoints import fault_point

HERE = os.path.dirname(os.path.abspath(__file__))


class Net(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(dim, hidden)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=os.path.join(HERE, "ds_config.json"))
    p.add_argument("--zero-stage", type=int, default=None, help="override zero_optimization.stage")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra work per step")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    if os.environ.get("DS_ACCELERATOR") == "cpu":
        # CPU only: skip JIT-building DeepSpeed's shared-memory all-reduce (~50 s of g++), unused by training.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    with open(args.config) as fh:
        config = json.load(fh)
    if args.zero_stage is not None:
        config["zero_optimization"]["stage"] = args.zero_stage

    sess = tpassrun.init(backend="gloo")                          # tpassrun (was: deepspeed.init_distributed())
    deepspeed.init_distributed(dist_backend="gloo")               # a no-op once the process group exists
    torch.manual_seed(args.seed)
    model = Net(args.dim, args.hidden)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    g = torch.Generator().manual_seed(args.seed + 7)
    xs = torch.randn(args.samples, args.dim, generator=g)
    dataset = TensorDataset(xs, (xs.sum(dim=1, keepdim=True) * 0.1).sin())
    sampler = DistributedSampler(dataset, num_replicas=engine.dp_world_size,
                                 rank=engine.global_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler)
    batches = ResumableLoader(loader)                             # tpassrun (the data position travels)
    DeepSpeedAdapter(sess, engine, data_loader=batches)           # tpassrun
    torch.manual_seed(args.seed + 1 + engine.global_rank)        # per-rank dropout streams

    log = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, f"loss_rank{engine.global_rank}.jsonl"), "a", buffering=1)
    current = [0]
    engine.module.fc1.weight.register_hook(lambda grad: fault_point(sess.rank, current[0], "backward"))

    def step(i: int) -> None:                                     # tpassrun (the loop body, as a function)
        current[0] = i
        fault_point(sess.rank, i, "step")                         # tests: a fault or a hold at the step's start
        x, y = batches.next()
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if log is not None:
            log.write(json.dumps({"step": i, "loss": loss.item(), "pid": os.getpid(), "t": time.time(),
                                  "generation": sess.generation}) + "\n")

    sess.run(step, args.steps)                                    # tpassrun (was: for i in range(steps): ...)
    if args.out:
        torch.save(final_state(engine), os.path.join(args.out, f"final_rank{engine.global_rank}.pt"))
    torch.distributed.destroy_process_group()   # else gloo's threads may outlive the interpreter: SIGABRT at exit


def final_state(engine) -> dict:
    """The module, and this rank's optimizer partition as plain tensors (fp32 master shard under ZeRO)."""
    opt = engine.optimizer
    if engine.zero_optimization_stage() >= 3:     # this rank's parameter partition and the persistent ones
        # without the alignment padding (uninitialized memory nothing reads: it differs run to run under torchrun)
        return {**zero3_partition(engine), "scheduler": engine.lr_scheduler.state_dict(),
                "global_steps": engine.global_steps, "micro_steps": engine.micro_steps}
    if engine.zero_optimization_stage() >= 1:
        base = opt.optimizer.state_dict()
        fp32 = [t.detach().clone() for t in opt.single_partition_of_fp32_groups]
    else:
        base, fp32 = opt.state_dict(), []
    state = {pid: {k: v for k, v in st.items() if torch.is_tensor(v)} for pid, st in base["state"].items()}
    return {"module": engine.module.state_dict(), "fp32": fp32, "optim": state,
            "scheduler": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps}


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
