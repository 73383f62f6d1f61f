"""megatron-core TP=2 x DP=2 as Megatron-LM's trainer writes it: SIGKILL a random rank at a uniformly random
instant, or move a random rank away (planned swap); is every run live and ``torch.equal`` to torchrun?

    python bench/megatron.py [--kills 10] [--swaps 10] [--iters 16] [--seed S] [--keep]

Each run is ``tests/megatron_trainer.py`` (megatron-core 0.16.1 on gloo: ``GPTModel``, Megatron's DDP, Adam via
``get_megatron_optimizer``, ``OptimizerParamScheduler``, ``get_forward_backward_func``, data on TP rank 0
broadcast to its peer, the loss all-reduced over DP after the optimizer step) under tpassrun, 4 ranks + 1 spare,
``--max-restarts 1``, against the same script under plain torchrun without any fault (one reference run).

* kill: one rank chosen at random is SIGKILLed from outside (``tests/faults.py:sigkill_rank``) once it has
  logged a random step, after a delay drawn uniformly over one step: wherever it is (forward, backward, an
  all-reduce, the optimizer step, between steps). Rank 0 waits at a late step until the kill is done, so the job
  cannot end first.
* swap: rank 0 waits at a random step, a random rank is tainted (``tpassctl taint``), released once the swap's
  boundary is fixed.

Per run: outcome (``live``: recovered or swapped by a spare, no restart; ``fallback``: the console line that says
why; ``user error``: a survivor's failure in the peer's death taken for the script's own, torchrun's path;
``restart``; ``exit N``), exact (final model, optimizer, scheduler, RNG tracker, counters and every logged per-step loss
equal to the reference's; a step re-executed and logged again must log the same loss), unlogged (steps no rank
logged: a mixed commit rolled forward skips the rest of the step it finishes, its logging; shown apart), the
pause. Figures only,
no assertions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from typing import Any

from common import REPO, EtcdServer, Workdir, print_json

sys.path.insert(0, os.path.join(REPO, "tests"))
from faults import hold_at, pids_by_rank, sigkill_rank, taint
from realjobs import swap_pause_s, torchrun_job, tpassrun_job

SCRIPT = os.path.join(REPO, "tests", "megatron_trainer.py")
WORLD = 4


def differences(job: Any, ref: Any) -> list[str]:
    """Why ``job`` is not the reference run (empty: torch.equal everywhere, no step lost, re-logged steps equal)."""
    import torch

    out: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if torch.is_tensor(a):
            if not (torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)):
                out.append(where)
        elif isinstance(a, dict):
            if not isinstance(b, dict) or set(a) != set(b):
                out.append(f"{where} keys")
                return
            for k in a:
                walk(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                out.append(f"{where} length")
                return
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]")
        elif a != b:
            out.append(where)

    for r in range(WORLD):
        try:
            walk(job.final(r), ref.final(r), f"rank {r}")
        except FileNotFoundError:
            out.append(f"rank {r}: no final state")
            continue
        want = {x["step"]: x["loss"] for x in ref.losses(r)}
        bad = sorted({x["step"] for x in job.losses(r) if want.get(x["step"]) != x["loss"]})
        if bad:
            out.append(f"rank {r}: losses differ at steps {bad}")
    return out


def unlogged(job: Any, ref: Any) -> list[int]:
    """Steps some rank never logged: a mixed commit rolled forward finishes a step from the seals and the state of
    the survivors that completed it, skipping the rest of its script (its logging) where it had failed; the
    step's update is in the final state, which :func:`differences` compares."""
    want = {x["step"] for x in ref.losses(0)}
    return sorted({s for r in range(WORLD) for s in want - {x["step"] for x in job.losses(r)}})


def outcome(job: Any, code: int) -> tuple[str, str]:
    """``live``, ``fallback`` (the recovery's own decision, with the console line that says why), ``user error``
    (a survivor's failure in a peer's death taken for the script's own error: torchrun's path, a restart or the
    job's exit), ``restart`` (any other whole-group restart), ``exit N``."""
    lines = [ln.split("] ", 2)[-1] for ln in job.log().splitlines()]
    fallback = next((ln for ln in lines if "recovery decided (fallback)" in ln), "")
    user = next((ln for ln in lines if "a user error, not handed to a spare" in ln), "")
    restart = next((ln for ln in lines if ln.startswith("whole-group restart")), "")
    resumed = [e for e in job.events() if e["event"] in ("swap_resumed", "ranks_recovered")]
    if fallback:
        return ("fallback" if code == 0 else f"fallback, exit {code}"), fallback[:300]
    if user:
        return ("user error" if code == 0 else f"user error, exit {code}"), user[:300]
    if code != 0:
        return f"exit {code}", restart[:300]
    if restart:
        return "restart", restart[:300]
    return ("live" if resumed else "no swap"), ""


