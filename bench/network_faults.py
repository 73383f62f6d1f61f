"""Network faults against a running job: link flaps, degraded links, and background noise.

    .venv/bin/python bench/network_faults.py flaps --flaps 10                    # (a)
    .venv/bin/python bench/network_faults.py degrade --kinds loss,rate --trials 5    # (b) at a random step 1-300
    .venv/bin/python bench/network_faults.py degrade --kinds both --trials 2         # (b) loss both ways
    .venv/bin/python bench/network_faults.py noise --seconds 600 --burners 2 --flaps 8   # (c) CPU load and flaps

Root only. One chaos cluster (``bench/chaos_cluster.py``: 2 members of 2 ranks and a ``--spare-node``, one
external etcd, every agent a host of its own in a network namespace). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from chaos_cluster import RANKS, Cluster  # (puts tests/ on sys.path)
from faults import Job, NetLab, assert_bit_exact
from netrelay import DelayRelay, lossy, lossy_both_ways, rate_limit, unlimit, unlossy, unlossy_both_ways

SWAP_EVENTS = ("swap_decided",)
RESTART_EVENTS = ("restart", "fallback", "membership_change", "fenced", "lease_lost", "node_lost", "hang_detected",
                  "worker_died", "unmanaged_death")


def link(c: Cluster, host: int, state: str) -> None:
    """Take host ``host``'s own end of its link down or up, inside its namespace (what a flapping NIC does)."""
    ns, _outer, inner, _addr = c.lab.hosts[host]
    subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", inner, state], check=True, timeout=30)


def count(events: list[dict], names: tuple[str, ...], since: float = 0.0) -> dict[str, int]:
    out: dict[str, int] = {}
    for e in events:
        if e["event"] in names and e.get("time", 0) >= since:
            out[e["event"]] = out.get(e["event"], 0) + 1
    return out


def reference(work: str, steps: int, step_sleep: float, keep: str | None = None) -> Job:
    """torchrun's run of the same job. ``keep``: a directory that holds one from an earlier call with the same
    steps and step sleep (reused; written there when it does not): a sweep split into short runs runs it once."""
    if keep is not None:
        stamp = os.path.join(keep, "reference.json")
        if os.path.exists(stamp):
            with open(stamp) as fh:
                was = json.load(fh)
            if was == {"steps": steps, "step_sleep": step_sleep}:
                return Job(argv=[], out=os.path.join(keep, "ref"))
        os.makedirs(keep, exist_ok=True)
        work = keep
    ref = Job.torchrun(os.path.join(work, "ref"), nproc=RANKS, steps=steps, step_sleep=step_sleep).start()
    assert ref.wait(900) == 0, ref.log()[-3000:]
    if keep is not None:
        with open(os.path.join(keep, "reference.json"), "w") as fh:
            json.dump({"steps": steps, "step_sleep": step_sleep}, fh)
    return ref


