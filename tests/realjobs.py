"""Shared by the real-framework tests: run an example training script under torchrun (the reference) and under
tpassrun (with a planned swap or an unplanned SIGKILL), and compare what both left behind.

The libraries are real (DeepSpeed, torchtitan, megatron-core); each test module skips, with the reason in the
summary (pytest -ra), only when its library is not installed. CI installs all three (scripts/bootstrap.sh).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
from faults import REPO, Job

CPU_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def example(*parts: str) -> str:
    return os.path.join(REPO, "examples", *parts)


def torchrun_job(out: str, script: str, nproc: int, args: list[str], env: dict[str, str] | None = None) -> Job:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            script, *args, "--out", out]
    return Job(argv=argv, out=out, env={**CPU_ENV, **(env or {})})


def tpassrun_job(out: str, script: str, nproc: int, args: list[str], *, endpoint: str, run_id: str,
                 spares: int = 1, env: dict[str, str] | None = None, extra: list[str] | None = None) -> Job:
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--nproc-per-node", str(nproc), "--spares-per-node", str(spares),
            "--log-dir", os.path.join(out, "logs"), *(extra or []), script, *args, "--out", out]
    return Job(argv=argv, out=out, env={**CPU_ENV, **(env or {})})


def assert_trees_equal(a: Any, b: Any, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_trees_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_trees_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run(job: Job, ref: Job, world: int, *, redone: bool = False) -> None:
    """Final state (whatever the script saved: module, optimizer partition, ...) torch.equal on every rank, and
    the same per-step losses (no step lost or repeated). ``redone``: a recovery may have rolled survivors back
    over steps they had finished and logged (sharded state, tpassrun/worker/shards.py): each step's every logged loss
    must still be the reference's, and no step may be missing."""
    for r in range(world):
        assert_trees_equal(job.final(r), ref.final(r), f"rank {r}")
        la = [(x["step"], x["loss"]) for x in job.losses(r)]
        lb = [(x["step"], x["loss"]) for x in ref.losses(r)]
        if redone:
            want = dict(lb)
            assert {s for s, _ in la} == set(want), f"rank {r}: steps {sorted(set(want) - {s for s, _ in la})} lost"
            bad = [(s, x, want[s]) for s, x in la if x != want[s]]
            assert not bad, f"rank {r}: per-step losses differ from the reference's: {bad[:3]}"
            continue
        assert la == lb, f"rank {r}: per-step losses differ (or a step was lost or repeated)"


def assert_same_training(job: Job, ref: Job, world: int, steps: int) -> None:
    """Every rank's final state (every object of the script with a state_dict) torch.equal to torchrun's, and
    every step done on every rank (a rank rolled back by a recovery logs some steps twice).

    A step may be missing from a rank's log only where that rank's process changed: a rank SIGKILLed after its
    part of step S reached its peers, before it logged S, leaves S done (the peers completed it; the state after
    it is compared) and unlogged (its successor resumes at S + 1). Stop 22's whole-suite run showed this once for
    the Megatron docstring example ("rank 1: steps [14] never done", the state torch.equal)."""
    from faults import unlogged_steps

    for r in range(world):
        assert_trees_equal(job.final(r), ref.final(r), f"rank {r}")
        rows = job.losses(r)
        done = {row["step"] for row in rows}
        missing = set(range(steps)) - done - unlogged_steps(rows, {row["pid"] for row in rows})
        assert not missing, f"rank {r}: steps {sorted(missing)} never done"


def swap_pause_s(job: Job) -> float:
    """From the event log, how long training stood still: from every rank paused at the boundary (planned: until
    then the ranks train on towards it) or from the rank's death (unplanned) to training resumed; -1 if the log
    has no swap."""
    ev = job.events()
    start = next((e["time"] for e in ev if e["event"] == "worker_died"
                  or (e["event"] == "swap_phase" and e.get("phase") == "transfer")), None)
    end = next((e["time"] for e in ev if e["event"] == "swap_resumed"), None)
    return -1.0 if start is None or end is None else end - start


def sigkill_at_random_instant(job: Job, rank: int, step: int, within: float, rng: Any) -> float:
    """SIGKILL ``rank`` from outside at a uniformly random instant of the ``within`` seconds after it logged ``step``
    (wherever it then is: a collective, the optimizer, the script's own code). Returns how far in it struck."""
    from faults import sigkill_rank

    job.wait_step(step, 240, rank=rank)
    delay = rng.uniform(0.0, within)
    time.sleep(delay)
    assert sigkill_rank(job.out, rank) is not None, f"rank {rank} had no process to kill"
    return delay
