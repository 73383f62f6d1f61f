"""A plain torchrun DDP script (no tpassrun import) for the transparent mode: deterministic (the data of a step is a
function of the step and the rank), so a run restored from a snapshot ends ``torch.equal`` to an uninterrupted one.
Appends one JSON line per finished step to ``<out>/loss_rank<RANK>.jsonl``; at the end each rank saves its model
and optimizer state to ``<out>/final_rank<RANK>.pt``."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--out", required=True)
p.add_argument("--quiet", action="store_true", help="accepted for the test harness (tests/faults.py); prints nothing anyway")
args = p.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"loss_rank{rank}.jsonl"), "a") as fh:
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(args.step_sleep)
        fh.write(json.dumps({"step": step, "pid": os.getpid(), "loss": loss.item(), "t": time.time()}) + "\n")
        fh.flush()
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, os.path.join(args.out, f"final_rank{rank}.pt"))
dist.destroy_process_group()
