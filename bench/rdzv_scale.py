"""Rendezvous scale bench: N simulated agents (EtcdRendezvous objects in one process) against one real etcd.

    python bench/rdzv_scale.py                 # 256 and 1024 agents, 32 agents per etcd connection
    python bench/rdzv_scale.py --sizes 64 --agents-per-connection 1

Prints, per size: time for every agent to open its handle (connect/lease/watches/campaign), time to form
the generation (first join call -> last join returned, min_nodes = max_nodes = N so no last call), and
etcd requests per join (counted in EtcdStore, watch creations included; keepalives are counted apart, and the
long TTL keeps them out of the measurement). By default 32 agents share one gRPC connection (one process cannot
sensibly hold 1,024 channels, and aetcd creates the watches of one client one at a time); each agent still has
its own lease, watches and keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid

from tpassrun.rendezvous import EmbeddedEtcd, EtcdConfig, EtcdConnection, EtcdRendezvous, NodeInfo, RendezvousSettings


async def one_size(endpoint: str, n: int, per_connection: int) -> dict[str, float]:
    cfg = EtcdConfig.from_endpoint(endpoint, {"read_timeout": "30"})
    settings = RendezvousSettings(run_id=f"bench-{n}-{uuid.uuid4().hex[:6]}", min_nodes=n, max_nodes=n,
                                  lease_ttl=600, join_timeout=120)  # one keepalive a minute (ttl/10)
    connections: list[EtcdConnection | None] = []
    if per_connection > 1:
        connections = [EtcdConnection(cfg) for _ in range((n + per_connection - 1) // per_connection)]
        await asyncio.gather(*(c.open() for c in connections))
    rdzvs = [EtcdRendezvous(cfg, settings, NodeInfo(f"node{i:05d}", "127.0.0.1", 8),
                            connection=connections[i // per_connection] if connections else None)
             for i in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        t0 = time.perf_counter()
        await asyncio.gather(*(r.__aenter__() for r in rdzvs))
        stack.push_async_callback(lambda: asyncio.gather(*(r.__aexit__(None, None, None) for r in rdzvs)))
        t_open = time.perf_counter() - t0
        before = sum(r.store.requests for r in rdzvs)
        t1 = time.perf_counter()
        gens = await asyncio.gather(*(r.join() for r in rdzvs))
        t_form = time.perf_counter() - t1
        after = sum(r.store.requests for r in rdzvs)
        leader = next(r for r in rdzvs if r.is_leader)
        assert all(g == gens[0] for g in gens) and len(gens[0].members) == n and gens[0].world_size == 8 * n
        total = after  # everything since the handles were created: open + join
        t2 = time.perf_counter()
        await leader.close("bench done")  # a closed run is not annotated while everyone leaves
    t_close = time.perf_counter() - t2
    for c in connections:
        await c.close()
    followers = [r.store.requests for r in rdzvs if r is not leader]
    return {"n": n, "open_s": t_open, "form_s": t_form, "close_s": t_close,
            "req_per_agent": total / n, "req_join_only": (after - before) / n,
            "req_follower_max": max(followers) if followers else 0, "req_leader": leader.store.requests}


async def main(sizes: list[int], per_connection: int) -> None:
    async with EmbeddedEtcd() as etcd:
        rows = [await one_size(etcd.endpoint, n, per_connection) for n in sizes]
    print(f"etcd requests and timings ({per_connection} agent(s) per etcd connection)")
    print(f"{'agents':>7} {'open all':>9} {'form gen':>9} {'close all':>9} {'req/agent':>10} "
          f"{'req/join':>9} {'follower max':>13} {'leader':>7}")
    for r in rows:
        print(f"{r['n']:>7} {r['open_s']:>8.2f}s {r['form_s']:>8.2f}s {r['close_s']:>8.2f}s "
              f"{r['req_per_agent']:>10.2f} {r['req_join_only']:>9.2f} {r['req_follower_max']:>13} "
              f"{r['req_leader']:>7}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--agents-per-connection", type=int, default=32,
                        help="agents sharing one gRPC connection (1 = one each, as real agents have)")
    parser.add_argument("--uvloop", action="store_true", help="run under uvloop (the agent's loop)")
    args = parser.parse_args()
    coro = main(args.sizes, args.agents_per_connection)
    if args.uvloop:
        import uvloop
        uvloop.run(coro)
    else:
        asyncio.run(coro)
