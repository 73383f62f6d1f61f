"""A SIGKILL at every phase of a step is recovered live, 0 steps lost, bit-identical to plain torchrun.

A step is a transaction that commits when the tracked optimizer starts stepping; the worker publishes its
per-rank state at the step's start and at that commit point, and the planner resumes every rank at the one step
the survivors and the dead rank's saved state agree on. Each job here kills two ranks at two named fault points
(``examples/train_ddp.py``), one after the other, with two spares (3 ranks + 2 spares = 5 processes), and ends
``torch.equal`` to the same script under ``torchrun`` without any fault.
"""

from __future__ import annotations

import os

import pytest
from faults import Job, assert_bit_exact, faults_env, kill_at, pids_by_rank

STEPS = 24
SLEEP = 0.03
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def torchrun3(reference_run):
    return reference_run(3, STEPS)


@pytest.mark.parametrize("first,second,script", [
    ("forward", "after_opt", []),     # inside the forward pass / right after the optimizer step
    ("backward", "user", []),         # inside backward / in user code after the step (logging, sleep)
    pytest.param("opt_step", "load", [], marks=pytest.mark.acceptance),   # inside opt.step / the next batch loads
    pytest.param("init", "end", [], marks=pytest.mark.acceptance),        # before the first step / between steps
    # a logging all-reduce at the end of every step: the survivors fail in it after their commit point, with
    # the step's changes complete, and resume at the next step from their seals
    ("user", "after_opt", ["--metric-allreduce", "end"]),
], ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_a_kill_at_any_phase_is_recovered_live_and_bit_identical(tmp_path, etcd_server, run_id, torchrun3,
                                                                 first, second, script):
    s1 = 0 if first == "init" else 5
    faults = [kill_at(1, s1, str(tmp_path / "f1"), where=first), kill_at(2, 13, str(tmp_path / "f2"), where=second)]
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=3, spares=2,
                       steps=STEPS, step_sleep=SLEEP, extra=["--max-restarts", "0"], script_args=script,
                       env=faults_env(*faults)).start()
    try:
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert os.path.exists(tmp_path / "f1") and os.path.exists(tmp_path / "f2"), "a fault never fired"
    events = job.events()
    assert [e for e in events if e["event"] == "swap_resumed"].__len__() == 2, [
        (e["event"], e.get("reason")) for e in events if e["event"] in ("swap_phase", "fallback")]
    assert not [e for e in events if e["event"] in ("fallback", "restart")]
    assert len(pids_by_rank(job, 3)[0]) == 1                 # the survivor kept its process throughout
    assert job.final(1)["joined"] and job.final(2)["joined"]  # the killed ranks ended on spares
    assert_bit_exact(job, torchrun3, 3)


def test_a_donor_dying_while_it_hands_over_is_replaced_too(tmp_path, etcd_server, run_id, torchrun3):
    """A second fault during a recovery: rank 1 dies in backward, and the survivor streaming its state to the
    spare (rank 0, the donor) dies mid-transfer. The recovery is superseded by one replacing both ranks from
    the last replica, rank 2, with the second spare: still live, 0 steps lost, torch.equal to torchrun."""
    faults = [kill_at(1, 8, str(tmp_path / "f1")),
              {"rank": 0, "step": 8, "where": "send", "action": "kill", "marker": str(tmp_path / "f2")}]
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=3, spares=2,
                       steps=STEPS, step_sleep=SLEEP, extra=["--max-restarts", "0"],
                       env=faults_env(*faults)).start()
    try:
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert os.path.exists(tmp_path / "f1") and os.path.exists(tmp_path / "f2"), "a fault never fired"
    events = job.events()
    assert [e["event"] for e in events if e["event"] == "recovery_superseded"], [e["event"] for e in events]
    recovered = [e for e in events if e["event"] == "ranks_recovered"]
    assert len(recovered) == 1 and recovered[0]["ranks"] == [0, 1], [
        (e["event"], e.get("reason")) for e in events if e["event"] in ("swap_phase", "fallback")]
    assert not [e for e in events if e["event"] in ("fallback", "restart")]
    assert len(pids_by_rank(job, 3)[2]) == 1                 # the last replica kept its process
    assert job.final(0)["joined"] and job.final(1)["joined"]
    assert_bit_exact(job, torchrun3, 3)


def test_a_mixed_commit_is_rolled_back_live(tmp_path, etcd_server, run_id, torchrun3):
    """A collective that completed on some survivors and not on others (a mixed commit): rank 2 dies right after
    step 8's all-reduce, rank 1 fails as if its all-reduce had not completed (``fail`` after rank 2's death),
    rank 0 completed it, committed step 8 and fails in step 9. No step is every survivor's own: rank 0 goes back to
    step 8 with rank 1's replicated state and its own per-rank state of step 8 (kept from its previous
    transaction), rather than rank 1 catching up to step 9 (which would skip the rest of step 8 on it: its logging);
    the joiner takes rank 1's state too. Live, 0 steps lost, torch.equal to torchrun (rank 0 logs
    step 8 twice, identically: it re-executed it)."""
    kill = str(tmp_path / "f1")
    faults = [kill_at(2, 8, kill, where="synced"),
              {"rank": 1, "step": 8, "where": "synced", "action": "fail", "after": kill, "marker": str(tmp_path / "f2")}]
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=3, spares=1,
                       steps=STEPS, step_sleep=SLEEP, extra=["--max-restarts", "0"], env=faults_env(*faults)).start()
    try:
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert os.path.exists(tmp_path / "f1") and os.path.exists(tmp_path / "f2"), "a fault never fired"
    events = job.events()
    phases = [(e["event"], e.get("reason")) for e in events if e["event"] in ("swap_phase", "fallback")]
    assert [e for e in events if e["event"] == "swap_resumed"], phases
    assert not [e for e in events if e["event"] in ("fallback", "restart")], phases
    moved = [(e["rank"], e["step"], e["donor"]) for e in events if e["event"] == "rank_caught_up"]
    assert moved == [(0, 8, 1)], phases                       # rank 0 went back to step 8 with rank 1's state
    pids = pids_by_rank(job, 3)
    assert len(pids[0]) == 1 and len(pids[1]) == 1            # the survivors kept their processes
    assert job.final(2)["joined"]
    assert_bit_exact(job, torchrun3, 3, relogged_by=pids[0])
