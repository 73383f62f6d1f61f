"""Under a real Slurm: the node running the workers' store (ranks 0-1) lost vs another member node lost (issue 37).

    python bench/slurm_store.py [--trials 5] [--steps 120] [--kill-step 20] [--keep] [--tree DIR]

A private Slurm (``tests/slurmcluster.py``: slurmctld, munged and three slurmd nodes n1-n3 on this host; root,
``slurm-wlm``). Each trial is one ``sbatch -N3 --no-kill`` of docs/slurm.md's script (``srun --no-kill
--ntasks-per-node 1 tpassrun --nproc-per-node 2 --spare-nodes 1 examples/train_ddp.py``), with a site etcd
(``--rdzv-backend etcd --rdzv-endpoint``, started by this bench) so that any member node may die without taking the
run's etcd with it (the hosted one runs on the step's first node). Once every rank reached ``--kill-step``, one
member node dies as a host does (``SlurmCluster.kill_node``: its slurmd, the step's slurmstepd and every process
under it, SIGSTOPped then SIGKILLed at one instant): ``store`` = the node whose agent is group rank 0 (it runs
ranks 0-1 and the workers' store), ``other`` = the other member. The two alternate (store, other, store, ...).

Measured per trial: the kill -> every rank has logged a step finished after it (the loss rows' wall clock), and
the phases from the event logs (seconds after the kill): lost (node_lost), decided (node_lost_decided), transfer
(swap_transfer_end, last), re-formed (swap_world_reformed, last), and the slowest rank's join of the re-formed
world (swap_reform_timings). Printed: every trial, the medians, the ratio store / other (target <= 1.5), the load
average at each trial. Figures only; the last line is JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from typing import Any

from common import EtcdServer, Job, Workdir, events, next_step_after, print_json, ratio_line, steps_lost
from slurmcluster import NODES, SlurmCluster, descendants, parent, unavailable  # tests/ (common put it on the path)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_ddp.py")
WORLD = 4
ROWS = ("store", "other")


def _script(out: str, endpoint: str, run_id: str, args: argparse.Namespace) -> str:
    path = os.path.join(out, "job.sh")
    with open(path, "w") as fh:
        fh.write(f"""#!/bin/bash
srun --no-kill --ntasks-per-node 1 --output={out}/agent-%t.log \\
    {sys.executable} -m tpassrun --nproc-per-node 2 --spare-nodes 1 --rdzv-backend etcd --rdzv-endpoint {endpoint} \\
    --rdzv-id {run_id} --rdzv-conf lease_ttl={args.ttl:g} --log-dir {out}/logs \\
    {EXAMPLE} --steps {args.steps} --step-sleep {args.step_sleep} --out {out}/train --quiet
echo $? > {out}/rc
""")
    return path


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def _warm(evs: list[dict[str, Any]]) -> bool:
    spares = sum(len(e["slots"]) for e in evs if e["event"] == "workers_started" and e.get("spare_node"))
    return bool(spares) and sum(1 for e in evs if e["event"] == "spare_ready") >= spares


def phases(evs: list[dict[str, Any]], killed_mono: float) -> dict[str, float]:
    """Seconds after the kill of each phase's first (or, for the per-node ones, last) event (pure)."""
    after = [e for e in evs if e.get("mono", 0) >= killed_mono]
    found: dict[str, float] = {}
    for name, key, pick in (("lost", "node_lost", min), ("decided", "node_lost_decided", min),
                            ("transferred", "swap_transfer_end", max), ("re-formed", "swap_world_reformed", max),
                            ("recovered", "node_recovered", min)):
        times = [e["mono"] - killed_mono for e in after if e["event"] == key]
        if times:
            found[name] = pick(times)
    joins = [r.get("join_s", 0.0) for e in after if e["event"] == "swap_reform_timings" for r in e["ranks"].values()]
    if joins:
        found["slowest join"] = max(joins)
    return found


