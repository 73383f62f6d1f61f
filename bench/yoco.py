"""You Only Crash Once: SIGKILL a random rank at a uniformly random instant; is it recovered live, exactly?

    python bench/yoco.py [--runs 20] [--double 4] [--steps 40] [--seed S] [--loader-workers 2]

Each run is ``examples/train_ddp.py`` (a realistic step: the next batch from a stateful sampler, forward with
dropout, backward through DDP, AdamW + LR schedule, ~20 ms of user code after the optimizer step; with
``--loader-workers N`` the batches come from a ``DataLoader`` with N worker processes and a ``DistributedSampler``) under
tpassrun with 4 ranks + 1 spare and ``--max-restarts 0``. While it trains, one rank chosen at random is killed
with SIGKILL from outside (``tests/faults.py:sigkill_rank``) at an instant drawn uniformly over the training
window, so it lands wherever that rank happens to be: forward, backward, inside the optimizer step, the user
code after it, the next batch, between steps. Printed per run:

  * live: recovered by a spare (``swap_resumed``, or ``ranks_recovered`` for several at once), no fallback
    restart, exit 0;
  * lost: steps never logged (0 expected); redone: steps some rank logged twice, identically (a mixed commit
    rolled back: the survivors that had completed the step re-execute it; not lost, shown apart); unlogged: a
    step the killed rank had done its part of (its all-reduce reached the survivors, who completed the step) but
    died before logging, in user code after its optimizer step: its successor starts at the next step, so that
    rank's log skips it (the step's update is in every rank's state, which ``exact`` checks; as
    ``bench/node_instants.py`` counts it; not lost, shown apart);
  * exact: final parameters, optimizer state, scheduler, sampler and per-step losses ``torch.equal`` to the same
    script under plain torchrun without any fault (one reference run per world size; a step logged again with the
    same loss by a rank that re-executed it counts once);
  * recovery: seconds from the kill until every rank logged a later step; the step the dead rank died in.

Then the YOCO fraction (live, 0 lost and exact) with the recovery-time median and p95. ``--double N`` adds N
runs with two faults in one job (3 ranks + 2 spares): half kill two ranks at two independent random instants,
half kill a second rank during the first one's recovery. Figures only, no assertions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
from typing import Any

from common import REPO, Workdir, events, next_step_after, print_json, steps_lost, tail

sys.path.insert(0, os.path.join(REPO, "tests"))
from faults import Job, assert_bit_exact, never_logged, pids_by_rank, sigkill_rank


def reference(work: Workdir, world: int, args: argparse.Namespace) -> tuple[Job, float]:
    """The same script under plain torchrun, no fault; and its steady seconds per step."""
    out = work.sub(f"torchrun-{world}")
    job = Job.torchrun(out, nproc=world, steps=args.steps, step_sleep=args.step_sleep,
                       script_args=script_args(args)).start()
    try:
        code = job.wait(300)
    finally:
        job.kill()
    if code != 0:
        raise SystemExit(f"the torchrun reference failed ({code}):\n{tail(job)}")
    rows = job.losses(0)
    per_step = (rows[-1]["t"] - rows[len(rows) // 4]["t"]) / max(1, len(rows) - 1 - len(rows) // 4)
    return job, per_step


def script_args(args: argparse.Namespace) -> list[str]:
    return ["--loader-workers", str(args.loader_workers)] if args.loader_workers is not None else []


def wait_first_step(job: Job, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.losses(0):
            return True
        if job.proc is not None and job.proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def at_instant(job: Job, step: int, per_step: float, rng: random.Random) -> None:
    """Return at a uniformly random instant of ``step`` (as rank 0 runs it)."""
    deadline = time.monotonic() + 300
    while job.step_reached(0) < step - 1 and time.monotonic() < deadline:
        if job.proc is not None and job.proc.poll() is not None:
            return
        time.sleep(0.002)
    time.sleep(rng.uniform(0, per_step))


def wait_event(out: str, name: str, after: float, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["event"] == name and e["time"] >= after for e in events(out)):
            return True
        time.sleep(0.005)
    return False


def one_run(work: Workdir, index: int, world: int, spares: int, mode: str, ref: Job, per_step: float,
            rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    out = work.sub(f"run-{index}")
    job = Job.tpassrun(out, endpoint=None, run_id=uuid.uuid4().hex[:8], nproc=world, spares=spares,
                       steps=args.steps, step_sleep=args.step_sleep, extra=["--max-restarts", "0"],
                       script_args=script_args(args)).start()
    kills: list[tuple[int, float]] = []
    try:
        if wait_first_step(job):
            victims = rng.sample(range(world), 2 if mode != "single" else 1)
            # a uniformly random step of the training window (the last steps are left for the recovery to
            # show), then a uniformly random instant inside it: the kill lands wherever that rank then is
            at_instant(job, rng.randrange(0, args.steps - 8), per_step, rng)
            done = sigkill_rank(out, victims[0])
            if done:
                kills.append((victims[0], done[1]))
            if mode == "two-instants":
                at_instant(job, rng.randrange(min(job.step_reached(0) + 2, args.steps - 5), args.steps - 4),
                           per_step, rng)
                done = sigkill_rank(out, victims[1])
                if done:
                    kills.append((victims[1], done[1]))
            elif mode == "during-recovery" and kills:
                if wait_event(out, "swap_pause", kills[0][1] - 0.5, 30):
                    time.sleep(rng.uniform(0, 0.3))
                    done = sigkill_rank(out, victims[1])
                    if done:
                        kills.append((victims[1], done[1]))
        code = job.wait(300)
    except AssertionError:
        code = -1
    finally:
        job.kill()
    evs = events(out)
    # ranks recovered live: one per swap, several per plan replacing several dead ranks (a second fault)
    resumed = [e for e in evs if e["event"] == "swap_resumed"] + [
        r for e in evs if e["event"] == "ranks_recovered" for r in e.get("ranks") or ()]
    fallbacks = [e for e in evs if e["event"] in ("fallback", "restart")]
    died = [e for e in evs if e["event"] == "worker_died"]
    live = code == 0 and bool(kills) and len(resumed) >= len(kills) and not fallbacks
    every = {pid for pids in pids_by_rank(job, world).values() for pid in pids}
    lost = steps_lost(out, world, args.steps)
    lost["missing"], unlogged = _not_logged(job, world, args.steps, every)
    try:
        assert_bit_exact(job, ref, world, relogged_by=every)
        exact, why = True, ""
    except (AssertionError, OSError, KeyError, EOFError, RuntimeError) as exc:
        exact, why = False, str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    recovery = next_step_after(out, world, kills[-1][1]) if kills and code == 0 else None
    reasons = [e.get("reason", "") for e in fallbacks] + [
        e.get("reason", "") for e in evs if e["event"] == "swap_phase" and e.get("phase") == "aborted"]
    return {"run": index, "mode": mode, "world": world, "killed": [r for r, _ in kills],
            "died_in_step": [e.get("step") for e in died], "exit": code, "live": live,
            "lost": lost["missing"], "redone": lost["redone"], "unlogged": unlogged, "exact": exact,
            "recovery_s": recovery,
            "mixed": any(e["event"] == "rank_caught_up" for e in evs),
            "yoco": live and exact and lost["missing"] == 0 and len(kills) > 0,
            "why": why or "; ".join(r for r in reasons if r)[:300], "log": "" if code == 0 else tail(job, 600)}


def _not_logged(job: Job, world: int, steps: int, pids: set[int]) -> tuple[int, int]:
    """(steps some rank never logged, the most on one rank; of those, the ones a killed rank completed its part
    of but died before logging, :func:`faults.unlogged_steps`, on all ranks): lost and unlogged."""
    lost = unlogged = 0
    for r in range(world):
        never, not_logged = never_logged(job.losses(r), steps, pids)
        lost, unlogged = max(lost, len(never)), unlogged + len(not_logged)
    return lost, unlogged


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="single-fault runs")
    parser.add_argument("--double", type=int, default=4, help="runs with two faults in one job")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="user code after the optimizer step (s)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--loader-workers", type=int, default=None,
                        help="batches from a DataLoader with this many workers and a DistributedSampler")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"yoco: {args.runs} single-fault runs (4 ranks + 1 spare) and {args.double} double-fault runs "
          f"(3 ranks + 2 spares), {args.steps} steps, --max-restarts 0, seed {seed}"
          + (f", DataLoader with {args.loader_workers} workers" if args.loader_workers is not None else ""),
          flush=True)
    results: list[dict[str, Any]] = []
    with Workdir(keep=args.keep) as work:
        refs = {w: reference(work, w, args) for w in ((4, 3) if args.double else (4,))}
        plan = [("single", 4, 1)] * args.runs + [
            ("two-instants" if i % 2 == 0 else "during-recovery", 3, 2) for i in range(args.double)]
        for i, (mode, world, spares) in enumerate(plan):
            ref, per_step = refs[world]
            r = one_run(work, i, world, spares, mode, ref, per_step, rng, args)
            results.append(r)
            rec = f"{r['recovery_s']:.2f} s" if r["recovery_s"] is not None else "-"
            print(f"  run {i:2d} {mode:15s} killed {r['killed']} (in step {r['died_in_step']}): "
                  f"live {'yes' if r['live'] else 'NO '}  lost {r['lost']}  exact {'yes' if r['exact'] else 'NO '}"
                  f"  recovery {rec}" + (f"  redone {r['redone']}" if r["redone"] else "")
                  + (f"  unlogged {r['unlogged']}" if r["unlogged"] else "")
                  + ("  (mixed commit)" if r["mixed"] else "")
                  + (f"  [{r['why']}]" if not r["yoco"] and r["why"] else ""), flush=True)
            if r["log"] and not r["live"]:
                print("      " + r["log"].replace("\n", "\n      ")[-600:], flush=True)
    for mode in ("single", "two-instants", "during-recovery"):
        rows = [r for r in results if r["mode"] == mode]
        if not rows:
            continue
        times = [r["recovery_s"] for r in rows if r["yoco"] and r["recovery_s"] is not None]
        med, p95 = pct(times, 0.5), pct(times, 0.95)
        mixed = sum(r["mixed"] for r in rows)
        print(f"{mode:15s}: YOCO {sum(r['yoco'] for r in rows)}/{len(rows)} (live, 0 lost, bit-identical to "
              f"torchrun); recovery median {med if med is None else round(med, 2)} s, "
              f"p95 {p95 if p95 is None else round(p95, 2)} s"
              + (f"; {mixed} mixed commit(s) resumed, {sum(r['redone'] for r in rows)} step(s) re-executed"
                 if mixed else "")
              + (f"; {sum(r['unlogged'] for r in rows)} step(s) completed but unlogged by a killed rank"
                 if any(r["unlogged"] for r in rows) else ""))
    single = [r for r in results if r["mode"] == "single"]
    print_json({"bench": "yoco", "seed": seed, "steps": args.steps,
                "yoco_single": f"{sum(r['yoco'] for r in single)}/{len(single)}",
                "runs": [{k: v for k, v in r.items() if k != "log"} for r in results]})


if __name__ == "__main__":
    main()
