"""Chaos: one long job under a random schedule of faults, and what each cost.

    .venv/bin/python bench/chaos.py --faults 50 --seed 1            # every kind (root: netns and a tmpfs too)
    .venv/bin/python bench/chaos.py --faults 4 --kinds worker_sigkill,corrupt_transfer,forged_plan,etcd_restart

A job of 4 ranks on 2 agents (2 ranks + 1 warm spare each) plus a ``--spare-node`` agent, against one external
etcd; as root every agent is a host of its own (a network namespace with a veth on a bridge, see
``tests/faults.py``'s NetLab) and the logs live on a small tmpfs. The reference is the same script under plain
torchrun with no fault. Faults are drawn one at a time (every kind once, in random order, then at random),
each at a random instant, each followed by a settling wait until the job is back to full strength (every rank
running, a ready spare, no swap in flight, training moving) or ``--settle`` seconds; from step 200 on the job
crawls (1.5 s per step) until the last fault settled, so it cannot end first. All
faults go through ``tests/faults.py`` (kills, stalls, taints, partitions, etcd outages, in-process switches).

  worker_sigkill    a rank's process SIGKILLed at whatever instant it is in
  sigstop_hang      a rank's process SIGSTOPped (found by --hang-timeout)
  agent_sigkill     a member node's agent SIGKILLed (its workers die with it); a new spare-node agent replaces it
  joiner_dies       the spare taking a rank dies as it starts to receive (planned or unplanned swap)
  donor_dies        the leaver (planned) or the donor replica (unplanned) dies as it starts to send
  corrupt_transfer  one byte of a transfer flipped on the wire
  forged_transfer   a stranger without the key races the sender to the joiner's listener
  forged_plan       a swap plan written into etcd naming a trap socket as the joiner
  etcd_restart      etcd SIGKILLed and restarted on its data after 1-4 s
  partition         a member node cut off from everyone for less or more than the lease TTL (netns)
  disk_full         the log disk full, and a worker SIGKILLed meanwhile (tmpfs)
  malformed_value   garbage written to a swap, taint, failure, status, report, fallback key or the generation
  taint_storm       three ranks tainted at once (racing tpassctl runs), one of them twice
  taint             one planned swap

The first table has one row per fault: the step it hit, survived live (recovered with no whole-group restart)
or fell back (and why), steps lost (the progress a fallback threw away: rank 0's log rows that repeat a step),
recovery time (injection -> full strength again) and what the attacks achieved; the second sums it per kind;
then for the run: steps never completed, whether the final state is ``torch.equal`` to the torchrun
reference's (and every logged loss equal to its), orphans (processes of the run alive at the end), leftover files of its agents, and ranks
held by two live processes at once (two pids of one rank logging at overlapping times). The last line is JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from chaos_cluster import RANKS, Cluster
from chaos_kinds import KINDS, NOTHING_TO_RECOVER, after
from faults import Job, NetLab, SmallDisk, assert_bit_exact, never_logged

CRAWL_FROM, CRAWL_S = 200, 1.5     # from this step on, each step takes this long until the last fault settled
# A fence is not one: the fenced node's workers must die (like an agent SIGKILL's); whether its ranks were then
# recovered live or the group restarted shows in the other nodes' events ("generation N requested: node X fenced").
RESTART_EVENTS = ("fallback", "restart", "membership_change")


@dataclass
class Fault:
    n: int
    kind: str
    t0: float
    note: str = ""
    t1: float = 0.0
    step: int = -1             # rank 0's last logged step when the fault was injected
    recovery_s: float | None = None   # injection -> back to full strength (every rank running, spares ready)
    outcome: str = ""          # "survived live" | "fell back" | "job ended" | "not settled"
    why: str = ""
    steps_redone: int = 0
    events: list[str] = field(default_factory=list)


def schedule(rng: random.Random, kinds: list[str], n: int) -> list[str]:
    """Every kind once in random order, then uniformly at random."""
    first = rng.sample(kinds, len(kinds))
    return (first + [rng.choice(kinds) for _ in range(max(0, n - len(kinds)))])[:n]


def classify(c: Cluster, f: Fault, settled: bool) -> None:
    window = [e for e in c.events() if f.t0 <= e.get("time", 0) <= f.t1]
    f.events = sorted({e["event"] for e in window})
    restarts = [e for e in window if e["event"] in RESTART_EVENTS
                or (e["event"] == "generation_ended" and e.get("outcome") in ("failed", "membership")
                    and not str(e.get("reason", "")).startswith("fenced:"))]   # the fenced node's own, see above
    # recovery time: to the last recovery in the window (a resumed swap, a restarted group's workers) when there was
    # one, not to the first look at full strength (a hang is found --hang-timeout after it began)
    recovered = [e["time"] for e in window if e["event"] == "swap_resumed"
                 or (e["event"] == "workers_started" and not e.get("spare_node"))]
    if recovered:
        f.recovery_s = max(f.recovery_s or 0.0, max(recovered) - f.t0)
    if restarts:
        f.outcome = "fell back"
        first = restarts[0]
        f.why = str(first.get("reason") or first["event"])[:90]
    elif not c.any_running():
        f.outcome, f.why = "job ended", ""
    elif not settled:
        f.outcome = "not settled"
    else:
        f.outcome = "survived live"


def settle(c: Cluster, f: Fault, timeout: float) -> tuple[bool, str]:
    """Until the job is back to full strength and rank 0 moved on by 2 steps from there (or ``timeout``); the
    first moment of full strength is the fault's recovery time."""
    deadline = time.monotonic() + timeout
    why = ""
    time.sleep(1.0)
    while time.monotonic() < deadline and c.any_running():
        c.release_handled_taints()
        ok, why = c.steady()
        if ok and f.recovery_s is None:
            f.recovery_s = time.time() - f.t0
        if ok:
            start = c.step(0)
            t = time.monotonic()
            while c.step(0) < start + 2 and time.monotonic() < min(deadline, t + 30) and c.any_running():
                time.sleep(0.1)
            if c.step(0) >= start + 2:
                ok, why = c.steady()
                if ok:
                    return True, "steady"
        time.sleep(0.3)
    return False, why


