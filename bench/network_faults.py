"""Network faults against a running job: link flaps, degraded links, and background noise.

    .venv/bin/python bench/network_faults.py flaps --flaps 10            # (a)
    .venv/bin/python bench/network_faults.py degrade --kinds loss,delay,rate   # (b)
    .venv/bin/python bench/network_faults.py noise --seconds 600         # (c)

Root only. One chaos cluster (``bench/chaos_cluster.py``: 2 members of 2 ranks and a ``--spare-node``, one
external etcd, every agent a host of its own in a network namespace). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from chaos_cluster import RANKS, Cluster
from faults import Job, NetLab, assert_bit_exact

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


def reference(work: str, steps: int, step_sleep: float) -> Job:
    ref = Job.torchrun(os.path.join(work, "ref"), nproc=RANKS, steps=steps, step_sleep=step_sleep).start()
    assert ref.wait(900) == 0, ref.log()[-3000:]
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
                  "ridden_out": [e for e in evs if e["event"] == "link_ridden_out"]}
        print(json.dumps({k: v for k, v in result.items() if k != "flaps"}, default=str))
        return result
    finally:
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
    args = p.parse_args()
    if not NetLab.available():
        raise SystemExit("needs root and iproute2 (network namespaces)")
    out = {"flaps": flaps}[args.what](args)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
