"""A whole node killed at a uniformly random instant of a step: recovered live and exact, every time?

    python bench/node_instants.py [--runs 10] [--steps 40] [--step-sleep 0.002] [--hidden 256] [--seed S]
    python bench/node_instants.py --runs 5 --steps 24 --script examples/deepspeed/train.py \
        -- --config examples/deepspeed/ds_config_zero3.json           # DeepSpeed ZeRO-3: partitions from the mirror

Each run is ``examples/train_ddp.py`` (or ``--script``, any script following the examples' convention: ``--steps``,
``--step-sleep``, ``--out``, a ``{"step", "pid", "t"}`` row per step, a final state) on 2 nodes of 2 ranks plus a ``--spare-node`` (3 agents on one etcd,
``--max-restarts 1``). Once C's spares are warm, node B (its agent and both its workers, SIGKILLed from outside
back to back, as a host dies) is killed at a random step and a uniformly random instant inside it, so it lands
wherever B's ranks then are: forward, backward, inside the all-reduce, right after it, the optimizer step, the
user code, between steps. Short steps (``--step-sleep`` of user code), so the interesting parts are most of a
step. Printed per run:

  * live: the spare node took B's ranks (``node_recovered``), no group restart, exit 0;
  * exact: final parameters, optimizer state, scheduler, sampler and per-step losses ``torch.equal`` to the same
    script under plain torchrun without a fault (every step logged once: 0 lost);
  * the step B's first rank had logged when it died, and the recovery time (kill -> every rank logged a later step);
  * the workers' own pushes: how many light snapshots the agents still copied (the workers push theirs);
  * relogged: B's two ranks can die on either side of a step (one finished its part of the all-reduce and logged
    the step, the other did not, so the survivors could not complete it): everyone re-executes the step and the
    first one's replacement logs it again, identically. Counted, not a difference (exact compares without it);
  * unlogged: a rank of B whose part of a step reached the survivors but which died before it logged the step
    (the example logs after the backward pass): its successor starts at the next step, so nobody logs that step
    for it. Counted, not a difference (the state after it is compared).

Figures only, no assertions. The last line is JSON. (A node that goes silent instead of crashing is declared lost
at its lease expiry; this bench kills processes, so the agent's closed port declares it at once.)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import uuid
from typing import Any

from common import REPO, EtcdServer, Workdir, next_step_after, print_json, tail, with_script

sys.path.insert(0, os.path.join(REPO, "tests"))
from faults import Job, _without_relogged, assert_bit_exact, faults_env, pid_of_rank, sigkill_node, unlogged_steps

WORLD = 4


def with_args(job: Job, args: argparse.Namespace) -> Job:
    """``job`` with the example's ``--hidden``, or running ``--script`` with its own arguments instead."""
    if args.script:
        return with_script(job, args.script, args.script_args)
    job.argv += ["--hidden", str(args.hidden)]       # a bigger model: a longer all-reduce in each step
    return job


def reference(work: Workdir, args: argparse.Namespace) -> Job:
    job = with_args(Job.torchrun(work.sub("torchrun"), nproc=WORLD, steps=args.steps, step_sleep=0.0), args).start()
    try:
        code = job.wait(300)
    finally:
        job.kill()
    if code != 0:
        raise SystemExit(f"the torchrun reference failed ({code}):\n{tail(job)}")
    return job