def redone_by_fault(c: Cluster, faults: list[Fault]) -> None:
    """Rank 0's rows that repeat an earlier step, attributed to the last fault before them that was not survived
    live (a group restart redoes its steps while later faults are injected)."""
    seen: set[int] = set()
    starts = [f.t0 if f.outcome != "survived live" else float("inf") for f in faults]
    for row in c.losses(0):
        if row["step"] in seen:
            i = max((k for k, t in enumerate(starts) if t <= row["t"]), default=None)
            if i is not None:
                faults[i].steps_redone += 1
        seen.add(row["step"])


def never_done(c: Cluster, steps: int) -> tuple[int, int]:
    """(steps some rank never completed, steps a killed rank completed but never logged), summed over ranks.

    A rank SIGKILLed after its part of a step's all-reduce reached the survivors, but before it logged the step,
    leaves that step unlogged: its successor resumes at the next step (the log jumps one step where the process
    changes; :func:`faults.unlogged_steps`). The step happened (the final state, compared with the reference's,
    includes it): it is counted apart, not as lost."""
    lost = unlogged = 0
    for r in range(RANKS):
        rows = c.losses(r)
        never, not_logged = never_logged(rows, steps, {x["pid"] for x in rows})
        lost, unlogged = lost + len(never), unlogged + len(not_logged)
    return lost, unlogged


def same_run(job: Job, base: Job) -> str:
    """"yes" when every rank's final state and per-step loss log are those of the torchrun reference
    (``faults.assert_bit_exact``); "yes (...)" when the final state is ``torch.equal`` and every logged step (a
    step redone after a fallback too) has exactly the reference's loss; else what differs."""
    import torch

    pids = {x["pid"] for r in range(RANKS) for x in job.losses(r)}
    try:
        assert_bit_exact(job, base, RANKS, relogged_by=pids)
        return "yes"
    except (AssertionError, OSError, KeyError):
        pass
    try:
        for r in range(RANKS):
            fa, fb = job.final(r), base.final(r)
            for k, v in fa["model"].items():
                if not torch.equal(v, fb["model"][k]):
                    return f"NO (rank {r}: parameter {k} differs)"
            for pid, st in fa["optimizer"]["state"].items():
                for k, v in st.items():
                    if not torch.equal(v, fb["optimizer"]["state"][pid][k]):
                        return f"NO (rank {r}: optimizer state {pid}/{k} differs)"
            if fa["scheduler"] != fb["scheduler"] or fa["sampler"] != fb["sampler"]:
                return f"NO (rank {r}: scheduler or sampler state differs)"
            ref = {x["step"]: x["loss"] for x in base.losses(r)}
            bad = [x["step"] for x in job.losses(r) if ref.get(x["step"]) != x["loss"]]
            if bad:
                return f"NO (rank {r}: the loss of step {bad[0]} differs)"
    except (OSError, KeyError) as exc:
        return f"NO ({type(exc).__name__}: {exc})"
    return "yes (final state torch.equal; the logs repeat the steps fallbacks redid, each with the reference's loss)"


