"""A training script that knows nothing of tpassrun: plain ``init_process_group("env://")`` and DDP, as run
under torchrun. Appends one JSON line per finished step to ``<out>/steps_rank<RANK>.jsonl``."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--step-sleep", type=float, default=0.05)
p.add_argument("--out", required=True)
p.add_argument("--hold-at", type=int, default=-1, help="rank 0 waits at the start of this step until --release exists")
p.add_argument("--release", default="", help="the file a test writes once it has seen the event it waits for")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"steps_rank{rank}.jsonl"), "a") as fh:
    for step in range(args.steps):
        while rank == 0 and step == args.hold_at and not os.path.exists(args.release):
            time.sleep(0.02)      # a test lines its event up here; its peers wait in the step's collective
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        time.sleep(args.step_sleep)
        fh.write(json.dumps({"step": step, "pid": os.getpid(), "local_rank": int(os.environ["LOCAL_RANK"]),
                             "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "t": time.time()}) + "\n")
        fh.flush()
dist.destroy_process_group()
