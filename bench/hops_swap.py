"""How many module boundaries a planned swap crosses (issue 23's hop count), in every process of a real job.

    python bench/hops_swap.py [--tree DIR] [--python EXE] [--runs 3] [--keep]

A job of 2 nodes (two agents on one etcd, started here) x 2 ranks of ``examples/train_ddp.py`` (gloo, ``--steps
60``), node b with ``--spares-per-node 1``. The job is held at step ``--taint-at`` (tests/faults.py's ``Hold``)
until b's spare is ready (under load a traced spare takes tens of seconds to import torch), released, and right then
the bench runs ``tpassctl taint --rank R`` for a rank of node a, so the planned swap moves that rank across nodes
into b's spare while the job has 50 steps left. A second hold, 10 steps before the end, is released once the
swap's boundary is fixed (its ``swap_boundary`` event): the job cannot end before its swap (under load average
20+, 2 of 8 runs of a version without it ended with no swap at all). It is reached only when the swap
is that late, and then its wait is in the window. Every Python process of the job (both agents, all
workers, the spare) runs with ``bench/hopstrace`` first on ``PYTHONPATH`` and ``TPASSRUN_HOPS_TRACE`` set, so
``bench/hopstrace/sitecustomize.py`` records each move between the project's files (tpassrun/, rendezvous/,
health/; everything else seen through, ``bench/hopstrace/hopcount.py`` says how) with its wall-clock time and
writes one JSON file per process. ``tpassctl`` itself is not traced.

Two windows, both from the taint's own ``time`` (written by tpassctl, read back from etcd): to the leader's
``generation_committed`` event (the swap's commit, the issue's window), and to its ``swap_resumed`` (the world
re-formed, training on). Per role (the leader's agent: the one that logged ``generation_committed``; the other
agent; the leaving rank's worker; the spare that joins; the survivors' workers, summed) and in total: the files that
took part in a move; distinct crossings (file -> file, down) and of them between packages (the "module boundaries"
of the issue: in the flat tree every module was its own package); moves (calls into another file), returns back
up, moves between packages; and the most frequent crossings. The distinct counts are what the code's shape
decides; the move counts also grow with the window's length (the agents poll the channel and etcd while they
wait, the survivors step until the boundary), which the host's load stretches: compare them with the window.

Before the package move (c0a17c6), the same bench against the flat tree: its source in a worktree and an
interpreter whose ``tpassrun``, ``tpassrun.rendezvous`` and ``tpassrun.health`` all come from there (checked at
start: ``PYTHONPATH=<old tree>`` alone is not enough, this venv's editable install maps the two sub-packages to
this tree; bench/README.md's "Hop counts" says how that venv was made), the tracer from this tree::

    git worktree add ../tpassrun-before c0a17c6^
    python bench/hops_swap.py --tree ../tpassrun-before --python ../tpassrun-before/.venv/bin/python

Figures (2026-11-29, ``--runs 3`` each, load average 10-25; medians, taint -> commit, all 7 processes):

    | tree | window s | files | crossings | between packages | moves | moves between packages |
    | before (5dd78a2 = c0a17c6^) | 0.46 | 60 | 122 | 108 | 5693 | 5384 |
    | after (3fa4a79) | 1.22 | 71 | 158 | 31 | 5556 | 4236 |

Figures only; the last line is JSON.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

from common import EtcdServer, Job, Workdir, faults_env, print_json, taint_times
from faults import Hold, hold_at

BENCH = os.path.dirname(os.path.abspath(__file__))
TRACER = os.path.join(BENCH, "hopstrace")
sys.path.insert(0, TRACER)

from hopcount import ENV, PARTS, summarise, window  # noqa: E402

ROLES = ("leader agent", "other agent", "leaving worker", "joining spare", "survivor workers", "other")
COLUMNS = ("files", "crossings", "package_crossings", "moves", "back_up", "between_packages")
WINDOWS = ("commit", "resumed")     # taint -> the leader's generation_committed; taint -> its swap_resumed


def agent(tree: str, python: str, out: str, train: str, *, endpoint: str, run_id: str, spares: int,
          steps: int, trace: str, holds: tuple[Hold, ...]) -> Job:
    argv = [python, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "2", "--spares-per-node", str(spares),
            "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", "lease_ttl=3,last_call_timeout=1", "--max-restarts", "1",
            "--log-dir", os.path.join(out, "logs"), os.path.join(tree, "examples", "train_ddp.py"),
            "--steps", str(steps), "--step-sleep", "0.05", "--out", train, "--quiet"]
    return Job(argv=argv, out=out, env={"PYTHONPATH": TRACER, ENV: trace, **faults_env(*(h.fault for h in holds))})


def tpassctl_taint(tree: str, python: str, endpoint: str, run_id: str, rank: int) -> None:
    module = "tpassrun.ops.ctl" if os.path.exists(os.path.join(tree, "tpassrun", "ops", "ctl.py")) else "tpassrun.ctl"
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONPATH")}
    subprocess.run([python, "-m", module, "taint", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rank",
                    str(rank), "--reason", "hops", "--no-wait"], check=True, capture_output=True, timeout=120, env=env)


def until(what: str, ready: Any, jobs: list[Job], timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        for job in jobs:
            job.assert_running(what)
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} in {timeout}s:\n" + "\n".join(j.log()[-2000:] for j in jobs))
        time.sleep(0.1)


def role(record: dict[str, Any], leader: int, other: int, leaver: int) -> str:
    pid, env = record["pid"], record["env"]
    if pid == leader:
        return "leader agent"
    if pid == other:
        return "other agent"
    if "TPASSRUN_SLOT" not in env:
        return "other"
    if env.get("TPASSRUN_SPARE") == "1":
        return "joining spare"
    return "leaving worker" if env.get("RANK") == str(leaver) else "survivor workers"


def run(tree: str, python: str, out: str, etcd: EtcdServer, taint_at: int, steps: int) -> dict[str, Any]:
    trace, train, run_id = os.path.join(out, "trace"), os.path.join(out, "train"), uuid.uuid4().hex[:8]
    os.makedirs(trace)
    hold, late = hold_at(out, taint_at), hold_at(out, steps - 10, name="late")
    a, b = (agent(tree, python, os.path.join(out, n), train, endpoint=etcd.endpoint, run_id=run_id,
                  spares=int(n == "b"), steps=steps, trace=trace, holds=(hold, late)).start() for n in "ab")
    started = until("workers started on node a", lambda: [e for e in a.events() if e["event"] == "workers_started"],
                    [a, b])
    leaver = next(s["rank"] for s in started[-1]["slots"] if s["rank"] is not None and s["rank"] >= 0)
    until("the spare ready", lambda: [e for e in b.events() if e["event"] == "spare_ready"], [a, b])
    until(f"the hold at step {taint_at}", hold.reached, [a, b])
    hold.release()
    tpassctl_taint(tree, python, etcd.endpoint, run_id, leaver)
    start = min(taint_times(etcd.endpoint, run_id))
    until("swap_boundary", lambda: [e for j in (a, b) for e in j.events() if e["event"] == "swap_boundary"], [a, b])
    late.release()
    committed = until("generation_committed", lambda: [e for j in (a, b) for e in j.events()
                                                       if e["event"] == "generation_committed"], [a, b])
    resumed = until("swap_resumed", lambda: [e for e in (a if committed[0] in a.events() else b).events()
                                             if e["event"] == "swap_resumed"], [a, b])
    for job in (a, b):
        assert job.wait(600) == 0, job.log()[-3000:]
    leader, other = (a, b) if committed[0] in a.events() else (b, a)
    assert leader.proc is not None and other.proc is not None
    ends = {"commit": committed[0]["time"], "resumed": resumed[0]["time"]}
    per_role: dict[str, dict[str, list[tuple[str, str, int]]]] = {w: {r: [] for r in ROLES} for w in WINDOWS}
    processes: dict[str, int] = {r: 0 for r in ROLES}
    for path in glob.glob(os.path.join(trace, "*.json")):
        with open(path) as fh:
            record = json.load(fh)
        who = role(record, leader.proc.pid, other.proc.pid, leaver)
        processes[who] += 1
        for w in WINDOWS:
            per_role[w][who] += window(record["moves"], record["names"], start, ends[w])
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for w, moves in per_role.items():
        rows[w] = {r: {**summarise(m), "processes": processes[r]} for r, m in moves.items() if processes[r]}
        rows[w]["total"] = {**summarise([m for r in ROLES for m in moves[r]]), "processes": sum(processes.values())}
    return {"window_s": {w: round(ends[w] - start, 3) for w in WINDOWS}, "leaver": leaver, "rows": rows}


def report(runs: list[dict[str, Any]], w: str) -> None:
    print(f"\n### taint -> {w}: {[r['window_s'][w] for r in runs]} s")
    print("| role | processes | " + " | ".join(c.replace("_", " ") for c in COLUMNS) + " |")
    print("| --- " * (len(COLUMNS) + 2) + "|")
    for name in (*ROLES, "total"):
        got = [r["rows"][w][name] for r in runs if name in r["rows"][w]]
        if got:
            cells = [f"{statistics.median(g[c] for g in got):g} {[g[c] for g in got]}" for c in COLUMNS]
            print(f"| {name} | {got[0]['processes']} | " + " | ".join(cells) + " |")
    last = runs[-1]["rows"][w]
    for name in (*ROLES, "total"):
        if name in last:
            print(f"\n{name}, top crossings of the last run (down; file -> file | package -> package):")
            for (a, b, n), (pa, pb, pn) in itertools.zip_longest(last[name]["top"], last[name]["top_packages"],
                                                                  fillvalue=("", "", "")):
                print(f"  {n:>6}  {a} -> {b}".ljust(80) + (f"| {pn:>6}  {pa} -> {pb}" if pn != "" else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default=os.path.dirname(BENCH), help="the source tree whose tpassrun runs the job")
    parser.add_argument("--python", default=sys.executable, help="an interpreter importing tpassrun from --tree")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--taint-at", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="keep the jobs' output (and the per-process traces)")
    args = parser.parse_args()
    tree = os.path.abspath(args.tree)
    if args.runs < 1:
        raise SystemExit("hops_swap: --runs must be at least 1")
    # PYTHONPATH=<tree> alone is not enough: an editable install maps tpassrun.rendezvous / .health to its own tree
    check = subprocess.run([args.python, "-c", "import sys, tpassrun, tpassrun.rendezvous as r, tpassrun.health as h; "
                            "print(tpassrun.__file__, r.__file__, h.__file__)"], capture_output=True, text=True, cwd="/",
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})     # as the jobs get it
    found = check.stdout.split()
    if len(found) != 3 or not all(f.startswith(os.path.join(tree, p) + os.sep) for f, p in zip(found, PARTS)):
        raise SystemExit(f"hops_swap: {args.python} imports {check.stdout.strip() or check.stderr.strip()!r}, "
                         f"not tpassrun, rendezvous and health of {tree}")
    runs = []
    with Workdir(keep=args.keep, prefix="tpassrun-hops-") as work:
        etcd = EtcdServer().start()
        try:
            for i in range(args.runs):
                runs.append(run(tree, args.python, os.path.join(work.path, f"run{i}"), etcd, args.taint_at, args.steps))
                print(f"run {i}: {runs[-1]['window_s']} s, moves {[runs[-1]['rows'][w]['total']['moves'] for w in WINDOWS]}",
                      flush=True)
        finally:
            etcd.cleanup()
    print(f"tree {tree}")
    for w in WINDOWS:
        report(runs, w)
    print_json({"tree": tree, "runs": [{**r, "rows": {w: {k: {c: v[c] for c in (*COLUMNS, "processes")}
                                                         for k, v in rows.items()} for w, rows in r["rows"].items()}}
                                       for r in runs]})


if __name__ == "__main__":
    main()
