"""Floating spares, the economics: dedicated spare nodes per job vs one shared pool, and the claim's latency.

Part 1, a simulation driven by published failure figures. A job of G GPUs fails (needs a replacement node) as a
Poisson process with a mean time to failure MTTF(G): Meta's figures for its research clusters (Kokolis et al.,
"Revisiting Reliability in Large-Scale Machine Learning Research Clusters", 2024: a 1,024-GPU job fails about every
7.9 h, a 16,384-GPU job about every 1.8 h). A replacement node is held until the failed node is repaired and the
ranks move home (``--migrate-back``), a repair time drawn from an exponential of mean R hours. A failure that finds
no free spare costs a restart (the failure does not wait: lost, Erlang's loss model). For N jobs:

- dedicated: each job keeps ``d`` spare nodes of its own (8 GPUs each) idle;
- pool of k: the N jobs share k spare nodes.

Printed per configuration: spare GPUs held, their idle GPU-hours per day, and P(no spare) = the share of failures
that found none (simulated over ``--years``, with Erlang B's closed form beside it as a check).

Part 2, measured: one real etcd, 10 pool nodes and 100 jobs (every agent in this process, each with its own lease),
all 100 jobs' leaders asking for a node at the same instant: the claim is the compare-and-set of
:mod:`tpassrun.pool.etcd`. Printed: the winners' claim latency (from the need to the claim won), how long the losers
took to learn the pool is empty, that exactly 10 won and no node is held twice; and the latency of one claim
without contention.

    python bench/spare_pool.py [--jobs 8] [--gpus 1024] [--repair 4] [--years 20] [--no-etcd]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass

GPUS_PER_NODE = 8
MTTF_H = {1024: 7.9, 16384: 1.8}        # published: job-level mean time to failure by job size


def erlang_b(servers: int, load: float) -> float:
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    return b


@dataclass(frozen=True)
class Outcome:
    failures: int
    no_spare: int
    idle_node_hours: float
    hours: float

    @property
    def p_no_spare(self) -> float:
        return self.no_spare / self.failures if self.failures else 0.0


def simulate(jobs: int, mttf_h: float, repair_h: float, hours: float, *, pool: int | None, dedicated: int,
             seed: int) -> Outcome:
    """Event-driven: each failure takes a free spare (own or pool) for an exponential repair time, or finds none."""
    rng = random.Random(seed)
    busy_until: list[list[float]] = ([[0.0] * dedicated for _ in range(jobs)] if pool is None else [[0.0] * pool])
    busy_hours = 0.0
    failures = no_spare = 0
    events = sorted((t, j) for j in range(jobs) for t in _arrivals(rng, mttf_h, hours))
    for t, j in events:
        failures += 1
        spares = busy_until[0] if pool is not None else busy_until[j]
        free = next((i for i, until in enumerate(spares) if until <= t), None)
        if free is None:
            no_spare += 1
            continue
        hold = rng.expovariate(1.0 / repair_h)
        spares[free] = t + hold
        busy_hours += min(hold, hours - t)
    total = (pool if pool is not None else dedicated * jobs) * hours
    return Outcome(failures, no_spare, total - busy_hours, hours)


def _arrivals(rng: random.Random, mttf_h: float, hours: float) -> list[float]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mttf_h)
        if t >= hours:
            return out
        out.append(t)


def economics(jobs: int, gpus: int, repair_h: float, years: float, seed: int) -> None:
    mttf = MTTF_H.get(gpus) or _interpolated(gpus)
    hours = years * 365 * 24
    load = jobs * repair_h / mttf          # offered load: pool nodes busy on average
    print(f"\n{jobs} jobs of {gpus} GPUs ({gpus // GPUS_PER_NODE} nodes each, {jobs * gpus} GPUs), job MTTF {mttf} h "
          f"(published), repair {repair_h} h mean: on average {load:.2f} spare node(s) busy; {years:g} years simulated")
    print(f"{'spares':<22} {'spare GPUs':>10} {'% of cluster':>12} {'idle GPU-h/day':>15} {'P(no spare)':>12} "
          f"{'Erlang B':>9}")
    top = next(k for k in range(1, 10 * jobs + 100) if erlang_b(k, load) < 1e-3)   # pools up to P < 0.1 %
    rows = [("dedicated, 1 per job", None, 1)] + [(f"pool of {k}", k, 0) for k in range(1, max(top, jobs) + 1)]
    for label, pool, dedicated in rows:
        out = simulate(jobs, mttf, repair_h, hours, pool=pool, dedicated=dedicated, seed=seed)
        nodes = pool if pool is not None else dedicated * jobs
        check = erlang_b(1, repair_h / mttf) if pool is None else erlang_b(pool, load)
        print(f"{label:<22} {nodes * GPUS_PER_NODE:>10} {100 * nodes * GPUS_PER_NODE / (jobs * gpus):>11.2f}% "
              f"{out.idle_node_hours * GPUS_PER_NODE / (hours / 24):>15.1f} {out.p_no_spare:>12.4f} {check:>9.4f}")


def _interpolated(gpus: int) -> float:
    """MTTF for another size: log-log through the two published points (MTTF ~ 1 / GPUs^a)."""
    a = math.log(7.9 / 1.8) / math.log(16384 / 1024)
    return round(7.9 * (1024 / gpus) ** a, 2)


# ---------------------------------------------------------------------------------------------- part 2: etcd
async def claim_latency(endpoint: str, jobs: int, nodes: int) -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from tpassrun.pool import Claim, ClaimNode, JobNeed, JobSpec, Pool, PoolKeys, plan_job, pool_prefix
    from tpassrun.records.provenance import RunKey
    from tpassrun.rendezvous import EtcdConfig, EtcdStore

    cfg = EtcdConfig.from_endpoint(endpoint, {"read_timeout": "30"})
    key, name = RunKey.from_text("bench-pool-key-0123456789"), f"bench-{int(time.time())}"
    keys = PoolKeys(pool_prefix("/tpassrun/v1", name))
    spec = JobSpec(run_id="j", endpoint=endpoint, rdzv_conf="", nproc_per_node=8, entrypoint="train.py", args=())
    from tpassrun.pool import PoolNode

    async with EtcdStore(cfg) as admin:
        pool = Pool(admin, keys, key, name)
        await pool.create()
        node_stores = [EtcdStore(cfg, lease_ttl=30) for _ in range(nodes)]
        job_stores = [EtcdStore(cfg, lease_ttl=30) for _ in range(jobs)]
        await asyncio.gather(*(s.open() for s in node_stores + job_stores))
        try:
            for i, s in enumerate(node_stores):
                await Pool(s, keys, key, name).register(PoolNode(f"pool{i}", "h", 8, time.time() + i * 1e-3))

            async def leader(j: int, start: asyncio.Event) -> tuple[str, float, int]:
                p = Pool(job_stores[j], keys, key, name)
                await start.wait()
                t0, tries = time.perf_counter(), 0
                while True:
                    tries += 1
                    view, revs, _ = await p.read()
                    act = plan_job(JobNeed(job=f"job{j}", priority=0, nproc=8), view, 0.0)
                    if not isinstance(act, ClaimNode):
                        return "empty", time.perf_counter() - t0, tries
                    claim = Claim(act.node_id, f"job{j}", f"leader{j}", 0, time.time(), "bench", spec)
                    if await p.claim(claim, revs[act.node_id]):
                        return act.node_id, time.perf_counter() - t0, tries

            start = asyncio.Event()
            tasks = [asyncio.create_task(leader(j, start)) for j in range(jobs)]
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            start.set()
            results = await asyncio.gather(*tasks)
            wall = time.perf_counter() - t0
            won = [r for r in results if r[0] != "empty"]
            view, _, _ = await pool.read()
            held = sorted(c.node_id for c in view.claims.values())
            assert len(won) == nodes and len({r[0] for r in won}) == nodes and held == sorted(r[0] for r in won)
            lat = sorted(r[1] * 1e3 for r in won)
            empty = sorted(r[1] * 1e3 for r in results if r[0] == "empty")
            print(f"\n{jobs} jobs claim at the same instant from {nodes} pool nodes, one etcd ({endpoint}), all agents "
                  f"in one process: {len(won)} won, {len(set(r[0] for r in won))} distinct nodes, "
                  f"{len(view.claims)} claims in etcd (never two on one node); all settled in {wall * 1e3:.0f} ms")
            print(f"  winners' claim latency: p50 {statistics.median(lat):.1f} ms, max {lat[-1]:.1f} ms, "
                  f"tries p50 {statistics.median(r[2] for r in won):.0f} max {max(r[2] for r in won)}")
            print(f"  losers learned the pool is empty in: p50 {statistics.median(empty):.1f} ms, "
                  f"max {empty[-1]:.1f} ms")
            await asyncio.gather(*(s.close() for s in job_stores))   # revoking the claimers' leases frees the claims
            one = EtcdStore(cfg, lease_ttl=30)
            await one.open()
            job_stores = [one]
            p, alone = Pool(one, keys, key, name), []
            for _i in range(30):
                view, revs, _ = await p.read()
                t = time.perf_counter()
                view, revs, _ = await p.read()
                act = plan_job(JobNeed(job="solo", priority=0, nproc=8), view, 0.0)
                assert isinstance(act, ClaimNode)
                assert await p.claim(Claim(act.node_id, "solo", "l", 0, time.time(), "bench", spec), revs[act.node_id])
                alone.append((time.perf_counter() - t) * 1e3)
                await p.release(act.node_id, "solo", "bench")
            alone.sort()
            print(f"  one claim without contention (read + plan + compare-and-set + history note), 30 times: "
                  f"p50 {statistics.median(alone):.1f} ms, max {alone[-1]:.1f} ms")
        finally:
            await asyncio.gather(*(s.close() for s in node_stores + job_stores), return_exceptions=True)
            await pool.delete()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--gpus", type=int, default=1024)
    p.add_argument("--repair", type=float, default=4.0, help="mean repair hours")
    p.add_argument("--years", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--claim-jobs", type=int, default=100)
    p.add_argument("--claim-nodes", type=int, default=10)
    p.add_argument("--endpoint", default=None, help="an etcd to use (default: start one)")
    p.add_argument("--no-etcd", action="store_true", help="the simulation only")
    args = p.parse_args()
    economics(args.jobs, args.gpus, args.repair, args.years, args.seed)
    if args.no_etcd:
        return
    if args.endpoint:
        asyncio.run(claim_latency(args.endpoint, args.claim_jobs, args.claim_nodes))
        return
    from common import Workdir  # noqa: F401  (puts tests/ on the path)
    from conftest import EtcdServer

    server = EtcdServer().start()
    try:
        asyncio.run(claim_latency(server.endpoint, args.claim_jobs, args.claim_nodes))
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
