"""A second fault inside a swap ends in a live recovery (real agent, real workers, gloo on CPU, real etcd, a real
SIGKILL at the armed instant): the donor dying as it streams the dead rank's state, the leaver of a planned swap
dying as it streams, the joiner dying as it starts to receive. Each run ends ``torch.equal`` to the torchrun
reference, with no group restart, and the ranks nobody killed keep their processes. 3 ranks + 2 spares: 5 worker
processes."""

from __future__ import annotations

import os

import pytest
from faults import Job, assert_bit_exact, faults_env, hold_at, kill_at, pids_by_rank, taint

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STEPS = 24       # the session's 3-rank reference (shared with test_swap_e2e)
SLEEP = 0.05


@pytest.fixture(scope="module")
def baseline3(reference_run):
    return reference_run(3, STEPS)


def _run(job: Job, *, hold=None, endpoint: str = "", run_id: str = "", taint_rank: int | None = None) -> None:
    job.start()
    try:
        if hold is not None:
            hold.wait_reached(job)
            assert taint(endpoint, run_id, rank=taint_rank, reason="second fault") == 0
            hold.release_after(job, "swap_boundary")
        assert job.wait(240) == 0, job.log()[-4000:]
    finally:
        if hold is not None:
            hold.release()
        job.kill()


def _names(job: Job) -> list[str]:
    return [e["event"] for e in job.events()]


def _live(job: Job) -> None:
    names = _names(job)
    assert "swap_done" in names and "restart" not in names and "fallback" not in names, names


def _kill(rank: int, where: str, marker, *, any_step: bool = True) -> dict:
    """``rank`` (a spare's future rank for a joiner) SIGKILLed at fault point ``where``, once."""
    return {"rank": rank, "step": 0, "any_step": any_step, "where": where, "action": "kill", "marker": str(marker)}


def _after_rank_1_dies(tmp_path, etcd_server, run_id, second: dict, *, spares: int = 2,
                       extra: list[str] | None = None) -> Job:
    """Rank 1 SIGKILLed at step 8, and ``second`` armed for an instant of its recovery; the run ended 0 and both
    faults fired."""
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=3, spares=spares,
                       steps=STEPS, step_sleep=SLEEP, extra=extra,
                       env=faults_env(kill_at(1, 8, str(tmp_path / "f1")), second))
    _run(job)
    assert os.path.exists(tmp_path / "f1") and os.path.exists(second["marker"]), "a fault never fired"
    return job


def test_the_donor_dying_as_it_sends_is_recovered_from_another_replica(tmp_path, etcd_server, run_id, baseline3):
    """Rank 1 dies; rank 0, its replica picked to donate, dies as it starts streaming. Both ranks are replaced
    live by the two spares from rank 2, the last replica (its joiner's partial bundle is thrown away)."""
    job = _after_rank_1_dies(tmp_path, etcd_server, run_id, _kill(0, "send", tmp_path / "f2"))
    _live(job)
    assert sorted(e["rank"] for e in job.events() if e["event"] == "worker_died") == [0, 1]
    assert_bit_exact(job, baseline3, 3)
    pids = pids_by_rank(job, 3)
    assert len(pids[2]) == 1, pids


@pytest.mark.acceptance   # outside CI's budget (the e2e tier ran ~70 min on 2 cores); TPASSRUN_ACCEPTANCE=1 runs it
def test_a_planned_swaps_leaver_dying_as_it_sends_becomes_a_recovery(tmp_path, etcd_server, run_id, baseline3):
    """Rank 1 is tainted; it dies as it starts streaming its state to the joiner. The swap is aborted and the dead
    rank is recovered from a replica instead."""
    hold = hold_at(tmp_path, 6)
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=3, spares=2,
                       steps=STEPS, step_sleep=SLEEP,
                       env=faults_env(_kill(1, "send", tmp_path / "f"), hold.fault))
    _run(job, hold=hold, endpoint=etcd_server.endpoint, run_id=run_id, taint_rank=1)
    assert os.path.exists(tmp_path / "f"), "the fault never fired"
    _live(job)
    assert_bit_exact(job, baseline3, 3)
    pids = pids_by_rank(job, 3)
    assert len(pids[0]) == 1 and len(pids[2]) == 1, pids


def test_the_joiner_dying_as_it_receives_is_replaced_by_the_next_spare(tmp_path, etcd_server, run_id, baseline3):
    """Rank 1 dies; the spare assigned its rank dies as it starts to receive. The recovery retries with the other
    spare instead of waiting in PAUSE."""
    job = _after_rank_1_dies(tmp_path, etcd_server, run_id, _kill(1, "receive", tmp_path / "f2", any_step=False))
    _live(job)
    assert_bit_exact(job, baseline3, 3)
    pids = pids_by_rank(job, 3)
    assert len(pids[0]) == 1 and len(pids[2]) == 1, pids


