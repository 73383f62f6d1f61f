"""A survivor's exception is classified by its cause, not by the file that raised it (issue 22, item 1).

tests/titan_trainer.py steps as torchtitan 0.3.0's Trainer does (4 ranks of FSDP2 + 1 spare = 5 processes, real
etcd, gloo): its loss and token count reduced through ``torchtitan.distributed.utils`` (functional collectives,
whose gloo errors are raised from ``torch/_ops.py``), grad clipping with ``dist_utils.clip_grad_norm_``. Before
this, a rank SIGKILLed there made its survivors "raise a user error" and the job exit 1 (0/2 in the issue's
table). A survivor that fails while a peer is dead is a casualty, whatever raised its exception: live recovery,
``torch.equal`` to the same script under plain torchrun. A genuine user error still ends the job as torchrun does.
``bench/cause.py`` runs the random-instant SIGKILL ten times and more.
"""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("torchtitan", reason="torchtitan not installed (scripts/bootstrap.sh installs torchtitan==0.3.0)")

from faults import Job, faults_env, hold_at, kill_at, pids_by_rank
from realjobs import assert_same_run, sigkill_at_random_instant, swap_pause_s, torchrun_job, tpassrun_job

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "titan_trainer.py")
STEPS = 12
WORLD = 4
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def _args(*more: str, sleep: float = 0.05) -> list[str]:
    return ["--steps", str(STEPS), "--step-sleep", str(sleep), *more]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = torchrun_job(str(tmp_path_factory.mktemp("ref")), SCRIPT, WORLD, _args(sleep=0.0)).start()
    assert job.wait(300) == 0, job.log()[-3000:]
    return job


def _causes(job, cause: str) -> list[dict]:
    return [e for e in job.events() if e["event"] == "exception_cause" and e["cause"] == cause]


def _live(job, ref, rank: int) -> None:
    events = job.events()
    phases = [(e["event"], e.get("reason") or e.get("why")) for e in events
              if e["event"] in ("swap_phase", "fallback", "user_error", "exception_cause")]
    assert [e for e in events if e["event"] == "swap_resumed"], phases
    assert not [e for e in events if e["event"] in ("fallback", "restart", "user_error")], phases
    assert not _causes(job, "root_cause"), phases
    assert_same_run(job, ref, WORLD, redone=True)
    pids = pids_by_rank(job, WORLD)
    assert all(len(pids[r]) == 1 for r in range(WORLD) if r != rank) and len(pids[rank]) == 2, pids


def test_trainer_shaped_sigkill_at_a_random_instant_is_recovered_live(tmp_path, etcd_server, run_id, reference):
    rng = random.Random()
    rank, at = rng.randrange(WORLD), rng.randint(2, STEPS - 5)
    late = hold_at(tmp_path, STEPS - 2, rank=(rank + 1) % WORLD)   # the job cannot end before the kill
    job = tpassrun_job(str(tmp_path / "job"), SCRIPT, WORLD, _args(), endpoint=etcd_server.endpoint, run_id=run_id,
                       env=faults_env(late.fault)).start()
    try:
        delay = sigkill_at_random_instant(job, rank, at, 0.3, rng)
        late.release()
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        late.release()
        job.kill()
    _live(job, reference, rank)
    print(f"rank {rank} killed {delay:.3f} s after step {at}; casualties {len(_causes(job, 'casualty'))}; "
          f"pause {swap_pause_s(job):.2f} s")


