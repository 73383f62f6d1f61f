"""How long a node cut off from the network takes to reach etcd again once its link heals.

    python bench/partition_heal.py [--trials 3] [--seconds 12,15,19]

One chaos cluster (``bench/chaos_cluster.py``: 2 members of 2 ranks and a ``--spare-node``, one external etcd,
every agent a host of its own in a network namespace; root only) per trial. A member's link is taken down (a black
hole: nothing is refused) for longer than the 10 s lease, then brought back; the figure is the heal -> that agent's
``etcd_connection_restored`` event. A node that finds etcd late rejoins late (a spare node fewer meanwhile).

gRPC shares one subchannel per target between channels, with its connection attempt; before each client got its
own (``rendezvous/etcd_link.py``), every reconnect probe waited on the connect that began inside the partition,
whose SYN is retransmitted 1, 3, 7, 15 s apart: 6-13 s. Figures only; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from chaos_cluster import Cluster
from faults import NetLab


def trial(seconds: float) -> float | None:
    work = tempfile.mkdtemp(prefix="tpassrun-heal-")
    c = Cluster(work, steps=100000, step_sleep=0.05, hang_timeout=5, netns=True, small_disk=False)
    try:
        c.start_job()
        victim = c.agents[1]
        cut = time.time()
        c.lab.partition(victim.host)
        time.sleep(seconds)
        c.lab.heal(victim.host)
        healed = time.time()
        while time.time() < healed + 60:
            back = [e["time"] for e in victim.events() if e["event"] == "etcd_connection_restored" and e["time"] > cut]
            if back:
                return back[0] - healed
            time.sleep(0.05)
        return None
    finally:
        c.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seconds", default="12,15,19", help="partition lengths, taken in turn")
    args = p.parse_args()
    if not NetLab.available():
        raise SystemExit("needs root and iproute2 (network namespaces)")
    lengths = [float(x) for x in args.seconds.split(",")]
    results = []
    for i in range(args.trials):
        seconds = lengths[i % len(lengths)]
        back = trial(seconds)
        results.append({"partition_s": seconds, "back_after_heal_s": back})
        print(f"trial {i + 1}: cut off {seconds:.0f} s, etcd back "
              f"{'never (60 s)' if back is None else f'{back:.2f} s'} after the heal", flush=True)
    found = [r["back_after_heal_s"] for r in results if r["back_after_heal_s"] is not None]
    if found:
        print(f"median {statistics.median(found):.2f} s, max {max(found):.2f} s after the heal")
    print(json.dumps({"trials": results}))


if __name__ == "__main__":
    main()
