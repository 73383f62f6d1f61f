"""Two jobs lose a node at the same instant, one pool node: exactly one claim wins (issue 24's acceptance).

Each trial: a fresh pool with one idle pool node (its real loop, its host effect recorded: see
``tests/test_pool_races.py``), two jobs' leaders, each on its own etcd lease, asking the pool at the same instant
(:meth:`tpassrun.pool.job.JobPool.need`, what a coordinator does on ``ClaimFromPool``), then looking again on their
next tick. Counted: trials with exactly one winner holding the only claim, the pool node serving that job only, the
other job told the pool is claimed; and how often both leaders sent a claim (the compare-and-set decided).

    python bench/pool_race.py [--trials 20] [--endpoint HOST:PORT]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

from common import EtcdServer  # puts tests/ on the path
from test_pool_races import claim_race_trial


async def trials(endpoint: str, n: int) -> None:
    outcomes, took = [], []
    for t in range(n):
        t0 = time.perf_counter()
        outcomes.append(await claim_race_trial(endpoint, f"race-{int(time.time())}-{t}"))
        took.append(time.perf_counter() - t0)
    good = sum(o.one_winner for o in outcomes)
    wins = collections.Counter(o.claimed_by[0] if len(o.claimed_by) == 1 else "+".join(o.claimed_by) or "none"
                               for o in outcomes)
    double = sum(len(o.claims) > 1 or len(o.served) > 1 for o in outcomes)
    print(f"{n} trials, two jobs losing a node at the same instant, one pool node, one etcd ({endpoint}):")
    print(f"  exactly one claim won in {good}/{n} ({', '.join(f'{k} {v}' for k, v in sorted(wins.items()))}); "
          f"two jobs on one pool node: {double}/{n}")
    print(f"  both leaders sent a claim (the compare-and-set decided) in {sum(o.both_tried for o in outcomes)}/{n}; "
          f"the loser was told the pool is claimed in {sum('claimed' in o.loser_said for o in outcomes)}/{n}")
    print(f"  a trial (pool, node, two leaders, claims, pool node acting) took {sorted(took)[len(took) // 2]:.2f} s "
          f"median")
    if good != n or double:
        raise SystemExit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--endpoint", default=None, help="an etcd to use (default: start one)")
    args = p.parse_args()
    if args.endpoint:
        asyncio.run(trials(args.endpoint, args.trials))
        return
    server = EtcdServer().start()
    try:
        asyncio.run(trials(server.endpoint, args.trials))
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