def flaps(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="tpassrun-netflap-")
    steps = args.steps
    c = Cluster(work, steps=steps, step_sleep=args.step_sleep, hang_timeout=args.hang_timeout, netns=True,
                small_disk=False, lease_ttl=args.lease_ttl)
    rows = []
    try:
        c.start_job()
        t_start = time.time()
        for i in range(args.flaps):
            # each flap its own: the job trains again after the last one (TCP's backoff outlasts a flap by
            # seconds; flaps back to back are one long outage, past the lease), then a random instant
            resume = c.step(0) + 5
            deadline = time.time() + 120
            while c.step(0) < resume and time.time() < deadline:
                time.sleep(0.1)
            time.sleep(rng.uniform(1.0, 4.0))
            victim = c.agents[rng.randrange(2)]
            down = rng.uniform(1.0, 8.0)
            step = c.step(0)
            t0 = time.time()
            link(c, victim.host, "down")
            time.sleep(down)
            link(c, victim.host, "up")
            rows.append({"flap": i + 1, "node": victim.name, "down_s": round(down, 2), "step": step, "t0": t0})
            print(f"flap {i + 1}: {victim.name} down {down:.1f} s at step {step}", flush=True)
        codes = [a.job.wait(1800) for a in c.agents]
        evs = c.events()
        ref = reference(work, steps, args.step_sleep)
        identical = True
        try:
            assert_bit_exact(Job(argv=[], out=c.train), ref, RANKS)
        except AssertionError as exc:
            identical = False
            print(f"not bit-identical: {exc}")
        rows0 = c.losses(0)
        lost = len(rows0) - len({r["step"] for r in rows0})
        result = {"flaps": rows, "exit_codes": codes, "swaps": len({e.get("swap_id") for e in evs
                                                                     if e["event"] == "swap_decided"}),
                  "bad_events": count(evs, RESTART_EVENTS, t_start), "steps_lost": lost, "bit_identical": identical,
                  "ridden_out": [e["line"] for e in evs if e["event"] == "link_ridden_out"],
                  # one console line per flap (the event's; no second log line)
                  "console_flap_lines": sum(ln.count("lost for") for a in c.agents for ln in a.job.log().splitlines()),
                  "degraded": [e["line"] for e in evs if e["event"] == "link_degraded"]}
        print(json.dumps({k: v for k, v in result.items() if k != "flaps"}, default=str))
        return result
    finally:
        c.close()


def ms_per_step(c: Cluster, t0: float, t1: float) -> float | None:
    """Wall time per step of rank 0 in [t0, t1] (wall clock): every stall counted, as the job feels it."""
    rows = [r for r in c.losses(0) if t0 <= r["t"] <= t1]
    if len(rows) < 2 or rows[-1]["step"] <= rows[0]["step"]:
        return None
    return round(1000 * (rows[-1]["t"] - rows[0]["t"]) / (rows[-1]["step"] - rows[0]["step"]), 1)


def step_at(c: Cluster, when: float) -> int:
    return max((r["step"] for r in c.losses(0) if r["t"] <= when), default=-1)


def wait_for(c: Cluster, pred, timeout: float) -> dict | None:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        hit = next((e for e in c.events() if pred(e)), None)
        if hit is not None:
            return hit
        if not c.running():
            return None
        time.sleep(0.5)
    return None