def test_the_joiner_dying_with_no_other_spare_restarts_the_group_saying_why(tmp_path, etcd_server, run_id):
    """As above with one spare: the recovery cannot retry. It falls back to the group restart at once (not after
    phase timeouts, never stuck in a phase), and the console's fallback line says why in one line."""
    job = _after_rank_1_dies(tmp_path, etcd_server, run_id, _kill(1, "receive", tmp_path / "f2", any_step=False),
                             spares=1, extra=["--max-restarts", "1"])
    fallback = [e for e in job.events() if e["event"] == "fallback"]
    assert len(fallback) == 1 and fallback[0]["spends_restart"], fallback
    why = fallback[0]["reason"]
    assert "rank 1 cannot be recovered live" in why and "died while receiving" in why and "no other spare" in why
    assert [line for line in job.log().splitlines() if "no other spare is left; restarting the whole group" in line]
    died = max(e["mono"] for e in job.events() if e["event"] == "worker_died")
    assert fallback[0]["mono"] - died < 60          # no phase timeout (120 s) was waited out
    for r in range(3):
        assert [x["step"] for x in job.losses(r)][-STEPS:] == list(range(STEPS))


def test_a_rank_killed_while_the_world_re_forms_for_a_recovery_is_recovered_live(tmp_path, etcd_server, run_id,
                                                                                  baseline3):
    """Rank 1 dies; while the world re-forms for its recovery, rank 2 is killed. The others stop joining and wait
    where they are (rank 1's joiner keeps its state), and rank 2 is replaced by the other spare from rank 0: no
    group restart, no --max-restarts spent."""
    # ("reform": on its way into the next re-formed world, before it has joined: the others wait for it)
    job = _after_rank_1_dies(tmp_path, etcd_server, run_id, _kill(2, "reform", tmp_path / "f2"))
    _live(job)
    superseded = [e for e in job.events() if e["event"] == "recovery_superseded"]
    assert superseded and superseded[0]["phase"] == "reform", superseded
    # rank 1's joiner entered the world rank 2's recovery re-formed: both ranks resumed live
    assert sorted(e["rank"] for e in job.events() if e["event"] == "swap_resumed") == [1, 2]
    assert_bit_exact(job, baseline3, 3)
    pids = pids_by_rank(job, 3)
    assert len(pids[0]) == 1, pids


@pytest.mark.acceptance   # outside CI's budget (the e2e tier ran ~70 min on 2 cores); TPASSRUN_ACCEPTANCE=1 runs it
def test_a_rank_killed_while_the_world_re_forms_for_a_planned_swap_is_recovered_live(tmp_path, etcd_server, run_id,
                                                                                      baseline3):
    hold = hold_at(tmp_path, 6)
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=3, spares=2,
                       steps=STEPS, step_sleep=SLEEP, env=faults_env(_kill(2, "reform", tmp_path / "f"), hold.fault))
    _run(job, hold=hold, endpoint=etcd_server.endpoint, run_id=run_id, taint_rank=1)
    assert os.path.exists(tmp_path / "f"), "the fault never fired"
    _live(job)
    assert_bit_exact(job, baseline3, 3)
    pids = pids_by_rank(job, 3)
    assert len(pids[0]) == 1, pids


@pytest.mark.acceptance   # outside CI's budget (the e2e tier ran ~70 min on 2 cores); TPASSRUN_ACCEPTANCE=1 runs it
def test_a_recoverys_joiner_killed_on_its_way_into_the_world_is_replaced_by_the_other_spare(tmp_path, etcd_server,
                                                                                          run_id, baseline3):
    """Rank 1 dies; its joiner is killed as it enters the re-formed world, before it loaded rank 1's state. The
    others stop joining and wait; rank 1 is recovered again from its first death (its snapshots on its node, a
    replica donating) by the other spare: no group restart, ranks 0 and 2 keep their processes."""
    job = _after_rank_1_dies(tmp_path, etcd_server, run_id, _kill(1, "join", tmp_path / "f2"))
    _live(job)
    superseded = [e for e in job.events() if e["event"] == "recovery_superseded"]
    assert superseded and superseded[0]["phase"] == "reform" and superseded[0]["dead"] == [1], superseded
    assert_bit_exact(job, baseline3, 3)
    pids = pids_by_rank(job, 3)
    assert len(pids[0]) == 1 and len(pids[2]) == 1, pids
