"""What bench/chaos.py found, one real multi-process test each (every one ends in a recovery or in torchrun's
failure report). Two agents of one rank and one warm spare each against the session's etcd, so a fault on one
node is seen by the other over the network, as in the harness."""

from __future__ import annotations

import os
import sys

import pytest
from faults import EXAMPLE, Job, faults_env, stop_at

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STEPS = 40


def _agents(tmp_path, endpoint: str, run_id: str, *, env: dict[str, str], extra: list[str]) -> list[Job]:
    train = str(tmp_path / "train")
    jobs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        argv = [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "1", "--spares-per-node", "1",
                "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--rdzv-conf", "last_call_timeout=1", "--log-dir", os.path.join(out, "logs"), *extra,
                EXAMPLE, "--steps", str(STEPS), "--step-sleep", "0.05", "--out", train, "--quiet"]
        jobs.append(Job(argv=argv, out=out, env=env))
    return jobs


def test_a_rank_stopped_on_one_node_is_the_only_one_killed(tmp_path, etcd_server, run_id):
    """SIGSTOP of rank 0: its peer on the other node blocks in the allreduce and goes stale too. Only the
    stopped rank may be killed: the other node's watchdog killed its healthy rank as well, a second death inside
    the recovery that stalled it for the 120 s phase timeout and ended in a whole-group restart."""
    env = faults_env(stop_at(0, 8, str(tmp_path / "stop")))
    jobs = _agents(tmp_path, etcd_server.endpoint, run_id, env=env, extra=["--hang-timeout", "3"])
    try:
        for j in jobs:
            j.start()
        codes = [j.wait(240) for j in jobs]
    finally:
        for j in jobs:
            j.kill()
    assert codes == [0, 0], "\n".join(j.log()[-3000:] for j in jobs)
    events = [e for j in jobs for e in j.events()]
    hangs = [e for e in events if e["event"] == "hang_detected"]
    assert [(e["rank"], e["proc_state"]) for e in hangs] == [(0, "T")], hangs
    names = {e["event"] for e in events}
    assert "swap_resumed" in names and not names & {"fallback", "restart"}, sorted(names)
    train = Job(argv=[], out=str(tmp_path / "train"))
    assert len({x["pid"] for x in train.losses(1)}) == 1, "rank 1 was not stopped and must keep its process"
    for r in range(2):
        assert [x["step"] for x in train.losses(r)] == list(range(STEPS)), f"rank {r}: a step lost or repeated"


def test_a_slot_whose_worker_died_serves_again_as_a_spare(tmp_path):
    """One node, two ranks, one spare: rank 1 is SIGKILLed, then rank 0. The first death used the only spare and
    its slot stayed quarantined for the rest of the run, so the second fell back to a whole-group restart (a
    long job ran out of spares after as many deaths as it had spares). Now the dead slot comes back as a spare
    once the recovery is over, and both deaths are recovered live."""
    from faults import hold_at, kill_at

    # the second death waits until the first one's slot is back in the pool (however slow the machine)
    back = hold_at(tmp_path, 20)
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=None, run_id="", nproc=2, spares=1, steps=STEPS,
                       step_sleep=0.05, env=faults_env(kill_at(1, 6, str(tmp_path / "k1"), where="step"),
                                                       kill_at(0, 24, str(tmp_path / "k0"), where="step"),
                                                       back.fault)).start()
    try:
        back.release_after(job, "spare_returned", distinct=None)
        assert job.wait(240) == 0, job.log()[-3000:]
    finally:
        back.release()
        job.kill()
    names = [e["event"] for e in job.events()]
    assert names.count("swap_resumed") == 2 and "fallback" not in names and "restart" not in names, names
    returned = [e for e in job.events() if e["event"] == "spare_returned"]
    assert returned and "died" in returned[0]["reason"], returned
    for r in range(2):
        assert [x["step"] for x in job.losses(r)] == list(range(STEPS)), f"rank {r}: a step lost or repeated"


def test_a_joiner_stopped_as_it_receives_is_killed_and_the_next_spare_takes_the_rank(tmp_path, etcd_server, run_id):
    """The spare taking rank 1 in a planned swap SIGSTOPs itself as it starts to receive. The hang watchdog
    skipped every poll while a swap ran and looked only at running ranks, so the swap waited for the stopped
    joiner until its 120 s phase timeout. Now the stopped joiner is killed after --hang-timeout, whatever its
    phase, and the swap goes on with the next spare: live, every step once."""
    from faults import hold_at, taint

    hold = hold_at(tmp_path, 5)
    stop = {"rank": 1, "where": "receive", "action": "stop", "step": 0, "marker": str(tmp_path / "stop")}
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=2, spares=2,
                       steps=30, step_sleep=0.05, extra=["--hang-timeout", "2"],
                       env=faults_env(stop, hold.fault)).start()
    try:
        hold.wait_reached(job)
        assert taint(etcd_server.endpoint, run_id, rank=1, reason="a joiner that hangs") == 0
        hold.release_after(job, "swap_boundary")
        assert job.wait(240) == 0, job.log()[-3000:]
    finally:
        hold.release()
        job.kill()
    assert os.path.exists(tmp_path / "stop"), "the fault never fired"
    hangs = [e for e in job.events() if e["event"] == "hang_detected"]
    assert [(e["what"], e["proc_state"], e["swap"]) for e in hangs] == [("stopped", "T", True)], hangs
    names = [e["event"] for e in job.events()]
    assert names.count("swap_resumed") == 1 and "fallback" not in names and "restart" not in names, names
    assert [e["attempt"] for e in job.events() if e["event"] == "swap_done"][0] >= 1   # the next spare took it
    for r in range(2):
        assert [x["step"] for x in job.losses(r)] == list(range(30)), f"rank {r}: a step lost or repeated"