def _warm(jobs: tuple[Job, ...], timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = [e for j in jobs for e in j.events()]
        spares = sum(len(e["slots"]) for e in evs if e["event"] == "workers_started" and e.get("spare_node"))
        started = {e["node"] for e in evs if e["event"] == "workers_started"}
        if len(started) == len(jobs) and spares and sum(e["event"] == "spare_ready" for e in evs) >= spares:
            return True
        if any(j.proc is not None and j.proc.poll() is not None for j in jobs):
            return False
        time.sleep(0.05)
    return False


def one_run(work: Workdir, index: int, etcd: EtcdServer, ref: Job, rng: random.Random,
            args: argparse.Namespace) -> dict[str, Any]:
    out = work.sub(f"run-{index}")
    train = os.path.join(out, "train")
    release = os.path.join(out, "release")
    hold = faults_env({"rank": 0, "step": 1, "where": "step", "action": "hold", "release": release})
    run_id = uuid.uuid4().hex[:8]
    a, b, c = jobs = tuple(Job.agent(os.path.join(out, n), train, endpoint=etcd.endpoint, run_id=run_id,
                                     steps=args.steps, step_sleep=args.step_sleep, env=hold,
                                     extra=["--spare-node"] if n == "c" else []) for n in "abc")
    for j in jobs:
        with_args(j, args)
    step, killed_wall, logged, code, b_pids = rng.randint(3, args.steps // 2), None, None, -1, []
    try:
        for j in jobs:
            j.start()
        if _warm(jobs):
            b_pids = b.worker_pids()
            open(release, "w").close()
            logs = Job(argv=[], out=train)
            for r in range(WORLD):
                logs.wait_step(0, 120, rank=r)
            b_rank = next(r for r in range(WORLD) if pid_of_rank(train, r) in b_pids)
            logs.wait_step(step, 120, rank=b_rank)
            rows = logs.losses(b_rank)
            per_step = (rows[-1]["t"] - rows[0]["t"]) / max(1, len(rows) - 1)
            time.sleep(rng.uniform(0, per_step))
            killed_wall = time.time()
            sigkill_node(b)
            logged = logs.step_reached(b_rank)
        code = a.wait(300)
        c.wait(60)
    except AssertionError:
        code = -1
    finally:
        for j in jobs:
            j.kill()
    evs = [e for j in jobs for e in j.events()]
    recovered = [e for e in evs if e["event"] == "node_recovered"]
    decided = [e.get("reason", "") for e in evs if e["event"] in ("node_lost_decided", "restart", "fallback")]
    aborted = [e.get("reason", "") for e in evs if e["event"] == "swap_phase" and e.get("phase") == "aborted"]
    live = code == 0 and killed_wall is not None and bool(recovered) and not aborted and not any(
        e["event"] == "restart" for e in evs)
    caught = [(e["rank"], e["step"]) for e in evs if e["event"] == "rank_caught_up"]
    try:
        assert_bit_exact(Job(argv=[], out=train), ref, WORLD, relogged_by=b_pids, caught_up=caught)
        exact, why = True, ""
    except (AssertionError, OSError, KeyError, EOFError, RuntimeError) as exc:
        exact, why = False, str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    logs = Job(argv=[], out=train)
    relogged = sum(len(logs.losses(r)) - len(_without_relogged(logs.losses(r), set(b_pids))) for r in range(WORLD))
    unlogged = sum(len(unlogged_steps(_without_relogged(logs.losses(r), set(b_pids)), set(b_pids))) for r in range(WORLD))
    redone = max(len(rows) - len({x["step"] for x in rows})
                 for rows in (_without_relogged(logs.losses(r), set(b_pids)) for r in range(WORLD)))
    missing = max(len(set(range(args.steps)) - {x["step"] for x in logs.losses(r)}
                      - unlogged_steps(_without_relogged(logs.losses(r), set(b_pids)), set(b_pids))
                      - {step - 1 for rank, step in caught if rank == r}) for r in range(WORLD))   # skipped, not lost
    lost = {"redone": redone, "missing": missing}
    caught_up = sorted({e["rank"] for e in evs if e["event"] == "rank_caught_up"})
    pushes = [e["mirror"]["pushes"] for j in (a, c) for e in j.events()
              if e["event"] == "agent_exit" and e.get("mirror")]
    return {"run": index, "step": logged, "exit": code, "live": live, "exact": exact, "relogged": relogged,
            "unlogged": unlogged, "caught_up": caught_up,
            "lost": lost["redone"] + lost["missing"],
            "recovery_s": next_step_after(train, WORLD, killed_wall) if live and killed_wall else None,
            "agent_copies": max(pushes) if pushes else None,
            "why": "; ".join(r for r in [*aborted, why] if r)[:300] if not exact or aborted else decided[0] if decided else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-sleep", type=float, default=0.002, help="user code after the optimizer step (s)")
    parser.add_argument("--hidden", type=int, default=256, help="the example's hidden width (its all-reduce size)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--script", default=None, help="another script than examples/train_ddp.py (see above)")
    parser.add_argument("script_args", nargs="*", help="after --: --script's own arguments")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    print(f"node_instants: {args.runs} runs, 2 nodes x 2 ranks + a spare node, node B killed at a uniformly "
          f"random instant, {args.steps} steps, seed {seed}, load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    etcd = EtcdServer().start()
    try:
        with Workdir(keep=args.keep) as work:
            ref = reference(work, args)
            for i in range(args.runs):
                r = one_run(work, i, etcd, ref, rng, args)
                results.append(r)
                rec = f"{r['recovery_s']:.2f} s" if r["recovery_s"] is not None else "-"
                print(f"  run {i:2d}: died after step {r['step']}: live {'yes' if r['live'] else 'NO '}  exact "
                      f"{'yes' if r['exact'] else 'NO '}  lost {r['lost']}  recovery {rec}  agent copies "
                      f"{r['agent_copies']}" + (f"  (a lost rank's last step logged again by its successor: "
                                                  f"{r['relogged']})" if r["relogged"] else "")
                  + (f"  (a lost rank's last step, completed by the survivors, never logged: {r['unlogged']})"
                     if r["unlogged"] else "")
                  + (f"  (a mixed commit: ranks {r['caught_up']} caught up)" if r["caught_up"] else "") + ("" if r["live"] and r["exact"] else f"  [{r['why']}]"), flush=True)
    finally:
        etcd.cleanup()
    good = [r for r in results if r["live"] and r["exact"] and r["lost"] == 0]
    times = sorted(r["recovery_s"] for r in good if r["recovery_s"] is not None)
    med = times[len(times) // 2] if times else None
    print(f"live, exact, 0 lost: {len(good)}/{len(results)}; recovery median "
          f"{'-' if med is None else f'{med:.2f} s'}; load average {os.getloadavg()[0]:.1f}")
    print_json({"bench": "node_instants", "seed": seed, "runs": results, "good": f"{len(good)}/{len(results)}"})


if __name__ == "__main__":
    main()