def one_run(work: Workdir, etcd: Any, index: int, mode: str, ref: Any, args: argparse.Namespace,
            rng: random.Random) -> dict[str, Any]:
    out = work.sub(f"{mode}-{index}")
    run_id = f"mg-{uuid.uuid4().hex[:8]}"
    victim = rng.randrange(WORLD)
    at = rng.randint(2, args.iters - 6)
    hold = hold_at(out, args.iters - 3 if mode == "kill" else at)
    job = tpassrun_job(out, SCRIPT, WORLD, ["--train-iters", str(args.iters)], endpoint=etcd.endpoint,
                       run_id=run_id, env={"TPASSRUN_FAULTS": json.dumps([hold.fault])},
                       extra=["--max-restarts", "1"]).start()
    note = ""
    try:
        if mode == "kill":
            job.wait_step(at, 400, rank=victim)
            rows = job.losses(0)
            per_step = (rows[-1]["t"] - rows[0]["t"]) / max(1, len(rows) - 1) if rows and "t" in rows[0] else 1.0
            time.sleep(rng.uniform(0.0, per_step))
            killed = sigkill_rank(out, victim)
            note = f"killed rank {victim} after its step {at}" if killed else "kill missed"
            hold.release()
        else:
            hold.wait_reached(job, 400)
            code = taint(etcd.endpoint, run_id, rank=victim, reason=f"bench at step {at}")
            hold.release_after(job, "swap_boundary", timeout=400)
            note = f"tainted rank {victim} at step {at} (tpassctl {code})"
        code = job.wait(600)
    finally:
        hold.release()
        job.kill()
    what, why = outcome(job, code)
    diff = differences(job, ref) if code == 0 else ["did not finish"]
    pids = pids_by_rank(job, WORLD) if code == 0 else {}
    row = {"mode": mode, "run": index, "victim": victim, "step": at, "outcome": what, "exact": not diff,
           "unlogged": unlogged(job, ref) if code == 0 else [],
           "pause_s": round(swap_pause_s(job), 2), "note": note, "why": why, "diff": diff[:3],
           "survivors_kept_pids": all(len(pids.get(r, [])) == 1 for r in range(WORLD) if r != victim) if pids else None}
    print(f"{mode} {index}: {what} exact={row['exact']} unlogged={row['unlogged']} pause={row['pause_s']}s {note} "
          f"{why} {diff[:2]}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}", flush=True)
    rows = []
    with Workdir(keep=args.keep, prefix="tpassrun-bench-megatron-") as work:
        ref = torchrun_job(work.sub("torchrun"), SCRIPT, WORLD, ["--train-iters", str(args.iters)]).start()
        try:
            if ref.wait(600) != 0:
                raise SystemExit(f"the torchrun reference failed:\n{ref.log()[-3000:]}")
        finally:
            ref.kill()
        etcd = EtcdServer().start()
        try:
            for mode, n in (("kill", args.kills), ("swap", args.swaps)):
                for i in range(n):
                    rows.append(one_run(work, etcd, i, mode, ref, args, rng))
        finally:
            etcd.cleanup()
    summary = {}
    for mode in ("kill", "swap"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"runs": len(mine), "live_and_exact": sum(r["outcome"] == "live" and r["exact"] for r in mine),
                         "fallback": sum(r["outcome"].startswith("fallback") for r in mine),
                         "user_error": sum(r["outcome"].startswith("user error") for r in mine),
                         "restart": sum(r["outcome"] == "restart" for r in mine),
                         "exit": sum(r["outcome"].startswith("exit") for r in mine),
                         "silent_divergence": sum(r["outcome"] == "live" and not r["exact"] for r in mine)}
        print(f"{mode}: {summary[mode]}", flush=True)
    print_json({"seed": seed, "summary": summary, "runs": rows})


if __name__ == "__main__":
    main()
