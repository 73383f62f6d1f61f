"""The transparent mode end to end (docs/transparent.md): an unmodified DDP script (tests/transparent_train.py, no
tpassrun import) under ``tpassrun --snapshot-interval``, real CRIU, real gloo, real signals.

* without a usable CRIU the job runs as under torchrun, with one line saying why (any machine);
* a SIGKILL of a rank restores every rank from the last snapshot; a taint moves the rank to the spare slot with no
  step lost; both end ``torch.equal`` to plain torchrun (root and CRIU >= 4.2: scripts/criu.sh).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
from faults import Job, taint

from tpassrun.snapshot import probe

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transparent_train.py")


def _criu_unusable() -> str | None:
    if os.geteuid() != 0:
        return "CRIU needs root"
    got = asyncio.run(probe(os.environ))
    return None if got.usable else f"no usable CRIU ({got.reason}); bash scripts/criu.sh installs one"


def _job(out: str, *launcher: str, nproc: int = 4, steps: int = 80, env: dict[str, str] | None = None) -> Job:
    return Job(argv=[sys.executable, "-m", "tpassrun", *launcher, "--nproc-per-node", str(nproc),
                     "--log-dir", os.path.join(out, "logs"), SCRIPT, "--steps", str(steps), "--step-sleep", "0.05",
                     "--out", out], out=out, env=env or {})


def _torchrun(out: str, nproc: int = 4, steps: int = 80) -> Job:
    job = Job(argv=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    SCRIPT, "--steps", str(steps), "--step-sleep", "0.05", "--out", out], out=out).start()
    assert job.wait(300) == 0, job.log()[-3000:]
    return job


def _assert_equal(job: Job, ref: Job, world: int) -> None:
    import torch

    for r in range(world):
        a, b = job.final(r), ref.final(r)
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (r, k)
        for sa, sb in zip(a["opt"]["state"].values(), b["opt"]["state"].values()):
            for k in sa:
                assert torch.equal(sa[k], sb[k]), (r, k)


def test_without_a_usable_criu_the_job_runs_as_under_torchrun(tmp_path) -> None:
    out = str(tmp_path / "job")
    job = _job(out, "--standalone", "--snapshot-interval", "1", nproc=2, steps=10,
               env={"TPASSRUN_CRIU": "/bin/false"}).start()
    assert job.wait(300) == 0, job.log()[-3000:]
    lines = [ln for ln in job.log().splitlines() if "transparent mode off" in ln]
    assert len(lines) == 1, job.log()[-3000:]
    assert "/bin/false --version failed" in lines[0] and "runs as under torchrun" in lines[0]
    assert [len(job.losses(r)) for r in range(2)] == [10, 10]
    assert not any(e["event"].startswith("snapshot") for e in job.events())


@pytest.fixture
def criu_needed() -> None:
    why = _criu_unusable()
    if why is not None:
        pytest.skip(why)


def test_a_killed_rank_restores_every_rank_from_the_last_snapshot(tmp_path, criu_needed) -> None:
    ref = _torchrun(str(tmp_path / "torchrun"))
    job = _job(str(tmp_path / "job"), "--standalone", "--spares-per-node", "1", "--snapshot-interval", "1").start()
    job.wait_event("snapshot_taken", timeout=240)
    job.wait_step(job.step_reached(2) + 5, 120, rank=2)
    os.kill(job.losses(2)[-1]["pid"], signal.SIGKILL)
    assert job.wait(300) == 0, job.log()[-3000:]
    restored = [e for e in job.events() if e["event"] == "snapshot_restored"]
    assert len(restored) == 1 and restored[0]["rank"] == 2, job.log()[-3000:]
    assert not any(e["event"] == "restart" for e in job.events())
    _assert_equal(job, ref, 4)


def test_a_taint_moves_the_rank_to_the_spare_slot_with_no_step_lost(tmp_path, criu_needed, etcd_server) -> None:
    ref = _torchrun(str(tmp_path / "torchrun"))
    run_id = "transparent-taint"
    job = _job(str(tmp_path / "job"), "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint,
               "--rdzv-id", run_id, "--spares-per-node", "1", "--snapshot-interval", "30").start()
    job.wait_step(20, 240, rank=1)
    assert taint(etcd_server.endpoint, run_id, rank=1, reason="test") == 0
    moved = job.wait_event("snapshot_migrated", timeout=240)
    assert moved[0]["rank"] == 1 and moved[0]["to_slot"] == 4
    assert job.wait(300) == 0, job.log()[-3000:]
    assert [len(job.losses(r)) for r in range(4)] == [80] * 4       # each step once: none lost, none redone
    assert not any(e["event"] == "restart" for e in job.events())
    _assert_equal(job, ref, 4)
