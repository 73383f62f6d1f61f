"""A job on a highly available etcd (three members on loopback) goes on untouched when etcd loses a member, its leader,
and then its quorum for a few seconds (issue 30): the comma-separated endpoint list reaches the etcd connection,
which fails over to another member. Real etcd processes, real agents, real gloo workers."""

from __future__ import annotations

import asyncio
import time

import pytest
from faults import Job, assert_bit_exact, faults_env, hold_at, run_through

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STEPS = 30
DOWN_AT, BACK_BY = 6, 24    # the leader dies with the job held at DOWN_AT; the job waits at BACK_BY for the end of it
QUORUM_LOST_S = 3.0
LEASE_S = 20


def _leader_first(cluster) -> str:
    """The cluster's endpoints with its leader first: the member every agent connects to is the one that dies."""
    deadline = time.monotonic() + 30
    while (leader := cluster.leader()) is None:
        assert time.monotonic() < deadline, "the cluster elected no leader"
        time.sleep(0.1)
    members = cluster.endpoints.split(",")
    return ",".join([members[leader], *(m for i, m in enumerate(members) if i != leader)])


def _new_leader(cluster, old: int) -> int:
    deadline = time.monotonic() + 60
    while (leader := cluster.leader()) is None or leader == old:
        assert time.monotonic() < deadline, "no new leader after the old one died"
        time.sleep(0.1)
    return leader


def test_a_store_fails_over_when_its_member_dies(etcd_cluster, run_id):
    """The connection's member SIGKILLed: requests go on through another member, the lease is never in doubt."""
    from tpassrun.rendezvous import EtcdConfig, EtcdStore

    endpoints = _leader_first(etcd_cluster)
    first = etcd_cluster.endpoints.split(",").index(endpoints.split(",")[0])

    async def main() -> None:
        cfg = EtcdConfig.from_endpoint(endpoints, {"read_timeout": "5"})
        async with EtcdStore(cfg, lease_ttl=10) as store:
            key = f"/tpassrun-test/{run_id}/k"
            await store.put_json(key, {"n": 0}, lease=True)
            epoch = store.connection.epoch
            etcd_cluster.kill(first)
            for n in range(1, 4):
                await store.put_json(key, {"n": n}, lease=True)
            assert (await store.get_json(key))[0] == {"n": 3}
            assert store.connection.epoch > epoch and store.lease_sure() and store.lease_epoch == 0
            await store.delete(key)

    asyncio.run(main())


def test_a_member_list_with_a_dead_first_member_connects(etcd_cluster, run_id):
    from tpassrun.rendezvous import EtcdConfig, EtcdStore

    etcd_cluster.kill(0)

    async def main() -> None:
        async with EtcdStore(EtcdConfig.from_endpoint(etcd_cluster.endpoints, {"read_timeout": "20"})) as store:
            assert (await store.get_json(f"/tpassrun-test/{run_id}/none")) == (None, 0)

    asyncio.run(main())


def test_a_member_list_with_a_hung_first_member_connects(etcd_cluster, run_id):
    """The first member stopped (SIGSTOP: it accepts connections and answers nothing): the first connection moves
    on to another member instead of spending all of ``read_timeout`` on it."""
    from tpassrun.rendezvous import EtcdConfig, EtcdStore

    etcd_cluster.pause(0)

    async def main() -> None:
        async with EtcdStore(EtcdConfig.from_endpoint(etcd_cluster.endpoints, {"read_timeout": "20"})) as store:
            assert (await store.get_json(f"/tpassrun-test/{run_id}/none")) == (None, 0)

    asyncio.run(main())


def test_the_leader_killed_then_quorum_lost_for_seconds_leaves_the_job_untouched(tmp_path, etcd_cluster, run_id,
                                                                                 reference_run):
    """Two agents (2 ranks each) on the three members, the leader first in their list. Mid-run the leader is
    SIGKILLed; once a new one is elected and both agents have moved to another member, the new leader is stopped
    (SIGSTOP) for 3 s: with one member of three left, etcd has no quorum and answers nothing; then it resumes. The
    lease outlasts that: no swap, no fencing, no restart, every rank keeps its process, and the result is
    bit-identical to plain torchrun.

    The lease is 20 s, not the default 10: etcd itself is unavailable for longer than the stop, as long as it takes
    to elect a leader again after it (a 3 s stop kept this machine's cluster without a leader for 7.8 s, which
    fenced a node under a 10 s lease, whose budget is ~8 s from its last acknowledged refresh)."""
    endpoints = _leader_first(etcd_cluster)
    leader = etcd_cluster.endpoints.split(",").index(endpoints.split(",")[0])
    train = str(tmp_path / "train")
    down, back = hold_at(tmp_path, DOWN_AT, name="down"), hold_at(tmp_path, BACK_BY, name="back")
    env = faults_env(down.fault, back.fault)
    jobs = [Job.agent(str(tmp_path / n), train, endpoint=endpoints, run_id=run_id, steps=STEPS, step_sleep=0.1,
                      ttl=LEASE_S, env=env).start() for n in ("a", "b")]
    pids: list[int] = []

    def leader_killed_then_quorum_lost() -> None:
        pids.extend(p for j in jobs for p in j.worker_pids())
        etcd_cluster.kill(leader)
        down.release()
        second = _new_leader(etcd_cluster, leader)
        for j in jobs:   # each agent talked to the dead leader: it is on another member before the second fault
            j.wait_event("etcd_connection_restored")
        etcd_cluster.pause(second)
        time.sleep(QUORUM_LOST_S)
        etcd_cluster.resume(second)
        assert etcd_cluster.wait_healthy(etcd_cluster.live(), 60), "the cluster did not recover its quorum"

    run_through(jobs, down, back, leader_killed_then_quorum_lost)
    logs = Job(argv=[], out=train)
    for r in range(4):
        rows = logs.losses(r)
        assert [x["step"] for x in rows] == list(range(STEPS)), f"rank {r}: steps lost or repeated"
        assert len({x["pid"] for x in rows}) == 1, f"rank {r} changed process: nothing should have restarted"
    assert sorted(pids) == sorted({x["pid"] for r in range(4) for x in logs.losses(r)})
    for j in jobs:
        names = [e["event"] for e in j.events()]
        quiet = ("fenced", "restart", "fallback", "lease_lost", "lease_regranted", "etcd_connection_overdue",
                 "node_lost", "worker_died", "membership_change", "hang_detected")
        assert not [n for n in names if n in quiet or n.startswith("swap")], names
    assert_bit_exact(logs, reference_run(4, STEPS), 4)
