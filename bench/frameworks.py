"""A framework's training script under faults: SIGKILL at uniformly random instants, planned swaps; live? exact?

    python bench/frameworks.py --framework deepspeed [--trials 10] [--planned 2] [--zero 1 2]
    python bench/frameworks.py --script PATH --nproc 4 [--docrun] [--trials 10] [--planned 2] -- SCRIPT ARGS
    python bench/frameworks.py --script examples/deepspeed/train.py --nproc 4 --trials 10 --early 3 --planned 0 \
        -- --config examples/deepspeed/ds_config_zero3.json --steps 24     # ZeRO-3, 4 ranks + 1 spare

``--framework deepspeed`` runs the DeepSpeed adapter's docstring example (a script as DeepSpeed users write it: a
torch optimizer given to ``deepspeed.initialize``, ``engine.backward``/``engine.step`` per micro-batch, ZeRO stage
and gradient accumulation (2) from its JSON config) through ``tests/docrun.py``, 2 ranks + 1 spare, once per
``--zero`` stage. ``--script`` runs any script: one following the examples' convention (``--out DIR``: every
rank appends ``{"step", "pid"}`` rows to ``DIR/loss_rank<R>.jsonl`` and saves ``DIR/final_rank<R>.pt`` at the end,
calling ``tpassrun.worker.faultpoints.fault_point(rank, step, "step")`` at each step's start), or, with ``--docrun``, any
script at all, wrapped by ``tests/docrun.py`` (which writes those files itself). Launcher flags go to both
launchers (``--nproc``, ``--launcher-arg``; ``--tpassrun-arg`` for tpassrun only), script arguments after ``--``.

Per shape: one reference under plain torchrun, then ``--trials`` runs under tpassrun (``--max-restarts 0``) where
one random rank is SIGKILLed from outside at a uniformly random instant of a random step (the instant drawn over
one step as long as the reference's, after the victim logged the step before; ``--early K``: the first K of them in
step 1, inside the first accumulation window), and ``--planned`` runs where a random
rank is tainted (``tpassctl``) while the job stands at a random step. Printed per run:

  * live: recovered by a spare (``swap_resumed``), no fallback or restart, exit 0;
  * exact: every rank's final state ``torch.equal`` to the reference's and every step done
    (``tests/realjobs.py:assert_same_training``);
  * pause: seconds from the death (or the swap's transfer) to training resumed, from the event log;
  * why: the first difference or the fallback's reason.

Then ``live x/n, exact y/n`` per shape. Figures only, no assertions; the last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
from typing import Any

from common import REPO, EtcdServer, Workdir, print_json, tail

sys.path.insert(0, os.path.join(REPO, "tests"))
from docrun import docrun_job, ds_config, write_example
from faults import Job, faults_env, hold_at, pids_by_rank, sigkill_rank, taint
from realjobs import CPU_ENV, assert_same_training, swap_pause_s


class Shape:
    """One script with its arguments and world size, launched the same way under torchrun and tpassrun."""

    def __init__(self, name: str, script: str, args: list[str], nproc: int, spares: int, docrun: bool,
                 launcher_args: list[str], tpassrun_args: list[str]) -> None:
        self.name, self.script, self.args, self.nproc = name, script, args, nproc
        self.spares, self.docrun, self.launcher_args, self.tpassrun_args = spares, docrun, launcher_args, tpassrun_args

    def job(self, kind: str, out: str, *, endpoint: str = "", run_id: str = "",
            env: dict[str, str] | None = None) -> Job:
        if self.docrun:
            job = docrun_job(kind, out, self.script, self.nproc, self.args, endpoint=endpoint, run_id=run_id,
                             spares=self.spares, env=env)
        else:
            if kind == "torchrun":
                launcher = ["-m", "torch.distributed.run", "--standalone"]
            else:
                launcher = ["-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
                            "--rdzv-id", run_id, "--spares-per-node", str(self.spares), "--max-restarts", "0",
                            "--log-dir", os.path.join(out, "logs")]
            argv = [sys.executable, *launcher, "--nproc-per-node", str(self.nproc), self.script, *self.args,
                    "--out", out]
            job = Job(argv=argv, out=out, env={**CPU_ENV, **(env or {})})
        at = job.argv.index("--nproc-per-node")
        job.argv[at:at] = self.launcher_args + (self.tpassrun_args if kind == "tpassrun" else [])
        return job


def reference(work: Workdir, shape: Shape, kept: str | None = None) -> tuple[Job, int, float]:
    """The reference under plain torchrun: the job, its steps, its seconds per step. ``kept``: the output directory
    of an earlier one of the same shape (``--keep``'s ``<shape>-torchrun``), taken as it is."""
    job = shape.job("torchrun", kept or work.sub(f"{shape.name}-torchrun"))
    if kept is None:
        job.start()
        try:
            code = job.wait(600)
        finally:
            job.kill()
        if code != 0:
            raise SystemExit(f"{shape.name}: the torchrun reference failed ({code}):\n{tail(job)}")
    rows = job.losses(0)
    if "t" in rows[0]:
        per_step = (rows[-1]["t"] - rows[0]["t"]) / max(1, len(rows) - 1)
    else:   # a script whose rows carry no time (the examples' own): the whole run's wall time, start-up included
        per_step = (time.monotonic() - job.started) / len(rows)
    return job, rows[-1]["step"] + 1, per_step


def one_run(work: Workdir, etcd: EtcdServer, shape: Shape, index: int, mode: str, ref: Job, steps: int,
            per_step: float, rng: random.Random, early: bool = False) -> dict[str, Any]:
    out = work.sub(f"{shape.name}-{mode}-{index}")
    run_id = "fw-" + uuid.uuid4().hex[:8]
    victim = rng.randrange(shape.nproc)
    at = 1 if early else rng.randrange(1, max(2, steps - 8))
    # rank `other` stands at a late step (kill) or at `at` (planned) until the fault is under way: the job cannot
    # end first, however slow the machine; a hold changes no numerics
    other = (victim + 1) % shape.nproc
    hold = hold_at(out, steps - 4 if mode == "kill" else at, rank=other if mode == "kill" else 0)
    job = shape.job("tpassrun", out, endpoint=etcd.endpoint, run_id=run_id, env=faults_env(hold.fault)).start()
    died_in = None
    try:
        if mode == "kill":
            job.wait_step(at - 1, 300, rank=victim)
            time.sleep(rng.uniform(0.0, per_step))
            killed = sigkill_rank(out, victim)
            died_in = job.step_reached(victim) + 1 if killed else None
            try:
                job.wait_event("swap_resumed", 1, 120)
            finally:
                hold.release()
        else:
            hold.wait_reached(job)
            taint(etcd.endpoint, run_id, rank=victim, reason=f"bench: planned at step {at}")
            hold.release_after(job, "swap_boundary")
        code = job.wait(600)
    except AssertionError as exc:
        code = -1
        why = str(exc).splitlines()[0][:200]
    else:
        why = ""
    finally:
        hold.release()
        job.kill()
    evs = job.events()
    fallbacks = [e for e in evs if e["event"] in ("fallback", "restart")]
    live = code == 0 and any(e["event"] == "swap_resumed" for e in evs) and not fallbacks
    try:
        assert_same_training(job, ref, shape.nproc, steps)
        exact = True
    except (AssertionError, OSError, KeyError, EOFError, RuntimeError) as exc:
        exact = False
        why = why or (str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
    reasons = [e.get("reason", "") for e in fallbacks] + [
        line.split("recovery decided (fallback): ", 1)[1] for line in job.log().splitlines()
        if "recovery decided (fallback): " in line]
    pids = pids_by_rank(job, shape.nproc)
    return {"shape": shape.name, "mode": mode, "run": index, "rank": victim, "seconds": round(time.monotonic() - job.started, 1),
            "step": at if mode == "planned" else died_in,
            "exit": code, "live": live, "exact": exact, "pause_s": round(swap_pause_s(job), 3),
            "kept_pids": all(len(pids[r]) == 1 for r in range(shape.nproc) if r != victim),
            "why": why or "; ".join(r for r in reasons if r)[:300], "log": "" if live else tail(job, 600)}


def shapes_of(args: argparse.Namespace, work: Workdir) -> list[Shape]:
    if args.framework == "deepspeed":
        script = write_example("tpassrun.adapters.deepspeed", work.sub("deepspeed_example.py"))
        return [Shape(f"deepspeed-zero{z}", script,
                      ["--deepspeed_config", ds_config(work.sub(f"ds_zero{z}.json"), z)], 2, args.spares, True,
                      args.launcher_arg, args.tpassrun_arg) for z in args.zero]
    if not args.script:
        raise SystemExit("frameworks.py: give --framework deepspeed or --script PATH")
    return [Shape(os.path.splitext(os.path.basename(args.script))[0], os.path.abspath(args.script),
                  args.script_args, args.nproc, args.spares, args.docrun, args.launcher_arg, args.tpassrun_arg)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["deepspeed"], default=None)
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 2], help="ZeRO stages (--framework deepspeed)")
    parser.add_argument("--script", default=None, help="any training script (see the docstring for its contract)")
    parser.add_argument("--docrun", action="store_true", help="wrap --script with tests/docrun.py")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--launcher-arg", action="append", default=[], help="one more flag for both launchers")
    parser.add_argument("--tpassrun-arg", action="append", default=[], help="one more flag for tpassrun only")
    parser.add_argument("--trials", type=int, default=10, help="random-instant SIGKILL runs per shape")
    parser.add_argument("--planned", type=int, default=2, help="planned-swap runs per shape")
    parser.add_argument("--early", type=int, default=0, help="of the --trials, how many kill at a random instant "
                        "of step 1 (inside the first accumulation window when it is 2 micro-steps or more)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--reference", default=None, help="a kept torchrun reference directory of the same shape "
                        "(the first run's <shape>-torchrun): not run again, so a sweep can be split into short runs")
    parser.add_argument("script_args", nargs="*", help="after --: the script's own arguments")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    summary: dict[str, str] = {}
    with Workdir(keep=args.keep) as work:
        etcd = EtcdServer().start()
        try:
            for shape in shapes_of(args, work):
                ref, steps, per_step = reference(work, shape, args.reference)
                print(f"{shape.name}: {shape.nproc} ranks + {shape.spares} spare(s), {steps} steps, "
                      f"{per_step * 1000:.0f} ms/step under torchrun, seed {seed}", flush=True)
                plan = ["kill"] * args.trials + ["planned"] * args.planned
                for i, mode in enumerate(plan):
                    r = one_run(work, etcd, shape, i, mode, ref, steps, per_step, rng,
                                early=mode == "kill" and i < args.early)
                    results.append(r)
                    print(f"  {mode:7s} {i:2d} rank {r['rank']} step {r['step']}: live {'yes' if r['live'] else 'NO '}"
                          f"  exact {'yes' if r['exact'] else 'NO '}  pause {r['pause_s']:.2f} s  run {r['seconds']} s"
                          + ("" if r["kept_pids"] else "  (a survivor lost its process)")
                          + (f"  [{r['why']}]" if r["why"] else ""), flush=True)
                    if r["log"]:
                        print("      " + r["log"].replace("\n", "\n      ")[-600:], flush=True)
                for mode in ("kill", "planned"):
                    rows = [r for r in results if r["shape"] == shape.name and r["mode"] == mode]
                    if rows:
                        line = (f"live {sum(r['live'] for r in rows)}/{len(rows)}, "
                                f"exact {sum(r['exact'] for r in rows)}/{len(rows)}")
                        summary[f"{shape.name} {mode}"] = line
                        print(f"{shape.name} {mode}: {line}", flush=True)
        finally:
            etcd.cleanup()
    print_json({"bench": "frameworks", "seed": seed, "summary": summary,
                "runs": [{k: v for k, v in r.items() if k != "log"} for r in results]})


if __name__ == "__main__":
    main()
