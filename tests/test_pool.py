"""Spare pool, pure: the sealed records (a record of another key or altered is refused), the run key box, and the
two planners (a job's leader: own spares first, the pool second, a restart last; a pool node's idle loop)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tpassrun.pool import (
    Claim,
    ClaimNode,
    JobNeed,
    JobSpec,
    NodeState,
    Phase,
    PoolKeys,
    PoolNode,
    PoolView,
    Preempt,
    Restart,
    Source,
    UseOwn,
    WaitForPool,
    box,
    plan_job,
    plan_node,
    pool_prefix,
    unbox,
)
from tpassrun.pool import plan as P
from tpassrun.records import provenance
from tpassrun.records.fields import RecordError
from tpassrun.records.pool import load_sealed, pool_seal
from tpassrun.records.provenance import RunKey

KEY = RunKey.from_text("pool-key-for-tests-0123456789")
OTHER = RunKey.from_text("another-pool-key-0123456789")
SPEC = JobSpec(run_id="jobA", endpoint="127.0.0.1:2379", rdzv_conf="", nproc_per_node=2, entrypoint="train.py",
               args=("--steps", "5"))


def node(n: str, since: float = 0.0, nproc: int = 2) -> PoolNode:
    return PoolNode(node_id=n, host="h", nproc=nproc, since=since)


def claim(n: str, job: str, prio: int = 0, since: float = 0.0) -> Claim:
    return Claim(node_id=n, job=job, claimer="leader", priority=prio, since=since, reason="node lost", spec=SPEC)


def test_records_round_trip_sealed_and_refused_with_another_key_or_moved():
    keys = PoolKeys(pool_prefix("/tpassrun/v1", "p1"))
    assert keys.prefix == "/tpassrun/v1-pools/p1/"
    c = claim("n1", "jobA", 3)
    doc = pool_seal(KEY, keys.claim("n1"), c.to_json())
    assert Claim.from_json(load_sealed(KEY, keys.claim("n1"), doc)) == c
    with pytest.raises(RecordError):
        load_sealed(OTHER, keys.claim("n1"), doc)             # another pool's key
    with pytest.raises(RecordError):
        load_sealed(KEY, keys.claim("n2"), doc)               # moved to another node's key
    forged = dict(doc, job="jobB")
    with pytest.raises(RecordError):
        load_sealed(KEY, keys.claim("n1"), forged)
    with pytest.raises(RecordError):
        load_sealed(KEY, keys.claim("n1"), {k: v for k, v in doc.items() if k != "mac"})
    with pytest.raises(ValueError):
        pool_prefix("/tpassrun/v1", "a/b")


def test_the_run_key_box_opens_with_the_pool_key_only():
    boxed = box(KEY, "the-job-run-key-abcdefghijklmnopqrstuvwxyz-0123456789")
    assert "run-key" not in boxed and boxed.startswith("v2:")          # AES-256-GCM, versioned
    assert unbox(KEY, boxed) == "the-job-run-key-abcdefghijklmnopqrstuvwxyz-0123456789"
    assert box(KEY, "x" * 40) != box(KEY, "x" * 40)          # a fresh nonce each time
    with pytest.raises(RecordError, match="does not open with this pool key"):
        unbox(OTHER, boxed)
    raw = bytearray(bytes.fromhex(boxed[3:]))
    raw[20] ^= 1                                              # one bit of the ciphertext altered
    with pytest.raises(RecordError, match="does not open with this pool key"):
        unbox(KEY, "v2:" + raw.hex())
    with pytest.raises(RecordError, match="'v9' box"):
        unbox(KEY, "v9:" + boxed[3:])


def test_a_run_key_box_of_the_older_tpassrun_is_refused_in_one_line():
    """tests/golden/pool_box_v1.json: a box the keystream code wrote (before issue 42). Refused as what it is, with
    the key it was sealed with too: never decrypted into a wrong run key."""
    golden = json.loads((Path(__file__).resolve().parent / "golden" / "pool_box_v1.json").read_text())
    key = provenance.RunKey.from_text(golden["run_key"])
    with pytest.raises(RecordError) as refused:
        unbox(key, golden["box"])
    line = str(refused.value)
    assert "sealed by an older tpassrun (box v1)" in line and "\n" not in line
    with pytest.raises(RecordError, match="not a tpassrun box"):
        unbox(key, "not hex at all")


def test_job_own_spares_first_then_pool_then_restart():
    view = PoolView(nodes={"p1": node("p1", 5.0), "p2": node("p2", 1.0)})
    need = JobNeed(job="jobA", priority=1, nproc=2, own_ready=1)
    assert isinstance(plan_job(need, view, 10.0), UseOwn)
    starting = JobNeed(job="jobA", priority=1, nproc=2, own_starting=1)
    act = plan_job(starting, view, 10.0)
    assert isinstance(act, UseOwn) and "starting" in act.reason
    act = plan_job(JobNeed(job="jobA", priority=1, nproc=2), view, 10.0)
    assert isinstance(act, ClaimNode) and act.node_id == "p2" and act.source is Source.POOL   # idle longest
    full = PoolView(nodes=view.nodes, claims={"p1": claim("p1", "jobB", 5), "p2": claim("p2", "jobC", 5)})
    waiting = JobNeed(job="jobA", priority=1, nproc=2, since=0.0, wait_limit=30.0)
    act = plan_job(waiting, full, 10.0)
    assert isinstance(act, WaitForPool) and "all 2 pool node(s) are claimed" in act.reason
    act = plan_job(waiting, full, 31.0)
    assert isinstance(act, Restart) and act.source is Source.RESTART and "restart" in act.reason
    assert isinstance(plan_job(waiting, PoolView(exists=False), 0.0), Restart)


def test_job_too_small_pool_node_is_not_claimed_and_the_reason_says_so():
    view = PoolView(nodes={"p1": node("p1", nproc=1)})
    act = plan_job(JobNeed(job="jobA", priority=1, nproc=2), view, 0.0)
    assert isinstance(act, Restart) and "no pool node has 2 slots" in act.reason


def test_job_preempts_only_lower_priority_work():
    """(The member/spare distinction and the node's side: tests/test_pool_preempt.py.)"""
    view = PoolView(nodes={"p1": node("p1")}, claims={"p1": replace(claim("p1", "elastic", 0), kind="member")})
    act = plan_job(JobNeed(job="jobA", priority=5, nproc=2, wait_limit=10), view, 0.0)
    assert isinstance(act, Preempt) and act.victim == "elastic" and "pre-empting" in act.reason
    same = plan_job(JobNeed(job="jobA", priority=0, nproc=2, wait_limit=10), view, 0.0)
    assert isinstance(same, WaitForPool)
    off = plan_job(JobNeed(job="jobA", priority=5, nproc=2, wait_limit=10, preempt=False), view, 0.0)
    assert isinstance(off, WaitForPool)


def test_node_idle_loop_claim_join_release_and_claimer_death():
    s = NodeState("p1", 2)
    s, act = plan_node(s, P.ClaimSeen(claim("p1", "jobA")), 1.0)
    assert isinstance(act, P.StartSpare) and s.phase is Phase.SERVING and s.job == "jobA"
    s2, act = plan_node(s, P.ClaimSeen(claim("p1", "jobB")), 2.0)
    assert isinstance(act, P.Refuse) and s2 == s                      # never two jobs on one node
    # the claimer died before the spare node joined: stop it, back to idle when it exits
    s3, act = plan_node(s, P.ClaimGone("lease expired"), 3.0)
    assert isinstance(act, P.StopSpare) and s3.phase is Phase.STOPPING
    s4, act = plan_node(s3, P.ChildExited(-15), 4.0)
    assert isinstance(act, P.BecomeIdle) and s4.phase is Phase.IDLE and s4.job is None
    # joined: the job holds it; its end (the spare node exits) returns it
    s, _ = plan_node(NodeState("p1", 2), P.ClaimSeen(claim("p1", "jobA")), 1.0)
    s, act = plan_node(s, P.ChildJoined(), 2.0)
    assert s.joined and isinstance(act, P.Keep)
    s2, act = plan_node(s, P.ClaimGone("its claimer's lease expired"), 3.0)
    assert isinstance(act, P.Keep) and s2 == s                        # joined: the job holds it, not the claim
    s, act = plan_node(s, P.ChildExited(0), 9.0)
    assert isinstance(act, P.BecomeIdle) and s.phase is Phase.IDLE


def test_node_refuses_a_job_that_does_not_fit_or_has_no_spec():
    s = NodeState("p1", 1)
    _, act = plan_node(s, P.ClaimSeen(claim("p1", "jobA")), 0.0)
    assert isinstance(act, P.Refuse) and "needs 2 slots" in act.reason
    bare = Claim(node_id="p1", job="jobA", claimer="l", priority=0, since=0.0, reason="")
    _, act = plan_node(NodeState("p1", 4), P.ClaimSeen(bare), 0.0)
    assert isinstance(act, P.Refuse)


def test_triage_a_lost_node_without_own_spares_draws_from_the_pool_then_restarts_when_it_gave_up():
    from tpassrun.plan.swap import ClusterView, SlotView
    from tpassrun.plan.triage import ClaimFromPool, CreatePlan, RestartGroup, Seen, triage

    homes = ((0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1))
    a = (SlotView("a", 0, 0, "running", True, 7), SlotView("a", 1, 1, "running", True, 7))

    def seen(*slots, spare_nodes=(), **kw):
        v = ClusterView(generation=3, members=("a", "b"), spare_nodes=spare_nodes, slots=slots, lost=("b",),
                        homes=homes)
        return Seen(now=1000.0, epoch=3, plans=(), reports=(), failures=(), taints=(), view=v, **kw)

    # no pool: torchrun's restart, as before
    assert any(isinstance(x, RestartGroup) for x in triage(seen(*a)).actions)
    # a pool: ask it, nothing restarts
    acts = triage(seen(*a, pool=True)).actions
    assert [type(x) for x in acts] == [ClaimFromPool] and acts[0].lost == ("b",)
    # the pool node's spares are up (still starting is enough): the node plan takes them
    pooled = (SlotView("p", 0, None, "spare", False), SlotView("p", 1, None, "spare", False))
    acts = triage(seen(*a, *pooled, spare_nodes=("p",), pool=True)).actions
    plans = [x for x in acts if isinstance(x, CreatePlan)]
    assert plans and plans[0].plan.replaces == "p" and {m.joiner.node for m in plans[0].plan.moves} == {"p"}
    # the pool gave up (nothing within --pool-wait): the restart
    acts = triage(seen(*a, pool=True, pool_gave_up=frozenset({"b"}))).actions
    assert any(isinstance(x, RestartGroup) for x in acts)


def test_triage_a_dead_rank_without_own_spares_draws_from_the_pool_then_falls_back_when_it_gave_up():
    from tpassrun.plan.swap import ClusterView, SlotView
    from tpassrun.plan.triage import ClaimFromPool, CreatePlan, PutFallback, Seen, dead_rank_need, triage
    from tpassrun.records import Failure, SwapKind

    dead = Failure(node="a", slot=1, rank=1, code=-9, step=9, light=True, generation=3)
    live = (SlotView("a", 0, 0, "running", True, 9), SlotView("a", 1, 1, "dead", True, 9),
            SlotView("b", 0, 2, "running", True, 9), SlotView("b", 1, 3, "running", True, 9))

    def seen(*slots, spare_nodes=(), **kw):
        v = ClusterView(generation=3, members=("a", "b"), spare_nodes=spare_nodes, slots=(*live, *slots))
        return Seen(now=1000.0, epoch=3, plans=(), reports=(), failures=(("a-1", dead),), taints=(),
                    view=v, **kw)

    need = dead_rank_need(dead)
    assert need == "rank 1 (died at step 9, generation 3)"
    # no pool: the fallback (torchrun's restart), as before
    assert any(isinstance(x, PutFallback) for x in triage(seen()).actions)
    # a pool: ask it; the failure stays unhandled (nothing marked) until the pool node's spares are up
    acts = triage(seen(pool=True)).actions
    assert [type(x) for x in acts] == [ClaimFromPool] and acts[0].lost == (need,)
    # the pool node's spare node joined, its spares still starting: the unplanned swap takes one
    pooled = (SlotView("p", 0, None, "spare", False), SlotView("p", 1, None, "spare", False))
    plans = [x for x in triage(seen(*pooled, spare_nodes=("p",), pool=True)).actions if isinstance(x, CreatePlan)]
    assert plans and plans[0].plan.kind is SwapKind.UNPLANNED and plans[0].plan.joiner.node == "p"
    # the pool gave up (nothing within --pool-wait): the fallback
    acts = triage(seen(pool=True, pool_gave_up=frozenset({need}))).actions
    assert any(isinstance(x, PutFallback) for x in acts)


def test_the_console_says_own_spares_pool_or_restart_and_why():
    from tpassrun.ops.console import Describer

    d = Describer()

    def ev(name, **kw):
        return {"event": name, "time": 1.0, "mono": 1.0, "node": "host1-1-ab", **kw}

    line = d.describe(ev("pool_claimed", lost_node="host2-7-cd", pool="gpu", pool_node="host9-3-ef",
                         reason="no own spare ready; pool node host9-3-ef is idle (1 idle in the pool)"))
    assert "no own spare ready: claimed pool node" in line and "gpu" in line and "(1 idle in the pool)" in line
    line = d.describe(ev("pool_waiting", lost_node="host2-7-cd", pool="gpu", reason="all 1 pool node(s) are claimed"))
    assert "waiting for pool gpu" in line and "all 1 pool node(s) are claimed" in line
    line = d.describe(ev("pool_gave_up", lost_node="host2-7-cd", pool="gpu", reason="waited 60 s"))
    assert "torchrun's restart" in line and "waited 60 s" in line
    line = d.describe(ev("pool_claimed", lost_node="rank 5 (died at step 9, generation 0)", pool="gpu",
                         pool_node="host9-3-ef", reason="no own spare ready; pool node host9-3-ef is idle"))
    assert line.startswith("rank 5 (died at step 9, generation 0), no own spare ready: claimed pool node"), line
