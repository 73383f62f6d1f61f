"""The transparent mode (``--snapshot-interval``, docs/transparent.md) on an unmodified DDP script
(tests/transparent_train.py: plain ``init_process_group``, no tpassrun import), 4 ranks + 1 spare slot, CPU, gloo.

    python bench/transparent.py --trials 5                 # taint and SIGKILL trials, and torchrun's restart
    python bench/transparent.py --trials 5 --kinds taint   # only the planned moves

Each trial starts the job under tpassrun (its own etcd, so ``tpassctl taint`` reaches it) and then:
* taint: at a random step, ``tpassctl taint --rank R`` (R random): every rank is frozen, snapshotted, and restored,
  R's process on the spare slot. Asserted: exit 0, every rank's final model and optimizer state ``torch.equal`` to
  the same script under plain torchrun, each step logged exactly once (0 lost, 0 redone). Reported: the pause (the
  largest gap between two of R's steps, the step time included) and the agent's own figure (freeze to continue).
* kill: at a random instant after the first snapshot, SIGKILL of a random rank's process: every rank restored
  from the last snapshot. Asserted: exit 0, final state ``torch.equal`` to torchrun's, steps redone <= the steps
  of one interval (+1 for the step in flight). Reported: the steps redone, the snapshot's age, the restore time.
* restart: the same taint under tpassrun without ``--snapshot-interval`` (what torchrun does: the whole group
  restarted from the script's start). Reported: the pause (as above) and the steps redone.
Plus, once: torchrun's uninterrupted run (the reference), its ms/step, and ms/step with snapshots every interval
(the step-time overhead), each snapshot's cost (the agent's events: seconds frozen, bytes of images).

Needs root and CRIU >= 4.2 (bash scripts/criu.sh). Hold /work/heavy.lock on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import REPO, EtcdServer, Job, taint

SCRIPT = os.path.join(REPO, "tests", "transparent_train.py")


def tpassrun(out: str, endpoint: str, run_id: str, steps: int, sleep: float, interval: float | None) -> Job:
    snap = ["--snapshot-interval", f"{interval:g}"] if interval else []
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--nproc-per-node", "4", "--spares-per-node", "1", "--max-restarts", "1",
            "--log-dir", os.path.join(out, "logs"), *snap, SCRIPT, "--steps", str(steps), "--step-sleep", str(sleep),
            "--out", out]
    return Job(argv=argv, out=out)


def torchrun(out: str, steps: int, sleep: float) -> Job:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", SCRIPT,
            "--steps", str(steps), "--step-sleep", str(sleep), "--out", out]
    return Job(argv=argv, out=out)


def equal_to(job: Job, ref: Job) -> bool:
    import torch

    for r in range(4):
        a, b = job.final(r), ref.final(r)
        if not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
            return False
        for sa, sb in zip(a["opt"]["state"].values(), b["opt"]["state"].values()):
            if not all(torch.equal(sa[k], sb[k]) for k in sa):
                return False
    return True


def redone(job: Job, steps: int) -> int:
    """Steps logged more than once (a rank re-ran them), the most of any rank."""
    return max(len(job.losses(r)) - steps for r in range(4))


def pause(job: Job, rank: int) -> float:
    rows = job.losses(rank)
    return max((b["t"] - a["t"] for a, b in zip(rows, rows[1:])), default=0.0)


def ms_per_step(job: Job) -> float:
    rows = job.losses(0)
    return 1000 * (rows[-1]["t"] - rows[0]["t"]) / max(1, len(rows) - 1)


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f}" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--kinds", default="taint,kill,restart")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", default="", help="keep every job's directory under this one")
    args = ap.parse_args()
    rnd = random.Random(args.seed)
    base = args.keep or __import__("tempfile").mkdtemp(prefix="tpassrun-bench-transparent-")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    ref = torchrun(os.path.join(base, "torchrun"), args.steps, args.step_sleep).start()
    assert ref.wait(600) == 0, ref.log()[-2000:]
    print(f"torchrun (reference): {ms_per_step(ref):.1f} ms/step over {args.steps} steps", flush=True)
    etcd = EtcdServer().start()
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    failures = 0
    try:
        for trial in range(args.trials):
            for kind in kinds:
                out = os.path.join(base, f"{kind}{trial}")
                job = tpassrun(out, etcd.endpoint, f"tr-{kind}-{trial}", args.steps, args.step_sleep,
                               None if kind == "restart" else args.interval).start()
                row = run_trial(kind, job, etcd.endpoint, f"tr-{kind}-{trial}", rnd, args)
                row["equal"] = row["rc"] == 0 and equal_to(job, ref)
                row["redone"] = redone(job, args.steps) if row["rc"] == 0 else None
                ok = row["rc"] == 0 and row["equal"] and (
                    row["redone"] == 0 if kind == "taint" else
                    row["redone"] is not None and row["redone"] <= row["interval_steps"] + 1 if kind == "kill" else True)
                failures += not ok
                rows[kind].append(row)
                print(f"{kind:8s} trial {trial}: " + " ".join(f"{k}={v}" for k, v in row.items()) +
                      ("" if ok else "  <-- FAIL"), flush=True)
    finally:
        etcd.cleanup()
    print("\nsummary (medians)")
    for kind, rs in rows.items():
        print(f"  {kind:8s} n={len(rs)} ok={sum(r['equal'] for r in rs)} pause_s={med([r['pause_s'] for r in rs])} "
              f"agent_s={med([r['agent_s'] for r in rs if r.get('agent_s') is not None])} "
              f"redone={med([r['redone'] for r in rs if r['redone'] is not None])} "
              f"ms_per_step={med([r['ms_per_step'] for r in rs])} "
              f"snapshot_s={med([s for r in rs for s in r.get('snapshots_s', [])])} "
              f"snapshot_mb={med([b for r in rs for b in r.get('snapshots_mb', [])])}")
    print(f"  torchrun ms_per_step={ms_per_step(ref):.1f}")
    return 1 if failures else 0


def run_trial(kind: str, job: Job, endpoint: str, run_id: str, rnd: random.Random, args: Any) -> dict[str, Any]:
    step_s = args.step_sleep
    row: dict[str, Any] = {"interval_steps": int(args.interval / step_s)}
    rank = rnd.randrange(4)
    if kind in ("taint", "restart"):
        at = rnd.randrange(20, args.steps // 2)
        job.wait_step(at, 300, rank=rank)
        t0 = time.time()
        rc = taint(endpoint, run_id, rank=rank, reason="bench")
        row.update(rank=rank, step=at, taint_rc=rc)
    else:
        job.wait_event("snapshot_taken", timeout=300)
        job.wait_step(5, 300, rank=rank)          # a snapshot can come before a rank's first step
        time.sleep(rnd.uniform(0, 2 * args.interval))
        pid = job.losses(rank)[-1]["pid"]
        t0 = time.time()
        os.kill(pid, signal.SIGKILL)
        row.update(rank=rank, step=job.step_reached(rank))
    row["rc"] = job.wait(600)
    row["pause_s"] = round(pause(job, rank), 3)
    ev = job.events()
    moved = [e for e in ev if e["event"] in ("snapshot_migrated", "snapshot_restored")]
    row["agent_s"] = moved[-1]["seconds"] if moved else None
    if kind == "kill" and moved:
        row["snapshot_age_s"] = moved[-1]["snapshot_age"]
    row["fallbacks"] = sum(e["event"] in ("transparent_fallback", "fallback") for e in ev)
    snaps = [e for e in ev if e["event"] == "snapshot_taken"]
    row["snapshots_s"] = [e["seconds"] for e in snaps]
    row["snapshots_mb"] = [round(e["bytes"] / 2**20, 1) for e in snaps]
    row["ms_per_step"] = round(ms_per_step(job), 1)
    del t0
    return row


if __name__ == "__main__":
    sys.exit(main())
