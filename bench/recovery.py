"""Unplanned failure: SIGKILL rank 1 mid-backward. tpassrun (warm spare) vs torchrun (whole-group restart).

    python bench/recovery.py [--trials 3] [--steps 60] [--kill-step 30] [--quick]

Both launchers run ``examples/train_ddp.py`` with 4 ranks, ``--standalone``; the fault is the same
``kill_at(rank=1, step=S, where="backward")`` (tests/faults.py), which fires once per job. tpassrun gets one
spare (``--spares-per-node 1``). torchrun gets ``--max-restarts 1`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
torchrun 2.13's default restart fails in gloo init (torchrun.md 3.7, 6), so without that variable there is
no torchrun recovery to compare with. Trials alternate tpassrun, torchrun, ...

Measured per trial:
  * kill -> next step on all ranks: from the moment the fault fired (its marker file's mtime, written just
    before the SIGKILL) to every rank having logged a step finished after it;
  * steps lost: steps finished before the kill and executed again after it (from the loss logs; the job has no
    checkpoint, so torchrun redoes every step), and steps never logged;
  * for tpassrun, the phases from the agent's event log (worker_died, recovery_decided, swap phases, resumed).

Prints every trial, medians and the speed-up torchrun/tpassrun (target >= 3x, 0 steps lost).
Figures only, no assertions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

from common import (
    TORCHRUN_RESTART_ENV,
    Job,
    Series,
    Workdir,
    add_common_args,
    alternate,
    events,
    faults_env,
    kill_at,
    marker_time,
    next_step_after,
    print_json,
    ratio_line,
    run_to_end,
    steps_lost,
    tail,
)

LAUNCHERS = ("tpassrun", "torchrun")
WORLD = 4
VICTIM = 1
PHASES = ("worker_died", "recovery_decided", "swap_transfer_start", "swap_transfer_end", "swap_world_reformed",
          "swap_resumed")


def make_job(launcher: str, out: str, args: argparse.Namespace) -> Job:
    fault = faults_env(kill_at(VICTIM, args.kill_step, os.path.join(out + "-marker"), where="backward"))
    if launcher == "tpassrun":
        return Job.tpassrun(out, endpoint=None, run_id=uuid.uuid4().hex[:8], nproc=WORLD, spares=1,
                            steps=args.steps, step_sleep=args.step_sleep, env=fault)
    return Job.torchrun(out, nproc=WORLD, steps=args.steps, step_sleep=args.step_sleep,
                        extra=["--max-restarts", "1"], env={**fault, **TORCHRUN_RESTART_ENV})


def phase_offsets(out: str, kill_wall: float) -> dict[str, float]:
    """Seconds after the kill at which each recovery event was first logged."""
    found: dict[str, float] = {}
    for ev in events(out):
        name = ev["event"]
        if name in PHASES and name not in found and ev["time"] >= kill_wall - 1.0:
            found[name] = ev["time"] - kill_wall
        if name == "swap_reform_timings" and "ddp_rebuild_s" not in found:
            # the on_reconfigure callbacks (DDP rebuild) of the slowest survivor, inside the reform phase
            found["ddp_rebuild_s"] = max((r.get("callbacks_s", 0.0) for r in ev["ranks"].values()), default=0.0)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, trials=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-step", type=int, default=30)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials

    recovery = Series("kill -> next step on all ranks", "s")
    lost = Series("steps lost (redone + missing)", "steps")
    phases: list[dict[str, Any]] = []
    failures: list[str] = []
    print(f"{WORLD} ranks, {args.steps} steps, SIGKILL rank {VICTIM} in backward of step {args.kill_step}, "
          f"{trials} trial(s) per launcher")
    with Workdir(keep=args.keep) as work:
        for trial, launcher in alternate(LAUNCHERS, trials):
            out = work.sub(f"{launcher}-{trial}")
            job = make_job(launcher, out, args)
            code, _started = run_to_end(job, timeout=300)
            kill_wall = marker_time(out + "-marker")
            took = next_step_after(out, WORLD, kill_wall) if kill_wall is not None else None
            loss = steps_lost(out, WORLD, args.steps)
            if code != 0 or took is None:
                failures.append(f"{launcher} trial {trial}: exit {code}, fault fired: {kill_wall is not None}\n"
                                f"{tail(job)}")
                print(f"  trial {trial} {launcher:9s} FAILED (exit {code}; recovered: {took is not None})")
                continue
            recovery.add(launcher, took)
            lost.add(launcher, loss["redone"] + loss["missing"])
            line = (f"  trial {trial} {launcher:9s} kill -> next step {took:6.2f} s   steps redone {loss['redone']}, "
                    f"missing {loss['missing']}")
            if launcher == "tpassrun":
                offsets = phase_offsets(out, kill_wall)
                phases.append(offsets)
                line += "\n      " + "  ".join(f"{k} +{v:.3f}s" if k in PHASES else f"({k} {v:.3f}s)"
                                              for k, v in offsets.items())
            print(line)

    for series in (recovery, lost):
        for launcher in LAUNCHERS:
            print(series.line(launcher, digits=3 if series is recovery else 0))
    speedup = recovery.ratio("torchrun", "tpassrun")
    print(ratio_line("speed-up torchrun restart / tpassrun recovery", speedup, 3.0, at_most=False))
    print(ratio_line("tpassrun steps lost (median)", lost.median("tpassrun"), 0, at_most=True))
    for failure in failures:
        print(failure)
    print_json({"bench": "recovery", "trials": trials, "steps": args.steps, "kill_step": args.kill_step,
                "recovery_s": recovery.values, "steps_lost": lost.values, "tpassrun_phases_s": phases,
                "speedup": speedup, "failures": len(failures),
                "torchrun_env": TORCHRUN_RESTART_ENV})


if __name__ == "__main__":
    main()
