"""Re-formation cost of the workers' store: the authenticated door vs a plain TCPStore (issue 27 item 2).

    python bench/store.py [--ranks 4] [--rounds 10]

``--ranks`` gloo processes form one world after another, each under a new key prefix on the same store (what a
swap's re-formation does: ``tpassrun.worker.world.join_world``'s arrival count, ``init_process_group`` on a
``PrefixStore``, one barrier), through, in alternating rounds:

  * ``auth``: tpassrun.store's authenticated door (``AuthStore``: HMAC handshake, every message tagged);
  * ``plain-door``: torch's TCPStore client through the same server's plain door (relayed to loopback);
  * ``tcpstore``: torch's own TCPStore server, as the generation's store was before.

Per formation: from the first rank's start to the last rank's barrier done (the world is formed when its slowest
rank is). Prints every round, the medians, auth / tcpstore, and a last line of JSON. Figures, not a test.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from common import print_json

KEY = b"bench-store-key-" * 2
KINDS = ("auth", "plain-door", "tcpstore")


def _rank(rank: int, ranks: int, ports: dict[str, int], rounds: int, go: Any, out: Any) -> None:
    import torch.distributed as dist

    from tpassrun.store.client import AuthStore

    times = []
    for r in range(rounds):
        kind = KINDS[r % len(KINDS)]
        go.wait()
        t0 = time.time()
        if kind == "auth":
            base = AuthStore("127.0.0.1", ports[kind], KEY, timedelta(seconds=60))
        else:
            base = dist.TCPStore("127.0.0.1", ports[kind], is_master=False, timeout=timedelta(seconds=60))
        store = dist.PrefixStore(f"world-{r}", base)
        store.add("tpassrun_arrived", 1)
        while int(store.add("tpassrun_arrived", 0)) < ranks:
            time.sleep(0.002)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks)
        dist.barrier()
        times.append((kind, t0, time.time()))
        dist.destroy_process_group()
        del store, base
    out.put((rank, times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9, help="formations in all, the three kinds alternating")
    args = parser.parse_args()

    import torch.distributed as dist

    from tpassrun.store import serve

    server = serve("127.0.0.1", 0, KEY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        raw_port = s.getsockname()[1]
    raw = dist.TCPStore("127.0.0.1", raw_port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1))
    ports = {"auth": server.port, "plain-door": server.port, "tcpstore": raw_port}
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.ranks + 1), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, ports, args.rounds, barrier, out))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    for _ in range(args.rounds):
        barrier.wait()
        time.sleep(0.5)          # the round runs; the next starts when every rank is back at the barrier
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    by_kind: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(args.rounds):
        rows = [results[rank][r] for rank in range(args.ranks)]
        kind = rows[0][0]
        ms = (max(t1 for _k, _t0, t1 in rows) - min(t0 for _k, t0, _t1 in rows)) * 1000
        by_kind[kind].append(ms)
        print(f"round {r}: {kind:10s} formed in {ms:8.1f} ms")
    med = {k: statistics.median(v) for k, v in by_kind.items() if v}
    for k, v in med.items():
        print(f"median {k:10s} {v:8.1f} ms  ({len(by_kind[k])} formations of {args.ranks} ranks)")
    ratio = med["auth"] / med["tcpstore"] if med.get("tcpstore") else None
    print(f"auth / tcpstore: {ratio:.2f}" if ratio else "auth / tcpstore: n/a")
    print_json({"bench": "store", "ranks": args.ranks, "median_ms": med, "auth_over_tcpstore": ratio,
                "rounds": {k: v for k, v in by_kind.items()}})
    server.close()
    del raw


if __name__ == "__main__":
    main()