def double_held(c: Cluster) -> int:
    """Ranks whose step logs show two pids logging at overlapping times."""
    bad = 0
    for r in range(RANKS):
        spans: dict[int, list[float]] = {}
        for x in c.losses(r):
            lo_hi = spans.setdefault(x["pid"], [x["t"], x["t"]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], x["t"]), max(lo_hi[1], x["t"])
        ordered = sorted(spans.values())
        bad += any(b[0] < a[1] for a, b in zip(ordered, ordered[1:]))
    return bad


def leftovers(c: Cluster) -> list[str]:
    """Files of this run's agents that outlived them: shared-memory channels, socket dirs, registry entries."""
    pids = {a.pid for a in c.agents if a.pid is not None}
    found = [p for pid in pids for p in glob.glob(f"/dev/shm/tpassrun-{pid}-*.chan")]
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "tpr-*")):
        try:
            with open(os.path.join(path, "owner.pid")) as fh:
                if int(fh.read().strip() or 0) in pids:
                    found.append(path)
        except (OSError, ValueError):
            pass
    from tpassrun.ops.registry import registry_dir

    found += [p for p in glob.glob(os.path.join(registry_dir(), f"{c.run_id}-*.json"))]
    return sorted(found)


def inject_all(c: Cluster, args: argparse.Namespace, rng: random.Random, faults: list[Fault]) -> None:
    """The faults, one at a time, each followed by its settling wait; a fault kind that fails in the harness
    itself is noted and the run goes on."""
    for n, kind in enumerate(schedule(rng, args.kinds, args.faults), 1):
        if not c.any_running():
            break
        time.sleep(rng.uniform(0.2, 2.0))      # a random instant of whatever step it is in
        f = Fault(n, kind, time.time(), step=c.step(0))
        print(f"[{time.strftime('%H:%M:%S')}] fault #{n}: {kind} at step {f.step}", flush=True)
        try:
            f.note = KINDS[kind](c, rng)
        except Exception as exc:  # noqa: BLE001 - the harness's own failure, not the job's
            f.note = f"harness error: {type(exc).__name__}: {exc}"
        settled, why = settle(c, f, args.settle)
        f.t1 = time.time()
        classify(c, f, settled)
        after(c, kind)
        rec = f"{f.recovery_s:.1f} s" if f.recovery_s is not None else "-"
        print(f"    {f.note}\n    -> {f.outcome}{': ' + f.why if f.why else ''} (full strength after {rec})"
              f"{'' if settled else f' (last check: {why})'}", flush=True)
        faults.append(f)
        if kind in NOTHING_TO_RECOVER or f.outcome != "survived live":
            settle(c, f, args.settle)   # whatever it was, start the next fault from full strength


def run(args: argparse.Namespace, work: str) -> dict:
    rng = random.Random(args.seed)
    # the reference: the same script under plain torchrun, no fault (as tests/conftest.reference_run makes it)
    ref = Job.torchrun(os.path.join(work, "ref"), nproc=RANKS, steps=args.steps, step_sleep=0.0,
                       script_args=["--ddp", "torch"]).start()
    # the job may not end before the last fault settled: from step CRAWL_FROM on it crawls (rank 0 sleeps CRAWL_S in
    # each step, under --hang-timeout: a hold would look like a hang) until the harness is done with it
    done = os.path.join(work, "faults-done")
    crawl = {"rank": 0, "step": CRAWL_FROM, "where": "step", "action": "sleep", "seconds": CRAWL_S, "unless": done}
    c = Cluster(work, steps=args.steps, step_sleep=args.step_sleep, hang_timeout=args.hang_timeout,
                netns=args.netns, small_disk=args.small_disk, lease_ttl=args.lease_ttl, extra_faults=(crawl,))
    faults: list[Fault] = []
    try:
        c.start_job()
        try:
            inject_all(c, args, rng, faults)
        except KeyboardInterrupt:      # Ctrl-C: no more faults; the job runs to its end and is judged as usual
            print(f"interrupted after {len(faults)} faults: letting the job finish", flush=True)
        open(done, "w").close()
        codes = {a.name: a.job.wait(args.timeout) for a in c.agents if not a.killed}
        ref_code = ref.wait(args.timeout)
        redone_by_fault(c, faults)
        lost, unlogged = never_done(c, args.steps)
        exact = same_run(Job(argv=[], out=c.train), ref) if ref_code == 0 else f"NO (torchrun reference exit {ref_code})"
        time.sleep(1.0)
        result = {"faults": [f.__dict__ for f in faults], "codes": codes, "steps_lost": lost,
                  "steps_unlogged": unlogged,
                  "bit_identical": exact, "orphans": [c.describe(pid) for pid in c.our_processes()], "leftovers": leftovers(c),
                  "double_held": double_held(c), "netns": c.lab is not None, "small_disk": c.disk is not None,
                  "steps": args.steps}
    finally:
        open(done, "w").close()
        c.close()
        ref.kill()
    return result


