"""What a whole-group restart costs, as the summary says it and as a stopwatch says it (issue 39).

One failure, the same under both launchers: rank 1 SIGKILLed from outside once it logged step ``--kill-step``,
2 ranks, ``--max-restarts 1`` (tpassrun also ``--spares-per-node 1``; a script without the worker API cannot be
swapped live, so it restarts as under torchrun). Each launcher also runs the job without the failure. Per run:
the wall time, the time the failure cost by the stopwatch (wall with the failure minus wall without), the steps
logged twice (run again), and for tpassrun the summary's own line, so its figures can be held against the
stopwatch's.

    python bench/restart_cost.py --script plain     # tests/plain_train.py: knows nothing of tpassrun
    python bench/restart_cost.py --script api       # examples/train_ddp.py: the worker API

Figures, not a test: nothing here asserts on a time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time

from common import REPO, TORCHRUN_RESTART_ENV, Job, print_json

SCRIPTS = {"plain": (os.path.join(REPO, "tests", "plain_train.py"), "steps_rank{}.jsonl"),
           "api": (os.path.join(REPO, "examples", "train_ddp.py"), "loss_rank{}.jsonl")}


def _rows(out: str, pattern: str, rank: int) -> list[dict[str, object]]:
    try:
        with open(os.path.join(out, pattern.format(rank))) as fh:
            return [json.loads(line) for line in fh.read().split("\n")[:-1] if line.strip()]
    except OSError:
        return []


def run(launcher: str, script: str, out: str, *, steps: int, sleep: float, kill_step: int | None, spares: int = 1,
        max_restarts: int = 1) -> dict[str, object]:
    path, pattern = SCRIPTS[script]
    args = ["--steps", str(steps), "--step-sleep", str(sleep), "--out", out]
    if launcher == "tpassrun":
        argv = [sys.executable, "-m", "tpassrun", "--standalone", "--nproc-per-node", "2", "--spares-per-node",
                str(spares), "--max-restarts", str(max_restarts), "--log-dir", os.path.join(out, "logs"), path, *args]
        env: dict[str, str] = {}
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", str(max_restarts), path, *args]
        env = dict(TORCHRUN_RESTART_ENV)
    job = Job(argv=argv, out=out, env=env).start()
    killed_at = None
    try:
        while kill_step is not None and killed_at is None:
            rows = _rows(out, pattern, 1)
            if rows and int(rows[-1]["step"]) >= kill_step:     # type: ignore[call-overload]
                os.kill(int(rows[-1]["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
                killed_at = int(rows[-1]["step"])              # type: ignore[call-overload]
            if job.proc is not None and job.proc.poll() is not None:
                break
            time.sleep(0.02)
        code = job.wait(600)
    finally:
        job.kill()
    wall = time.monotonic() - job.started
    logged = [int(r["step"]) for r in _rows(out, pattern, 0)]  # type: ignore[call-overload]
    summary = [ln.split("] ", 2)[-1] for ln in job.log().splitlines() if "summary: " in ln]
    return {"launcher": launcher, "code": code, "wall_s": wall, "killed_at": killed_at,
            "steps_run_again": len(logged) - len(set(logged)), "summary": summary}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--script", choices=sorted(SCRIPTS), default="plain")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.5)
    p.add_argument("--kill-step", type=int, default=15)
    p.add_argument("--launchers", default="tpassrun,torchrun")
    p.add_argument("--spares", type=int, default=1, help="tpassrun's --spares-per-node (with the worker API and a "
                   "spare the failure is recovered live, no restart)")
    p.add_argument("--max-restarts", type=int, default=1, help="0: the failure ends the run (exit 1)")
    p.add_argument("--no-clean", action="store_true", help="skip the run without the failure (no stopwatch figure)")
    p.add_argument("--keep", default="", help="keep the jobs' output (event logs, step logs) under this directory")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="restart_cost_") as scratch:
        tmp = a.keep or scratch
        for launcher in a.launchers.split(","):
            shape = {"steps": a.steps, "sleep": a.step_sleep, "spares": a.spares, "max_restarts": a.max_restarts}
            base = None if a.no_clean else run(launcher, a.script, os.path.join(tmp, f"{launcher}-clean"),
                                               kill_step=None, **shape)  # type: ignore[arg-type]
            hit = run(launcher, a.script, os.path.join(tmp, f"{launcher}-fault"), kill_step=a.kill_step,
                      **shape)  # type: ignore[arg-type]
            hit["clean_wall_s"] = base["wall_s"] if base else float("nan")
            hit["stopwatch_lost_s"] = float(hit["wall_s"]) - float(hit["clean_wall_s"])  # type: ignore[arg-type]
            results.append(hit)
            print(f"{launcher:9s} exit {hit['code']}  wall {hit['wall_s']:.2f} s (clean {hit['clean_wall_s']:.2f} s): "
                  f"the failure cost {hit['stopwatch_lost_s']:.2f} s by the stopwatch, "
                  f"{hit['steps_run_again']} step(s) run again (killed at step {hit['killed_at']})")
            for line in hit["summary"]:  # type: ignore[attr-defined]
                print(f"          {line}")
            lost = next((re.search(r"time lost to failures ([\d.]+) (m?s)", s) for s in hit["summary"]  # type: ignore[attr-defined]
                         if "time lost" in s), None)
            if lost:
                said = float(lost.group(1)) / (1000 if lost.group(2) == "ms" else 1)
                print(f"          summary says {said:.2f} s lost; the stopwatch {hit['stopwatch_lost_s']:.2f} s")
    print_json({"bench": "restart_cost", "script": a.script, "results": results})


if __name__ == "__main__":
    main()