def apply(kind: str, c: Cluster, host: int, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Degrade host ``host``'s link; returns what undoes it (every rule, qdisc and table by name)."""
    if kind == "loss":          # docs/network.md's recipe: iptables INPUT -i <link> in the node's namespace
        lossy(c.lab, host, args.loss)
        return lambda: unlossy(c.lab, host, args.loss)
    if kind == "both":          # frames to and from its veth dropped on the bridge (nftables, bridge family)
        lossy_both_ways(c.lab, host, args.loss)
        return lambda: unlossy_both_ways(c.lab, host)
    if kind == "delay":
        return DelayRelay(c.lab, host, args.delay_ms).close
    if kind == "rate":
        rate_limit(c.lab, host, args.rate)
        return lambda: unlimit(c.lab, host)
    raise SystemExit(f"unknown fault kind {kind!r}")


def degrade_one(kind: str, trial: int, rng: random.Random, ref: Job | None, args: argparse.Namespace) -> dict:
    """One trial: the job from its start, one member's link degraded at a random step in [1, --at-most], the job
    run to its end and compared with torchrun's (``ref``)."""
    work = tempfile.mkdtemp(prefix=f"tpassrun-netdeg-{kind}-")
    c = Cluster(work, steps=args.steps, step_sleep=args.step_sleep, hang_timeout=60, netns=True, small_disk=False)
    at = rng.randint(1, args.at_most)
    row: dict = {"kind": kind, "trial": trial, "at_step": at}
    undo = None
    try:
        for spare_node in (False, False, True):
            c.start_agent(spare_node=spare_node)
        victim = c.agents[1]
        deadline = time.time() + 600
        while c.step(0) < at and time.time() < deadline and c.running():
            time.sleep(0.05)
        t0 = time.time()
        undo = apply(kind, c, victim.host, args)
        row["applied_at_step"] = c.step(0)
        victim_id = next(e["node"] for e in victim.events() if e["event"] == "agent_started")
        found = wait_for(c, lambda e: e["event"] in ("link_degraded", "link_ambiguous") and e["time"] >= t0,
                         args.timeout)
        if found is None:
            row.update(detected=False, ms_per_step_during=ms_per_step(c, t0, time.time()))
        else:
            td = found["time"]
            row.update(detected=found["event"] == "link_degraded", node_ok=found["node"] == victim_id,
                       line=found["line"], seconds_to_detection=round(td - t0, 1),
                       steps_to_detection=step_at(c, td) - step_at(c, t0), ms_per_step_during=ms_per_step(c, t0, td))
            done = None
            deadline = time.time() + args.timeout
            while found["event"] == "link_degraded" and time.time() < deadline and c.running():
                resumed = {e.get("swap_id"): e["time"] for e in c.events() if e["event"] == "swap_resumed"
                           and e["time"] >= td}
                if len(resumed) >= 2:
                    done = max(resumed.values())
                    break
                time.sleep(0.5)
            if done is not None:
                row["seconds_to_migration_done"] = round(done - td, 1)
            if kind == "both" and found["event"] == "link_ambiguous":
                time.sleep(20)      # said again every few seconds while it lasts
                row["ambiguous_lines"] = [e["line"] for e in c.events() if e["event"] == "link_ambiguous"][:6]
        if undo is not None:       # the rest of the run on a healthy network: the job ends, torch.equal is checked
            undo()
            undo = None
        codes = [a.job.wait(1800) for a in c.agents]
        evs = c.events()
        row["exit_codes"] = codes
        row["swaps"] = len({e.get("swap_id") for e in evs if e["event"] == "swap_decided"})
        row["swaps_onto_victim"] = sum(e["event"] == "swap_decided" and f"to spare {victim_id}/" in (e.get("reason") or "")
                                       for e in evs)
        row["false_alarms"] = sorted({e["node"] for e in evs if e["event"] == "link_degraded" and e["node"] != victim_id})
        row["restarts"] = count(evs, ("restart", "fallback", "membership_change"), t0)
        if ref is not None:
            try:
                assert_bit_exact(Job(argv=[], out=c.train), ref, RANKS)
                row["bit_identical"] = True
            except AssertionError as exc:
                row["bit_identical"] = False
                row["not_identical"] = str(exc)[:300]
        return row
    finally:
        if undo is not None:
            undo()
        c.close()


def degrade(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    ref = reference(tempfile.mkdtemp(prefix="tpassrun-netdeg-ref-"), args.steps, args.step_sleep,
                    keep=args.reference) if args.compare else None
    rows = []
    for kind in args.kinds.split(","):
        for trial in range(args.trials):
            row = degrade_one(kind, trial + 1, rng, ref, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {}
    for kind in args.kinds.split(","):
        mine = [r for r in rows if r["kind"] == kind]
        secs = sorted(r["seconds_to_detection"] for r in mine if r.get("detected"))
        summary[kind] = {"trials": len(mine), "flagged_right_node": sum(bool(r.get("detected") and r.get("node_ok"))
                                                                         for r in mine),
                         "migrated": sum("seconds_to_migration_done" in r for r in mine),
                         "bit_identical": sum(r.get("bit_identical") is True for r in mine),
                         "false_alarms": sum(len(r.get("false_alarms", [])) for r in mine),
                         "detection_s": secs}
    return {"degrade": rows, "summary": summary}


def noise(args: argparse.Namespace) -> dict:
    """No degraded link: background CPU load from other processes (``--burners``, beside whatever else the machine
    runs), a slow step now and then and, with ``--flaps``, a member's link down for 1-6 s every 40-80 s. Nothing
    may be flagged (degraded, suspect or ambiguous); the machine's load average is recorded every 30 s."""
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="tpassrun-netnoise-")
    c = Cluster(work, steps=100000, step_sleep=args.step_sleep, hang_timeout=60, netns=True, small_disk=False)
    burners = []
    loads: list[tuple[float, float, float]] = []
    flapped: list[dict] = []
    try:
        c.start_job()
        t0 = time.time()
        burn = "import time\nwhile True:\n    t = time.time()\n    while time.time() - t < 0.5: pass\n    time.sleep(0.2)"
        burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(args.burners)]
        next_flap = t0 + rng.uniform(40, 80) if args.flaps else float("inf")
        next_load = t0
        while time.time() - t0 < args.seconds and c.running():
            now = time.time()
            if now >= next_load:
                loads.append(os.getloadavg())
                next_load += 30
            if now >= next_flap and len(flapped) < args.flaps:
                victim = c.agents[rng.randrange(2)]
                down = rng.uniform(1.0, 6.0)
                link(c, victim.host, "down")
                time.sleep(down)
                link(c, victim.host, "up")
                flapped.append({"node": victim.name, "down_s": round(down, 1), "at_s": round(now - t0)})
                print(f"flap: {victim.name} down {down:.1f} s at {now - t0:.0f} s", flush=True)
                next_flap = time.time() + rng.uniform(40, 80)
            time.sleep(0.5)
        evs = c.events()
        one_min = [ld[0] for ld in loads]
        return {"noise": {"seconds": round(time.time() - t0), "burners": args.burners, "running": c.running(),
                          "steps": step_at(c, time.time()) - step_at(c, t0), "ms_per_step": ms_per_step(c, t0, time.time()),
                          "load_1min": {"min": min(one_min, default=None), "median": statistics.median(one_min)
                                        if one_min else None, "max": max(one_min, default=None)},
                          "flaps": flapped, "ridden_out": sum(e["event"] == "link_ridden_out" for e in evs),
                          "degraded": sum(e["event"] == "link_degraded" for e in evs),
                          "suspect": sum(e["event"] == "link_suspect" for e in evs),
                          "ambiguous": sum(e["event"] == "link_ambiguous" for e in evs),
                          "suspect_lines": [e.get("reason") for e in evs if e["event"] == "link_suspect"][:5],
                          "swaps": len({e.get("swap_id") for e in evs if e["event"] == "swap_decided"}),
                          "bad_events": count(evs, RESTART_EVENTS, t0)}}
    finally:
        for b in burners:
            b.kill()
            b.wait()
        c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    f = sub.add_parser("flaps")
    f.add_argument("--flaps", type=int, default=10)
    f.add_argument("--seed", type=int, default=1)
    f.add_argument("--steps", type=int, default=400)
    f.add_argument("--step-sleep", type=float, default=0.05)
    f.add_argument("--lease-ttl", type=int, default=10)
    f.add_argument("--hang-timeout", type=float, default=30)
    d = sub.add_parser("degrade")
    d.add_argument("--kinds", default="loss,rate", help="loss (into the node), both (loss both ways), rate, delay")
    d.add_argument("--trials", type=int, default=5, help="per kind, each at a random step in [1, --at-most]")
    d.add_argument("--at-most", type=int, default=300)
    d.add_argument("--steps", type=int, default=700)
    d.add_argument("--seed", type=int, default=1)
    d.add_argument("--loss", type=float, default=0.05)
    d.add_argument("--delay-ms", type=float, default=50)
    d.add_argument("--rate", default="20mbit")
    d.add_argument("--step-sleep", type=float, default=0.05)
    d.add_argument("--timeout", type=float, default=180)
    d.add_argument("--no-compare", dest="compare", action="store_false", help="skip torchrun's reference run")
    d.add_argument("--reference", metavar="DIR", help="keep torchrun's reference run in DIR and reuse it from there "
                   "(a sweep split into several short runs)")
    n = sub.add_parser("noise")
    n.add_argument("--seconds", type=float, default=180)
    n.add_argument("--burners", type=int, default=2, help="background processes, each busy 0.5 s of every 0.7 s")
    n.add_argument("--step-sleep", type=float, default=0.05)
    n.add_argument("--flaps", type=int, default=0, help="this many link flaps of 1-6 s, one every 40-80 s")
    n.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if not NetLab.available():
        raise SystemExit("needs root and iproute2 (network namespaces)")
    out = {"flaps": flaps, "degrade": degrade, "noise": noise}[args.what](args)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
