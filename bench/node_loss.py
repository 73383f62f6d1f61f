"""A whole node lost: tpassrun (a --spare-node takes its ranks live) vs torchrun (whole-group restart).

    python bench/node_loss.py [--trials 2] [--steps 80] [--kill-step 30] [--ttl 10] [--quick]

The same 4-rank job (``examples/train_ddp.py``, 2 nodes of 2 ranks) under both launchers, one "node" = one
agent process on this machine, plus a third agent standing by: tpassrun's is a ``--spare-node`` (warm spares
in its slots), torchrun's a third ``torchrun --nnodes 2`` that waits to be admitted at the next rendezvous round.
The fault is the same for both: at the start of step
``--kill-step`` (``kill_node``: it SIGKILLs its launcher agent and itself; under tpassrun the node's other workers
die with the agent, under torchrun they are orphans that die when their next collective fails). tpassrun uses
its default lease TTL unless ``--ttl`` says otherwise; torchrun gets ``--max-restarts 1`` and
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (without it torchrun 2.13's restart fails in gloo init).

Measured per trial: kill -> every rank has logged a step finished after it, and steps redone or missing
(the example keeps no checkpoint: torchrun's restart redoes every step). Figures only; the last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import uuid

from common import (
    TORCHRUN_RESTART_ENV,
    EtcdServer,
    Job,
    Series,
    Workdir,
    add_common_args,
    alternate,
    faults_env,
    marker_time,
    next_step_after,
    print_json,
    ratio_line,
    steps_lost,
)

LAUNCHERS = ("tpassrun", "torchrun")
WORLD = 4
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_ddp.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(out: str, train: str, endpoint: str, run_id: str, args: argparse.Namespace,
              env: dict[str, str]) -> Job:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--max-restarts", "1",
            EXAMPLE, "--steps", str(args.steps), "--step-sleep", str(args.step_sleep), "--out", train, "--quiet"]
    return Job(argv=argv, out=out, env={**env, **TORCHRUN_RESTART_ENV})


def run_trial(launcher: str, out: str, args: argparse.Namespace, etcd: EtcdServer) -> tuple[int, str]:
    train = os.path.join(out, "train")
    marker = os.path.join(out, "killed")
    die = faults_env(*({"rank": r, "step": args.kill_step, "where": "step", "action": "kill_node",
                        "marker": marker} for r in range(WORLD)))
    victim = "a" if args.victim == "store" else "b"
    run_id = uuid.uuid4().hex[:8]
    if launcher == "tpassrun":
        a, b, c = (Job.agent(os.path.join(out, n), train, endpoint=etcd.endpoint, run_id=run_id, steps=args.steps,
                             step_sleep=args.step_sleep, ttl=args.ttl, extra=["--spare-node"] if n == "c" else [],
                             env=die if n == victim else {}) for n in "abc")
    else:
        endpoint = f"127.0.0.1:{_free_port()}"
        a, b, c = (_torchrun(os.path.join(out, n), train, endpoint, run_id, args, die if n == "b" else {})
                   for n in "abc")
    jobs = (a, b, c)
    try:
        a.start()
        time.sleep(2.0)           # A hosts torchrun's c10d store: it must not be the node that dies
        b.start()
        time.sleep(1.0)
        c.start()
        code = (b if victim == "a" else a).wait(600)
        c.wait(120)
    finally:
        for j in jobs:
            j.kill()
    return code, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, trials=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--kill-step", type=int, default=30)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--ttl", type=float, default=10.0, help="tpassrun's lease TTL (its default is 10 s)")
    parser.add_argument("--victim", choices=("other", "store"), default="other",
                        help="the node killed: 'store' = node A (group rank 0: ranks 0-1 and the workers' store), "
                             "'other' = node B")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS), help="which launchers to run (comma-separated)")
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    recovery = Series("kill -> next step on all ranks", "s")
    lost = Series("steps lost (redone + missing)", "steps")
    failures: list[str] = []
    print(f"{WORLD} ranks on 2 nodes + a standby node, {args.steps} steps, node B killed at the start of step "
          f"{args.kill_step}; tpassrun lease TTL {args.ttl:g} s; {trials} trial(s) per launcher; "
          f"load average {os.getloadavg()[0]:.1f}")
    etcd = EtcdServer().start()
    try:
        with Workdir(keep=args.keep) as work:
            for trial, launcher in alternate(tuple(args.launchers.split(",")), trials):
                out = work.sub(f"{launcher}-{trial}")
                code, train = run_trial(launcher, out, args, etcd)
                kill_wall = marker_time(os.path.join(out, "killed"))
                took = next_step_after(train, WORLD, kill_wall) if kill_wall is not None else None
                loss = steps_lost(train, WORLD, args.steps)
                if code != 0 or took is None:
                    failures.append(f"{launcher} trial {trial}: exit {code}, fault fired: {kill_wall is not None}")
                    print(f"  trial {trial} {launcher:9s} FAILED (exit {code}; recovered: {took is not None})")
                    continue
                recovery.add(launcher, took)
                lost.add(launcher, loss["redone"] + loss["missing"])
                print(f"  trial {trial} {launcher:9s} kill -> next step {took:6.2f} s   steps redone "
                      f"{loss['redone']}, missing {loss['missing']}")
    finally:
        etcd.cleanup()
    for series in (recovery, lost):
        for launcher in LAUNCHERS:
            print(series.line(launcher, digits=3 if series is recovery else 0))
    speedup = recovery.ratio("torchrun", "tpassrun")
    print(ratio_line("speed-up torchrun restart / tpassrun node recovery", speedup, 1.0, at_most=False))
    print(ratio_line("tpassrun steps lost (median)", lost.median("tpassrun"), 0, at_most=True))
    for failure in failures:
        print(failure)
    print_json({"bench": "node_loss", "trials": trials, "steps": args.steps, "kill_step": args.kill_step,
                "ttl": args.ttl, "recovery_s": recovery.values, "steps_lost": lost.values, "speedup": speedup,
                "failures": len(failures), "torchrun_env": TORCHRUN_RESTART_ENV})


if __name__ == "__main__":
    main()