def test_a_wait_called_from_the_scripts_own_file_is_a_casualty(tmp_path, etcd_server, run_id, reference):
    """Megatron's shape: ``handle.wait()`` of an async all-reduce, called from the script's own file. Rank 1 dies
    before sending its part; the others fail in that wait (innermost frame: the script), are casualties.

    Stop 22's CI found no casualty once: rank 1 then died just *after* starting its own ``all_reduce``, and gloo's
    background thread had finished the reduction before the SIGKILL landed, so the peers failed one collective
    later, inside torch's files (a collective failure, rightly no casualty verdict). The fault point now sits
    before the reduction starts."""
    marker = str(tmp_path / "fault")
    job = tpassrun_job(str(tmp_path / "job"), SCRIPT, WORLD, _args("--wait-in-script"), endpoint=etcd_server.endpoint,
                       run_id=run_id, env=faults_env(kill_at(1, 4, marker, where="wait"))).start()
    try:
        assert job.wait(300) == 0, job.log()[-4000:]
    finally:
        job.kill()
    assert os.path.exists(marker), "the fault never fired"
    casualties = _causes(job, "casualty")
    assert casualties and all("rank 1" in e["why"] for e in casualties), casualties
    _live(job, reference, 1)


def _user_error(tmp_path, launcher: str, ranks: list[int], **kw):
    faults = faults_env(*({"rank": r, "step": 3, "where": "step", "action": "raise",
                           "marker": str(tmp_path / f"{launcher}-r{r}")} for r in ranks))
    out = str(tmp_path / launcher)
    job = (torchrun_job(out, SCRIPT, WORLD, _args(), env=faults) if launcher == "torchrun" else
           tpassrun_job(out, SCRIPT, WORLD, _args(), env=faults, **kw)).start()
    try:
        code = job.wait(300)
    finally:
        job.kill()
    return job, code


def test_a_user_error_still_ends_the_job_as_torchrun_ends_it(tmp_path, etcd_server, run_id):
    """One rank's own exception: its peers block on it while it is judged (its collectives stay open), then fail in
    the Trainer's functional collectives once it exits. No peer failed first: no casualty, no spare; the job ends
    with torchrun's exit code and report, after at most the grace (failkind.CAUSE_GRACE_S)."""
    ours, code = _user_error(tmp_path, "tpassrun", [1], endpoint=etcd_server.endpoint, run_id=run_id)
    theirs, their_code = _user_error(tmp_path, "torchrun", [1])
    assert code == their_code == 1, ours.log()[-3000:]
    for job in (ours, theirs):
        log = job.log()
        assert "RuntimeError: injected fault at rank 1" in log and "Root Cause (first observed failure)" in log
        assert "rank      : 1 (local_rank: 1)" in log
    names = [e["event"] for e in ours.events()]
    assert "user_error" in names and "swap_pause" not in names and "recovery_decided" not in names, names
    roots = _causes(ours, "root_cause")
    assert [e["rank"] for e in roots] == [1], roots


def test_every_rank_raising_the_same_bug_ends_the_job_without_a_hang(tmp_path):
    """The same bug on every rank at once (examples/train_ddp.py, 2 ranks + a spare): each waits beside the other,
    neither dead nor FAILED, so each is its own root cause after the grace; exit 1 and torchrun's report."""
    faults = [{"rank": r, "step": 3, "where": "step", "action": "raise", "marker": str(tmp_path / f"r{r}")}
              for r in (0, 1)]
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=None, run_id="", nproc=2, spares=1, steps=10,
                       env=faults_env(*faults)).start()
    try:
        assert job.wait(180) == 1, job.log()[-3000:]
    finally:
        job.kill()
    assert "Root Cause (first observed failure)" in job.log()
    names = [e["event"] for e in job.events()]
    assert "user_error" in names and "swap_pause" not in names and "recovery_decided" not in names, names
    assert _causes(job, "root_cause"), [e for e in job.events() if e["event"] == "exception_cause"]


def test_a_single_rank_world_has_no_peer_to_blame(tmp_path):
    """One rank alone (and a spare): its exception is its own at once, no question asked (examples/train_ddp.py)."""
    fault = {"rank": 0, "step": 3, "where": "step", "action": "raise", "marker": str(tmp_path / "r0")}
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=None, run_id="", nproc=1, spares=1, steps=10,
                       env=faults_env(fault)).start()
    try:
        assert job.wait(180) == 1, job.log()[-3000:]
    finally:
        job.kill()
    names = [e["event"] for e in job.events()]
    assert "user_error" in names and "exception_cause" not in names, names