def report(args: argparse.Namespace, result: dict) -> None:
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for f in result["faults"]:
        by_kind[f["kind"]].append(f)
    print()
    print(f"| #  | {'fault':<16} | step | outcome        | steps lost | recovery s | why / note |")
    print(f"| -- | {'-' * 16} | ---- | -------------- | ---------- | ---------- | ---------- |")
    for f in result["faults"]:
        rec = f"{f['recovery_s']:.1f}" if f["recovery_s"] is not None else "-"
        print(f"| {f['n']:>2} | {f['kind']:<16} | {f['step']:>4} | {f['outcome']:<14} | {f['steps_redone']:>10} | "
              f"{rec:>10} | {(f['why'] + '; ' if f['why'] else '') + f['note'][:70]} |")
    print()
    print(f"| {'fault':<16} | injected | survived live | fell back (why) | steps redone | notes |")
    print(f"| {'-' * 16} | -------- | ------------- | --------------- | ------------ | ----- |")
    for kind in args.kinds:
        fs = by_kind.get(kind, [])
        live = sum(f["outcome"] == "survived live" for f in fs)
        why = Counter(f["why"] or f["outcome"] for f in fs if f["outcome"] != "survived live")
        fell = "; ".join(f"{n}x {w}" for w, n in why.most_common()) or "-"
        notes = Counter(_short_note(f["note"]) for f in fs if _short_note(f["note"]))
        print(f"| {kind:<16} | {len(fs):>8} | {live:>13} | {fell} | {sum(f['steps_redone'] for f in fs):>12} | "
              f"{'; '.join(f'{n}x {w}' for w, n in notes.most_common()) or '-'} |")
    total = len(result["faults"])
    live = sum(f["outcome"] == "survived live" for f in result["faults"])
    print()
    print(f"faults: {total}, survived live: {live}, fell back or other: {total - live}")
    print(f"exit codes: {result['codes']}")
    print(f"steps lost: {result['steps_lost']}, steps redone after fallbacks (rank 0): "
          f"{sum(f['steps_redone'] for f in result['faults'])}")
    print(f"steps done but never logged by a rank killed in them: {result['steps_unlogged']}")
    print(f"bit-identical to the torchrun reference: {result['bit_identical']}")
    print(f"orphans: {len(result['orphans'])} {result['orphans'][:5]}, "
          f"leftover files: {len(result['leftovers'])} {result['leftovers'][:3]}")
    print(f"ranks held by two live processes at once: {result['double_held']}")
    print(json.dumps({k: v for k, v in result.items() if k != "faults"} |
                     {"outcomes": Counter(f"{f['kind']}: {f['outcome']}" for f in result["faults"])}))


def _short_note(note: str) -> str:
    for marker in ("ACCEPTED", "CONNECTED", "refused", "nothing connected", "could not connect", "no joiner",
                   "no live process", "no partitionable", "no small disk", "no member", "no leaver"):
        if marker in note:
            return marker
    return ""


def main() -> None:
    import logging

    logging.getLogger("tpassrun").setLevel(logging.ERROR)   # the harness's own reads of malformed values
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--steps", type=int, default=0, help=f"training steps (default: {CRAWL_FROM} + 40 per fault)")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle", type=float, default=120.0, help="seconds to wait for full strength after a fault")
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--lease-ttl", type=int, default=10)
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on the job's end after the last fault")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {', '.join(KINDS)}")
    p.add_argument("--no-netns", dest="netns", action="store_false", help="all agents on this host's network")
    p.add_argument("--no-small-disk", dest="small_disk", action="store_false", help="logs on the work dir's disk")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args()
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown fault kinds {unknown}; known: {', '.join(KINDS)}")
    args.steps = args.steps or CRAWL_FROM + 40 * args.faults
    args.netns = args.netns and NetLab.available()
    args.small_disk = args.small_disk and SmallDisk.available()
    work = tempfile.mkdtemp(prefix="tpassrun-chaos-")
    print(f"chaos: {args.faults} faults of {len(args.kinds)} kinds, {args.steps} steps, seed {args.seed}, "
          f"netns {'on' if args.netns else 'off'}, small log disk {'on' if args.small_disk else 'off'}, work {work}",
          flush=True)
    try:
        result = run(args, work)
        report(args, result)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
