"""megatron-core TP x DP as Megatron-LM's trainer writes it: SIGKILL a random rank at a uniformly random
instant, move a random rank away (planned swap), kill a whole node; is every run live and ``torch.equal`` to
torchrun? (What the shard mirror costs Megatron's distributed optimizer: bench/mirror.py, the third line.)

    python bench/megatron.py [--kills 10] [--swaps 10] [--nodes 0] [--iters 16] [--tp 2] [--distopt] [--seed S]
    python bench/megatron.py --distopt --kills 10 --swaps 0 --nodes 5         # the DistOpt acceptance
    python bench/megatron.py --distopt --kills 3 --swaps 0 --keep             # ... split into short runs: then
    python bench/megatron.py --distopt --kills 3 --swaps 0 --reference DIR/torchrun   # DIR: the one kept above
    python bench/mirror.py --skip-critical --script tests/megatron_trainer.py \
        -- --tensor-model-parallel-size 1 --use-distributed-optimizer --clip-grad 1.0   # DistOpt: mirror cost

Each run is ``tests/megatron_trainer.py`` (megatron-core 0.16.1 on gloo: ``GPTModel``, Megatron's DDP, Adam via
``get_megatron_optimizer``, ``OptimizerParamScheduler``, ``get_forward_backward_func`` over 2 micro-batches per
step (gradient accumulation), data on TP rank 0 broadcast to its peer, the loss all-reduced over DP after the
optimizer step) under tpassrun, 4 ranks + 1 spare, ``--max-restarts 1``, against the same script under plain
torchrun without any fault (one reference run). ``--distopt`` adds ``--use-distributed-optimizer --clip-grad 1.0``
(Megatron's DistributedOptimizer: each DP rank's fp32 main-param and Adam shard exists on that rank only, kept in
its buddy's memory by tpassrun; gradient clipping as Megatron-LM's default); ``--tp 1`` is DP=4.

* kill: one rank chosen at random is SIGKILLed from outside (``tests/faults.py:sigkill_rank``) once it has
  logged a random step, after a delay drawn uniformly over one step: wherever it is (forward, backward, an
  all-reduce, the optimizer step, between steps). Every third run (``--first-window-every``) kills inside
  step 0 (the first accumulation window, before any refresh of the mirror completed): rank 0 is held at step 0's
  start until the spare is ready, then the kill follows its release by a delay drawn uniformly over one step. Rank 0 waits at a late step
  until the kill is done, so the job cannot end first.
* swap: rank 0 waits at a random step, a random rank is tainted (``tpassctl taint``), released once the swap's
  boundary is fixed.
* node: 2 nodes of 2 ranks and a ``--spare-node`` (3 agents); node B (its agent and workers, SIGKILLed back to
  back: ``sigkill_node``) dies at a random step, a uniformly random instant inside it.
* the mirror's cost (step time with and without it, bytes per refresh, host memory, recovery against torchrun's
  restart): ``bench/mirror.py --script tests/megatron_trainer.py`` (the command above; DP=2, its world).

Per run: outcome (``live``: recovered or swapped by a spare, no restart; ``fallback``: the console line that says
why; ``user error``: a survivor's failure in the peer's death taken for the script's own, torchrun's path;
``restart``; ``exit N``), exact (final model, optimizer, scheduler, RNG tracker, counters and every logged per-step loss
equal to the reference's; a step re-executed and logged again must log the same loss), unlogged (steps no rank
logged: a mixed commit rolled forward skips the rest of the step it finishes, its logging; shown apart), the
pause. Figures only, no assertions. The last line is JSON.
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

from common import REPO, EtcdServer, Workdir, next_step_after, print_json

sys.path.insert(0, os.path.join(REPO, "tests"))
from faults import Job, hold_at, pid_of_rank, pids_by_rank, sigkill_node, sigkill_rank, taint
from realjobs import CPU_ENV, swap_pause_s, torchrun_job, tpassrun_job

SCRIPT = os.path.join(REPO, "tests", "megatron_trainer.py")
WORLD = 4


def script_args(args: argparse.Namespace) -> list[str]:
    out = ["--train-iters", str(args.iters), "--tensor-model-parallel-size", str(args.tp)]
    return out + (["--use-distributed-optimizer", "--clip-grad", "1.0"] if args.distopt else [])


def step_seconds(job: Any, rank: int = 0) -> float:
    rows = job.losses(rank)
    return (rows[-1]["t"] - rows[0]["t"]) / max(1, len(rows) - 1) if len(rows) > 1 and "t" in rows[0] else 1.0


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
    first_window = mode == "kill" and index % args.first_window_every == 0
    at = 0 if first_window else rng.randint(2, args.iters - 6)
    hold = hold_at(out, args.iters - 3 if mode == "kill" else at)
    early = hold_at(out, 0, name="early")
    faults = [hold.fault, early.fault] if first_window else [hold.fault]
    job = tpassrun_job(out, SCRIPT, WORLD, script_args(args), endpoint=etcd.endpoint, run_id=run_id,
                       env={"TPASSRUN_FAULTS": json.dumps(faults)}, extra=["--max-restarts", "1"]).start()
    note = ""
    try:
        if first_window:
            early.wait_reached(job, 400)
            job.wait_event("spare_ready", timeout=400)
            early.release()
            time.sleep(rng.uniform(0.0, step_seconds(ref)))
            killed = kill_started_rank(job, victim)
            note = f"killed rank {victim} inside step 0" if killed else "kill missed"
            hold.release()
        elif mode == "kill":
            job.wait_step(at, 400, rank=victim)
            time.sleep(rng.uniform(0.0, step_seconds(job)))
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
        early.release()
        job.kill()
    what, why = outcome(job, code)
    diff = differences(job, ref) if code == 0 else ["did not finish"]
    pids = pids_by_rank(job, WORLD) if code == 0 else {}
    row = {"mode": mode, "run": index, "victim": victim, "step": at, "outcome": what, "exact": not diff,
           "unlogged": unlogged(job, ref) if code == 0 else [],
           "pause_s": round(swap_pause_s(job), 2), "wall_s": round(time.monotonic() - job.started, 1),
           "note": note, "why": why, "diff": diff[:3],
           "survivors_kept_pids": all(len(pids.get(r, [])) == 1 for r in range(WORLD) if r != victim) if pids else None}
    print(f"{mode} {index}: {what} exact={row['exact']} unlogged={row['unlogged']} pause={row['pause_s']}s "
          f"wall={row['wall_s']}s {note} {why} {diff[:2]}", flush=True)
    return row


def node_run(work: Workdir, etcd: Any, index: int, ref: Any, args: argparse.Namespace,
             rng: random.Random) -> dict[str, Any]:
    """2 nodes x 2 ranks + a spare node; node B killed whole at a random instant of a random step."""
    out = work.sub(f"node-{index}")
    train = os.path.join(out, "train")
    os.makedirs(train, exist_ok=True)
    early = hold_at(train, 0, name="early")
    late = hold_at(train, args.iters - 3)
    run_id = f"mgn-{uuid.uuid4().hex[:8]}"
    jobs = tuple(Job.agent(os.path.join(out, n), train, endpoint=etcd.endpoint, run_id=run_id,
                           env={**CPU_ENV, "TPASSRUN_FAULTS": json.dumps([early.fault, late.fault])},
                           extra=["--spare-node"] if n == "c" else [], script=[SCRIPT, *script_args(args)])
                 for n in "abc")
    a, b, c = jobs
    at, code, note, killed = rng.randint(1, args.iters - 6), -1, "", None
    try:
        for j in jobs:
            j.start()
        early.wait_reached(a, 400)
        c.wait_event("spare_ready", timeout=400)
        b_pids = b.worker_pids()
        early.release()
        logs = Job(argv=[], out=train)
        for r in range(WORLD):
            logs.wait_step(0, 400, rank=r)
        b_rank = next(r for r in range(WORLD) if pid_of_rank(train, r) in b_pids)
        logs.wait_step(at, 400, rank=b_rank)
        time.sleep(rng.uniform(0.0, step_seconds(logs, b_rank)))
        killed = time.time()
        sigkill_node(b)
        note = f"node B (ranks of pids {b_pids}) killed after rank {b_rank}'s step {at}"
        late.release()
        code = a.wait(600)
        c.wait(120)
    except AssertionError as exc:
        note = f"{note} {str(exc)[:200]}"
    finally:
        early.release()
        late.release()
        for j in jobs:
            j.kill()
    evs = [e for j in jobs for e in j.events()]
    recovered = any(e["event"] == "node_recovered" for e in evs)
    restarted = [e.get("reason", "") for e in evs if e["event"] in ("restart", "fallback")]
    logs = Job(argv=[], out=train)
    diff = differences(logs, ref) if code == 0 else ["did not finish"]
    live = code == 0 and recovered and not restarted
    recovery = next_step_after(train, WORLD, killed) if live and killed else None
    row = {"mode": "node", "run": index, "step": at, "outcome": "live" if live else (restarted[0][:200] if restarted
                                                                                     else f"exit {code}"),
           "exact": not diff, "recovery_s": round(recovery, 2) if recovery else None,
           "wall_s": round(time.monotonic() - a.started, 1), "note": note, "diff": diff[:3]}
    print(f"node {index}: {row['outcome']} exact={row['exact']} recovery={row['recovery_s']}s wall={row['wall_s']}s "
          f"{note} {diff[:2]}", flush=True)
    return row


def kill_started_rank(job: Any, rank: int) -> int | None:
    """SIGKILL ``rank``'s process as its agent started it (before it logged anything: inside step 0)."""
    import signal

    pid = next((s["pid"] for e in job.events() if e["event"] == "workers_started" for s in e["slots"]
                if s.get("rank") == rank), None)
    if pid is None:
        return None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return int(pid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--swaps", type=int, default=10)
    p.add_argument("--nodes", type=int, default=0, help="whole-node kills (2 nodes x 2 ranks + a spare node)")
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--first-window-every", type=int, default=3,
                   help="every N-th kill lands inside step 0, the first accumulation window (1: all of them)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (1: DP=4)")
    p.add_argument("--distopt", action="store_true", help="Megatron's DistributedOptimizer + clip-grad 1.0")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--keep", action="store_true")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="the torchrun reference of a kept run (its torchrun/ directory, same script arguments): "
                        "not run again, so that a sweep splits into short runs")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"seed {seed}: {' '.join(script_args(args))}", flush=True)
    rows = []
    with Workdir(keep=args.keep, prefix="tpassrun-bench-megatron-") as work:
        if args.reference:
            ref = Job(argv=[], out=args.reference)
        else:
            ref = torchrun_job(work.sub("torchrun"), SCRIPT, WORLD, script_args(args)).start()
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
            for i in range(args.nodes):
                rows.append(node_run(work, etcd, i, ref, args, rng))
        finally:
            etcd.cleanup()
    summary = {}
    for mode in ("kill", "swap", "node"):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        summary[mode] = {"runs": len(mine), "live_and_exact": sum(r["outcome"] == "live" and r["exact"] for r in mine),
                         "live": sum(r["outcome"] == "live" for r in mine), "exact": sum(r["exact"] for r in mine),
                         "fallback": sum(r["outcome"].startswith("fallback") for r in mine),
                         "silent_divergence": sum(r["outcome"] == "live" and not r["exact"] for r in mine),
                         "wall_s": round(sum(r["wall_s"] for r in mine), 1)}
        print(f"{mode}: {summary[mode]}", flush=True)
    print_json({"seed": seed, "args": script_args(args), "summary": summary, "runs": rows})


if __name__ == "__main__":
    main()
