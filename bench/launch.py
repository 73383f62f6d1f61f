"""Launch latency and steady-state step time: tpassrun vs torchrun on the same job.

    python bench/launch.py [--trials 3] [--steps 100] [--quick]

Both launchers run ``examples/train_ddp.py`` with 4 ranks, ``--standalone`` (tpassrun's includes starting its
embedded etcd). Trials alternate tpassrun, torchrun, tpassrun, ... Measured per trial, from the loss logs
(each row has the wall-clock time its rank finished that step):

  * launch: from spawning the launcher to every rank having finished step 0;
  * steady state: median ms between consecutive steps done on all ranks, over steps 20..N.

Prints every trial, the medians, and the ratios tpassrun/torchrun (targets: launch <= 1.0, steady <= 1.01).
Figures only, no assertions. The last line is JSON.
"""

from __future__ import annotations

import argparse
import uuid

from common import (
    Job,
    Series,
    Workdir,
    add_common_args,
    alternate,
    first_step_done,
    print_json,
    ratio_line,
    run_to_end,
    steady_ms_per_step,
    tail,
)

LAUNCHERS = ("tpassrun", "torchrun")
WORLD = 4


def make_job(launcher: str, out: str, steps: int, step_sleep: float) -> Job:
    if launcher == "tpassrun":
        return Job.tpassrun(out, endpoint=None, run_id=uuid.uuid4().hex[:8], nproc=WORLD, steps=steps,
                            step_sleep=step_sleep)
    return Job.torchrun(out, nproc=WORLD, steps=steps, step_sleep=step_sleep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, trials=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="seconds of extra work per step")
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials

    launch = Series("launch -> step 0 done on all ranks", "s")
    steady = Series(f"steady state (steps 20..{args.steps - 1})", "ms")
    failures: list[str] = []
    print(f"{WORLD} ranks, {args.steps} steps, step sleep {args.step_sleep}s, {trials} trial(s) per launcher")
    with Workdir(keep=args.keep) as work:
        for trial, launcher in alternate(LAUNCHERS, trials):
            out = work.sub(f"{launcher}-{trial}")
            job = make_job(launcher, out, args.steps, args.step_sleep)
            code, started = run_to_end(job, timeout=300)
            if code != 0:
                failures.append(f"{launcher} trial {trial}: exit {code}\n{tail(job)}")
                print(f"  trial {trial} {launcher:9s} FAILED (exit {code})")
                continue
            launch.add(launcher, first_step_done(out, WORLD, started))
            steady.add(launcher, steady_ms_per_step(out, WORLD, first=20))
            print(f"  trial {trial} {launcher:9s} launch {launch.values[launcher][-1]:6.2f} s   "
                  f"steady {steady.values[launcher][-1]:6.2f} ms/step")

    for series in (launch, steady):
        for launcher in LAUNCHERS:
            print(series.line(launcher, digits=3 if series is steady else 2))
    launch_ratio = launch.ratio("tpassrun", "torchrun")
    steady_ratio = steady.ratio("tpassrun", "torchrun")
    print(ratio_line("launch ratio tpassrun/torchrun (medians)", launch_ratio, 1.0, at_most=True))
    print(ratio_line("steady-state ratio tpassrun/torchrun (medians)", steady_ratio, 1.01, at_most=True))
    for failure in failures:
        print(failure)
    print_json({"bench": "launch", "trials": trials, "steps": args.steps, "launch_s": launch.values,
                "steady_ms": steady.values, "launch_ratio": launch_ratio, "steady_ratio": steady_ratio,
                "failures": len(failures)})


if __name__ == "__main__":
    main()