def run_trial(slurm: SlurmCluster, etcd: EtcdServer, row: str, out: str, args: argparse.Namespace) -> dict[str, Any]:
    os.makedirs(out, exist_ok=True)
    run_id = "s" + uuid.uuid4().hex[:8]
    slurm.sbatch(_script(out, etcd.endpoint, run_id, args), "-N3", "--no-kill", f"--output={out}/batch.out")
    logs, train = Job(argv=[], out=out), os.path.join(out, "train")
    try:
        _wait(lambda: _warm(logs.events()), 240, "the job's spare node warm")
        _wait(lambda: all(Job(argv=[], out=train).step_reached(r) >= args.kill_step for r in range(WORLD)), 240,
              f"every rank at step {args.kill_step}")
        evs = logs.events()
        placed = {s["rank"]: e["node"] for e in evs if e["event"] == "workers_started"
                  for s in e["slots"] if s.get("rank") is not None and s["rank"] >= 0}
        store_node, other_node = placed[0], next(n for r, n in placed.items() if n != placed[0])
        victim = store_node if row == "store" else other_node
        agent = next(int(e["node"].rsplit("-", 2)[1]) for e in evs if e["event"] == "agent_started"
                     and e["node"] == victim)
        stepd = parent(agent)
        slurm_node = victim.split("-")[0]
        killed_wall = time.time()
        killed_mono = slurm.kill_node(slurm_node, [stepd, *descendants(stepd)])
        _wait(lambda: os.path.exists(os.path.join(out, "rc")), 300, "the job's end")
        with open(os.path.join(out, "rc")) as fh:
            rc = fh.read().strip()
        took = next_step_after(train, WORLD, killed_wall)
        lost = steps_lost(train, WORLD, args.steps)
        return {"row": row, "victim": slurm_node, "rc": rc, "seconds": took, "lost": lost["redone"] + lost["missing"],
                "phases": phases(events(out), killed_mono), "moved_store": any(e["event"] == "store_moved"
                                                                                 for e in events(out))}
    finally:
        slurm.run("scancel", "--full", "--user=root", check=False)
        for node in NODES:
            slurm.start_node(node)
        slurm.resume_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per row (alternated)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-step", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.05)
    parser.add_argument("--ttl", type=float, default=10.0)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--tree", default="", help="run tpassrun from this source tree (PYTHONPATH): a 'before' run")
    args = parser.parse_args()
    if args.tree:
        os.environ["PYTHONPATH"] = os.path.abspath(args.tree)
    why = unavailable()
    if why:
        raise SystemExit(f"bench/slurm_store.py: {why}")
    results: list[dict[str, Any]] = []
    with Workdir(keep=args.keep, prefix="tpassrun-slurm-store-") as work:
        os.makedirs(work.sub("slurm"))
        slurm = SlurmCluster(work.sub("slurm"))
        etcd = EtcdServer().start()
        try:
            slurm.start()
            for trial in range(args.trials):
                for row in ROWS:
                    load = os.getloadavg()[0]
                    try:
                        res = run_trial(slurm, etcd, row, work.sub(f"{row}-{trial}"), args)
                    except TimeoutError as exc:
                        res = {"row": row, "rc": "timeout", "seconds": None, "error": str(exc)}
                    res["load"] = load
                    results.append(res)
                    ph = "  ".join(f"{k} +{v:.2f}" for k, v in res.get("phases", {}).items())
                    took = f"{res['seconds']:6.2f} s" if res.get("seconds") is not None else "FAILED"
                    print(f"  trial {trial} {row:5s} ({res.get('victim', '?')}) kill -> next step {took}  rc "
                          f"{res['rc']}  steps lost {res.get('lost')}  store moved {res.get('moved_store')}  "
                          f"load {load:.1f}\n      {ph}", flush=True)
        finally:
            etcd.cleanup()
            slurm.close()
    med: dict[str, float | None] = {}
    for row in ROWS:
        vals = [r["seconds"] for r in results if r["row"] == row and r.get("seconds") is not None and r["rc"] == "0"]
        med[row] = statistics.median(vals) if vals else None
        print(f"{row:5s} node lost: median {med[row] if med[row] is not None else float('nan'):.3f} s  trials "
              f"[{', '.join(f'{v:.3f}' for v in vals)}]")
    ratio = med["store"] / med["other"] if med["store"] is not None and med["other"] else None
    print(ratio_line("store-holding node / other node", ratio, 1.5, at_most=True))
    print_json({"bench": "slurm_store", "trials": args.trials, "results": results, "ratio": ratio})


if __name__ == "__main__":
    main()
