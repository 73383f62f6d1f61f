"""Issue 24, item 3, pure: pre-emption of lower-priority work on pool nodes.

The job's side (:func:`plan_job`): a strictly lower-priority *member* claim of another job is pre-empted, never a
spare claim (that node replaces a failed one of its job), never its own, never an equal priority. The node's side
(:func:`plan_node`): a member claim starts the job's member node; a valid request stops it (``Evict``) and the node
is idle for the requester once it exited; a request of an equal or lower priority, of the same job, against a
spare, or without the pool key's seal is refused. The low job's side: members at start are idle nodes only
(:func:`plan_members`), the console lines of both jobs, ``tpassctl pool status``, and the flag's bad input."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tpassrun.launch.config import ConfigError, parse_args
from tpassrun.ops.console import Describer
from tpassrun.pool import plan as P
from tpassrun.pool.ctl import gauges, status_doc, status_lines
from tpassrun.pool.node import spare_node_argv
from tpassrun.pool.plan import (
    JobNeed,
    NodeState,
    Phase,
    PoolView,
    Preempt,
    WaitForPool,
    plan_job,
    plan_members,
    plan_node,
    preempt_refusal,
)
from tpassrun.records.pool import MEMBER, Claim, HistoryEntry, JobSpec, PoolNode, PreemptRequest

SPEC = JobSpec(run_id="low", endpoint="127.0.0.1:2379", rdzv_conf="lease_ttl=3", nproc_per_node=2,
               entrypoint="/w/train.py", args=("--steps", "5"), nnodes="1:2", max_restarts=3)


def node(n: str, since: float = 0.0, nproc: int = 2, state: str = "idle") -> PoolNode:
    return PoolNode(node_id=n, host="h", nproc=nproc, since=since, state=state)


def member(n: str, job: str = "low", prio: int = 1, since: float = 0.0) -> Claim:
    return Claim(node_id=n, job=job, claimer="lowleader", priority=prio, since=since, reason="lower-priority work",
                 spec=SPEC, kind=MEMBER)


def request(n: str = "p1", job: str = "high", prio: int = 5) -> PreemptRequest:
    return PreemptRequest(node_id=n, job=job, requester="highleader", priority=prio, since=1.0, reason="node b lost")


def test_plan_job_preempts_only_a_strictly_lower_priority_member_of_another_job():
    view = PoolView(nodes={"p1": node("p1", state="serving")}, claims={"p1": member("p1")})
    act = plan_job(JobNeed(job="high", priority=5, nproc=2, wait_limit=60), view, 0.0)
    assert isinstance(act, Preempt) and act.node_id == "p1" and act.victim == "low" and act.victim_priority == 1
    assert "pre-empting pool node p1 from job low (priority 1 < 5)" in act.reason
    for need in (JobNeed(job="high", priority=1, nproc=2, wait_limit=60),     # equal priority
                 JobNeed(job="low", priority=9, nproc=2, wait_limit=60),      # its own job
                 JobNeed(job="high", priority=5, nproc=4, wait_limit=60)):    # does not fit
        assert isinstance(plan_job(need, view, 0.0), WaitForPool), need
    spare = PoolView(nodes=view.nodes, claims={"p1": replace(member("p1"), kind="spare")})
    assert isinstance(plan_job(JobNeed(job="high", priority=5, nproc=2, wait_limit=60), spare, 0.0), WaitForPool)
    gone = PoolView(nodes=view.nodes, claims={"p1": replace(member("p1"), released="its ranks went home")})
    assert isinstance(plan_job(JobNeed(job="high", priority=5, nproc=2, wait_limit=60), gone, 0.0), WaitForPool)
    # an idle node first; of several victims the lowest priority, then the newest claim
    two = PoolView(nodes={"p1": node("p1"), "p2": node("p2"), "p3": node("p3")},
                   claims={"p1": member("p1", prio=3), "p2": member("p2", prio=1, since=1.0),
                           "p3": member("p3", "low2", prio=1, since=2.0)})
    act = plan_job(JobNeed(job="high", priority=5, nproc=2, wait_limit=60), two, 0.0)
    assert isinstance(act, Preempt) and act.node_id == "p3"
    free = PoolView(nodes={**two.nodes, "p4": node("p4")}, claims=two.claims)
    assert isinstance(plan_job(JobNeed(job="high", priority=5, nproc=2), free, 0.0), P.ClaimNode)


def test_plan_node_starts_a_member_and_a_valid_request_stops_it_then_idle_for_the_requester():
    s, act = plan_node(NodeState("p1", 2), P.ClaimSeen(member("p1")), 1.0)
    assert isinstance(act, P.StartSpare) and "as a member" in act.reason and s.kind == MEMBER and s.priority == 1
    s, act = plan_node(s, P.ChildJoined("low-agent"), 2.0)
    assert s.joined and "member node" in act.reason
    s, act = plan_node(s, P.PreemptSeen(request()), 3.0)
    assert isinstance(act, P.Evict) and s.phase is Phase.STOPPING and s.taken_by == "high"
    assert act.victim == "low" and "pre-empted by high (priority 1 < 5)" in act.reason
    s2, again = plan_node(s, P.PreemptSeen(request()), 3.5)            # seen twice (a re-read): nothing more
    assert s2 == s and isinstance(again, P.Keep)
    s, act = plan_node(s, P.ClaimGone("the node dropped it"), 4.0)
    assert isinstance(act, P.Keep) and s.phase is Phase.STOPPING
    s, act = plan_node(s, P.ChildExited(-15), 5.0)
    assert isinstance(act, P.BecomeIdle) and act.preempted_by == "high" and s == NodeState("p1", 2)


@pytest.mark.parametrize("req,kind,why", [
    (request(prio=1), MEMBER, "not above"),                 # equal
    (request(prio=0), MEMBER, "not above"),                 # lower
    (request(job="low"), MEMBER, "its own"),                # the same job
    (request(), "spare", "as a spare node"),                # a job's spare node is never taken
])
def test_plan_node_refuses_a_request_of_equal_or_lower_priority_of_its_own_job_or_against_a_spare(req, kind, why):
    s, _ = plan_node(NodeState("p1", 2), P.ClaimSeen(replace(member("p1"), kind=kind)), 1.0)
    s2, act = plan_node(s, P.PreemptSeen(req), 2.0)
    assert isinstance(act, P.Refuse) and why in act.reason and s2 == s
    assert why in preempt_refusal("low", kind, 1, req)


def test_plan_node_refuses_a_request_without_the_pool_keys_seal_and_ignores_one_while_idle():
    s, _ = plan_node(NodeState("p1", 2), P.ClaimSeen(member("p1")), 1.0)
    s2, act = plan_node(s, P.PreemptSeen(None, "bad MAC"), 2.0)
    assert isinstance(act, P.Refuse) and "without the pool key's seal (bad MAC)" in act.reason and s2 == s
    idle = NodeState("p1", 2)
    assert plan_node(idle, P.PreemptSeen(request()), 2.0) == (idle, P.Keep(
        "high asks for this node: nothing to pre-empt (idle)"))


def test_the_low_jobs_members_are_idle_pool_nodes_only_and_the_member_line_has_no_spare_node_flag():
    view = PoolView(nodes={"p1": node("p1", 3.0), "p2": node("p2", 1.0), "p3": node("p3", nproc=1),
                           "p4": node("p4", 0.0)}, claims={"p4": member("p4", "other", 0)})
    assert plan_members(view, 1, 2)[0] == ["p2"]
    assert plan_members(view, 5, 2)[0] == ["p2", "p1"]          # never a claimed node: lower-priority work waits
    picks, why = plan_members(PoolView(nodes={"p4": node("p4")}, claims=view.claims), 1, 2)
    assert picks == [] and "no idle pool node" in why
    argv = spare_node_argv(SPEC, "/tmp/ev.jsonl", "python", member=True)
    assert "--spare-node" not in argv and argv[argv.index("--nnodes") + 1] == "1:2"
    assert "--spare-node" in spare_node_argv(SPEC, "/tmp/ev.jsonl", "python")


def test_both_consoles_say_it_in_one_line_and_status_shows_the_member():
    d = Describer()
    high = d.describe({"event": "pool_preempting", "time": 1.0, "mono": 1.0, "node": "a-1-ab", "lost_node": "b-2-cd",
                       "pool": "gpu", "pool_node": "p1", "victim": "low", "victim_priority": 1, "priority": 5,
                       "reason": "x"})
    assert high is not None and "pre-empting pool node p1 from job low (priority 1 < 5)" in high and "\n" not in high
    why = "pool node p1 taken back by job high (priority 5): shrinking to 1 nodes"
    low = d.describe({"event": "pool_taken_back", "time": 1.0, "mono": 1.0, "node": "l-1-ab", "reason": why})
    assert low is not None and why in low
    view = PoolView(nodes={"p1": node("p1", state="serving")}, claims={"p1": member("p1")},
                    preempts={"p1": request()})
    doc = status_doc("gpu", view, [], 10.0)
    line = status_lines(doc)[1]
    assert "running lower-priority job low as a member (priority 1)" in line and "being pre-empted by high" in line
    assert doc["nodes"][0]["kind"] == MEMBER and doc["nodes"][0]["preempted_by"] == "high"


def test_the_gauges_count_lent_nodes_and_preemptions():
    view = PoolView(nodes={"p1": node("p1", state="serving"), "p2": node("p2", state="serving"), "p3": node("p3")},
                    claims={"p1": member("p1"), "p2": replace(member("p2"), kind="spare", job="high")})
    history = [HistoryEntry(1.0, "p1", "claimed", "low"), HistoryEntry(2.0, "p1", "preempted", "low"),
               HistoryEntry(3.0, "p1", "claimed", "high"), HistoryEntry(4.0, "p1", "preempted", "low2")]
    g = gauges(view, history)
    assert g["tpassrun_pool_member_nodes"] == 1 and g["tpassrun_pool_claims"] == 2
    assert g["tpassrun_pool_idle_nodes"] == 1
    assert g["tpassrun_pool_preemptions_total"] == 2 and g["tpassrun_pool_claims_total"] == 2


@pytest.mark.parametrize("args", [
    ["--nnodes", "1:2", "--pool-members", "1"],                               # no --spare-pool
    ["--nnodes", "2", "--spare-pool", "gpu", "--pool-members", "1"],          # not elastic
    ["--nnodes", "1:2", "--spare-pool", "gpu", "--pool-members", "2"],        # N >= MAX
])
def test_pool_members_bad_input_is_one_line(args):
    with pytest.raises(ConfigError) as err:
        parse_args([*args, "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379", "--rdzv-id", "r",
                    "train.py"])
    assert "--pool-members" in str(err.value) and "\n" not in str(err.value)
