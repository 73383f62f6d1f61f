"""Several ranks lost at once, each drawing from the spare pool (issue 24).

Pure: two ranks dead at once with no spare of the job's own ask the pool for both (one need each); once a pool
node's spares are up (still starting is enough) one plan replaces both on it; a pool that gave up means the
fallback, as without a pool. On a real etcd, one process, the job's leader and two pool nodes (their real loops,
the spare node's start recorded): two dead ranks of a 2-slot job take one pool node (the second is covered by the
first claim's free slot); three take two; a lost node and a dead rank take two."""

from __future__ import annotations

import asyncio

import pytest
from test_pool_races import pool_with

from tpassrun.plan.actions import ClaimFromPool, CreatePlan, PutFallback, Seen
from tpassrun.plan.swap import ClusterView, SlotView
from tpassrun.plan.triage import dead_rank_need, triage
from tpassrun.records import Failure, SwapKind

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
        out: list[list[str]] = []
        for t, lost in enumerate((("rank 1 (x)", "rank 3 (x)"), ("rank 1 (x)", "rank 3 (x)", "rank 5 (x)"),
                                  ("node-b", "rank 1 (x)"))):
            async with pool_with(etcd_server.endpoint, f"{run_id}-{t}", ("p1", "p2"), ("jobA",)) as (pool, _n, jobs):
                job, said = jobs[0], []
                await job.need(lost, 0, _into(said))
                await job.need(lost, 0, _into(said))       # the next tick: nothing new
                view = (await pool.read())[0]
                assert {c.job for c in view.claims.values()} == {"jobA"}
                out.append(sorted(view.claims))
                assert sorted(set(job.held.values())) == sorted(view.claims) and set(job.held) == set(lost)
                assert said.count("pool_claimed") == len(view.claims), said
        return out

    assert asyncio.run(main()) == [["p1"], ["p1", "p2"], ["p1", "p2"]]      # p1, idle the longest, first
