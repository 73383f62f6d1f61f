"""Several ranks lost at once, each drawing from the spare pool (issue 24).

Pure: two ranks dead at once with no spare of the job's own ask the pool for both (one need each); once a pool
node's spares are up (still starting is enough) one plan replaces both on it; a pool that gave up means the
fallback, as without a pool. On a real etcd, one process, the job's leader and two pool nodes (their real loops,
the spare node's start recorded): two dead ranks of a 2-slot job take one pool node (the second is covered by the
first claim's free slot); three take two; a lost node and a dead rank take two."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from test_pool_races import POOL_KEY, SPEC, _HostlessPoolNode
from tpassrun.plan.actions import ClaimFromPool, CreatePlan, PutFallback, Seen
from tpassrun.plan.swap import ClusterView, SlotView
from tpassrun.plan.triage import dead_rank_need, triage
from tpassrun.pool import Pool, PoolKeys, PoolNode, pool_prefix
from tpassrun.pool.job import JobPool
from tpassrun.records import Failure, SwapKind
from tpassrun.rendezvous import EtcdConfig, EtcdStore
from tpassrun.settings import LaunchConfig

DEAD = (Failure(node="a", slot=1, rank=1, code=-9, step=9, light=True, generation=3),
        Failure(node="b", slot=1, rank=3, code=-9, step=9, light=True, generation=3))
LIVE = (SlotView("a", 0, 0, "running", True, 9), SlotView("a", 1, 1, "dead", True, 9),
        SlotView("b", 0, 2, "running", True, 9), SlotView("b", 1, 3, "dead", True, 9))


def seen(*slots: SlotView, spare_nodes: tuple[str, ...] = (), **kw) -> Seen:  # type: ignore[no-untyped-def]
    v = ClusterView(generation=3, members=("a", "b"), spare_nodes=spare_nodes, slots=(*LIVE, *slots))
    return Seen(now=1000.0, epoch=3, plans=(), reports=(), failures=(("a-1", DEAD[0]), ("b-1", DEAD[1])), taints=(),
                view=v, **kw)


def test_two_ranks_dead_at_once_without_own_spares_ask_the_pool_then_one_plan_takes_both_on_its_node():
    needs = (dead_rank_need(DEAD[0]), dead_rank_need(DEAD[1]))
    assert any(isinstance(a, PutFallback) for a in triage(seen()).actions)               # no pool: as before
    acts = triage(seen(pool=True)).actions
    assert [type(a) for a in acts] == [ClaimFromPool] and acts[0].lost == needs, acts
    one_left = triage(seen(SlotView("p", 0, None, "spare", False), spare_nodes=("p",), pool=True)).actions
    assert [type(a) for a in one_left] == [ClaimFromPool]                                 # not enough yet
    pooled = (SlotView("p", 0, None, "spare", False), SlotView("p", 1, None, "spare", False))
    plans = [a for a in triage(seen(*pooled, spare_nodes=("p",), pool=True)).actions if isinstance(a, CreatePlan)]
    assert plans and plans[0].plan.kind is SwapKind.NODE and {m.joiner.node for m in plans[0].plan.moves} == {"p"}
    assert sorted(m.rank for m in plans[0].plan.moves) == [1, 3]
    gave_up = triage(seen(pool=True, pool_gave_up=frozenset(needs[:1]))).actions
    assert any(isinstance(a, PutFallback) for a in gave_up), gave_up


def _into(said: list[str]):  # type: ignore[no-untyped-def]
    return lambda ev, **_f: said.append(ev)


@pytest.mark.timeout(120)
def test_losses_seen_at_once_share_a_pool_node_while_it_has_slots_and_claim_another_when_not(etcd_server, run_id):
    async def main() -> list[list[str]]:
        cfg = EtcdConfig.from_endpoint(etcd_server.endpoint, {"read_timeout": "5"})
        out: list[list[str]] = []
        for t, lost in enumerate((("rank 1 (x)", "rank 3 (x)"), ("rank 1 (x)", "rank 3 (x)", "rank 5 (x)"),
                                  ("node-b", "rank 1 (x)"))):
            name = f"{run_id}-{t}"
            keys = PoolKeys(pool_prefix("/tpassrun/v1", name))
            async with EtcdStore(cfg) as admin:
                pool = Pool(admin, keys, POOL_KEY, name)
                assert await pool.create()
                stores = [EtcdStore(cfg, lease_ttl=10) for _ in range(3)]
                await asyncio.gather(*(s.open() for s in stores))
                stop = asyncio.Event()
                nodes = [_HostlessPoolNode(Pool(st, keys, POOL_KEY, name), PoolNode(n, "h", 2, time.time()),
                                           say=lambda _s: None) for n, st in zip(("p1", "p2"), stores)]
                runners = [asyncio.create_task(n.run(stop)) for n in nodes]
                job = JobPool(pool=Pool(stores[2], keys, POOL_KEY, name), spec=SPEC, node_id="leader",
                              cfg=LaunchConfig(rdzv_id="jobA", spare_pool=name, training_script="t.py",
                                               nproc_per_node=2, pool_wait=60.0))
                said: list[str] = []
                try:
                    while len((await pool.read())[0].nodes) < 2:
                        await asyncio.sleep(0.02)
                    await job.need(lost, 0, _into(said))
                    await job.need(lost, 0, _into(said))       # the next tick: nothing new
                    view = (await pool.read())[0]
                    assert {c.job for c in view.claims.values()} <= {"jobA"}
                    out.append(sorted(view.claims))
                    assert sorted(set(job.held.values())) == sorted(view.claims) and set(job.held) == set(lost)
                    assert said.count("pool_claimed") == len(view.claims), said
                finally:
                    stop.set()
                    for r in runners:
                        with contextlib.suppress(Exception):
                            await r
                    await asyncio.gather(*(s.close() for s in stores), return_exceptions=True)
                    await pool.delete()
        return out

    claimed = asyncio.run(main())        # (which of two idle nodes is the older is the two loops' race)
    assert [len(c) for c in claimed] == [1, 2, 2], claimed
