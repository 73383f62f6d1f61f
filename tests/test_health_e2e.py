"""Acceptance, end to end: a health signal moves one rank to a warm spare and the run stays bit-exact.

Real processes only: a real etcd, ``python -m tpassrun`` with 4 ranks + 1 spare running
``examples/train_ddp.py`` over gloo, and the site-tool file (``TPASSRUN_HEALTH_FILE``) or an injected
straggler as the signal. Each run is compared with an uninterrupted run of the same job under torchrun:
same per-step losses, same final model and optimizer state on every rank, and the agent's event log
shows ``health_verdict -> health_taint -> swap_decided -> swap_resumed`` in time order.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from faults import Job, faults_env, hold_at

from tpassrun.channel import Field

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "examples" / "train_ddp.py")
NPROC = 4
ECC_STEPS = 40
STRAGGLER_STEPS = 40
STRAGGLER_FAULT = [{"rank": 2, "step": 5, "where": "step", "action": "sleep", "seconds": 0.3}]
STRAGGLER_HOLD = 34


def _agent_runs_health() -> bool:
    # Read, not import: importing the agent tweaks gRPC variables in os.environ.
    spec = importlib.util.find_spec("tpassrun.agent")
    return spec is not None and spec.origin is not None and "AgentHealth" in Path(spec.origin).read_text()


pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not _agent_runs_health(),
                                                  reason="tpassrun/agent/__init__.py does not start AgentHealth yet (see tpassrun/agent/healthd.py)")]


def launch(endpoint: str, run_id: str, workdir: Path, steps: int, *, spares: int, extra_args: tuple[str, ...] = (),
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path, Path]:
    out, logs = workdir / "out", workdir / "logs"
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", run_id, "--nproc-per-node", str(NPROC), "--spares-per-node", str(spares),
            "--log-dir", str(logs), *extra_args,
            SCRIPT, "--steps", str(steps), "--step-sleep", "0.05", "--out", str(out), "--quiet"]
    full_env = {**os.environ, **(env or {})}
    # cwd outside the repo: the installed tpassrun is what runs, as for a user.
    proc = subprocess.Popen(argv, cwd=workdir, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    return proc, out, logs


def _watch(proc: subprocess.Popen, workdir: Path) -> Job:
    """A view of a launched job for faults' waits (its event log; the process it must not lose)."""
    return Job(argv=[], out=str(workdir), proc=proc)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:   # workers die with their agent (pdeathsig)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


def losses(out: Path, rank: int) -> list[tuple[int, float]]:
    with open(out / f"loss_rank{rank}.jsonl") as f:
        return [(d["step"], d["loss"]) for d in map(json.loads, f)]


def wait_for_step(proc: subprocess.Popen, out: Path, rank: int, step: int, timeout: float = 120.0) -> None:
    """Block until ``rank`` logged ``step`` (the job's own record of progress)."""
    deadline = time.monotonic() + timeout
    path = out / f"loss_rank{rank}.jsonl"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the job exited ({proc.returncode}) before rank {rank} reached step {step}")
        if path.exists() and any(s >= step for s, _ in losses(out, rank)):
            return
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} did not reach step {step}")


def write_readings(path: Path, readings: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"v": 1, "readings": readings}))
    os.replace(tmp, path)


def events(logs: Path) -> list[dict]:
    found = glob.glob(str(logs / "*" / "events.jsonl"))
    assert len(found) == 1, found
    with open(found[0]) as f:
        return [json.loads(line) for line in f if line.strip()]


def assert_same_tensors(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tensors(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tensors(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_as_baseline(out: Path, baseline: Path, steps: int) -> None:
    for rank in range(NPROC):
        mine, ref = losses(out, rank), losses(baseline, rank)
        assert [s for s, _ in mine] == list(range(steps)), f"rank {rank} steps"
        assert mine == ref, f"rank {rank}: per-step losses differ from the uninterrupted run"
        got = torch.load(out / f"final_rank{rank}.pt", weights_only=False)
        want = torch.load(baseline / f"final_rank{rank}.pt", weights_only=False)
        assert_same_tensors(got["model"], want["model"], f"rank {rank} model")
        assert_same_tensors(got["optimizer"], want["optimizer"], f"rank {rank} optimizer")


def assert_health_swap_in_order(records: list[dict], device: str) -> dict:
    """health_verdict -> health_taint -> swap_decided -> swap_resumed for ``device``; returns the taint event."""
    verdict = next(e for e in records if e["event"] == "health_verdict" and e["device"] == device
                   and e["action"] == "write")
    taint = next(e for e in records if e["event"] == "health_taint" and e["mono"] >= verdict["mono"])
    decided = next(e for e in records if e["event"] == "swap_decided" and e.get("taint") == taint["id"])
    resumed = next(e for e in records if e["event"] == "swap_resumed" and e["swap_id"] == decided["swap_id"])
    times = [verdict["mono"], taint["mono"], decided["mono"], resumed["mono"]]
    assert times == sorted(times), times
    return taint


@pytest.fixture(scope="module")
def baselines(reference_run) -> dict[int, Path]:
    """Uninterrupted runs of the job, one per step count the tests use (the session's torchrun references)."""
    return {steps: Path(reference_run(NPROC, steps).out) for steps in {ECC_STEPS, STRAGGLER_STEPS}}


@pytest.mark.timeout(400)
def test_rising_uncorrected_ecc_moves_the_rank_to_the_spare(etcd_server, run_id, tmp_path, baselines):
    readings = tmp_path / "health.json"
    write_readings(readings, [{"device": "gpu1", "metric": "ecc_uncorrected_volatile", "value": 0}])  # baseline
    hold = hold_at(tmp_path, 10)    # the ECC count rises at step 10; the job waits there until the swap is set
    proc, out, logs = launch(etcd_server.endpoint, run_id, tmp_path, ECC_STEPS, spares=1,
                             extra_args=("--health-interval", "0.2"),
                             env={"TPASSRUN_HEALTH_FILE": str(readings), **faults_env(hold.fault)})
    try:
        hold.wait_reached(_watch(proc, tmp_path))
        write_readings(readings, [{"device": "gpu1", "metric": "ecc_uncorrected_volatile", "value": 2}])
        hold.release_after(_watch(proc, tmp_path), "swap_boundary")
    finally:
        hold.release()
        code, output = finish(proc, 180)
    assert code == 0, output[-3000:]
    taint = assert_health_swap_in_order(events(logs), "gpu1")
    assert (taint["slot"], taint["rank"]) == (1, 1)
    assert_same_as_baseline(out, baselines[ECC_STEPS], ECC_STEPS)


@pytest.mark.timeout(400)
@pytest.mark.skipif(not hasattr(Field, "LAST_COMPUTE_NS"),
                    reason="whole-step times are equal on every DDP rank; the worker must publish its time "
                           "before the first collective (Field.LAST_COMPUTE_NS, see tpassrun/agent/healthd.py)")
def test_injected_straggler_moves_the_rank_to_the_spare(etcd_server, run_id, tmp_path, baselines):
    # Rank 2 is slow from step 5; by step STRAGGLER_HOLD the detector has seen far more slow steps than it needs
    # (10 samples, 5 verdicts in a row): the job waits there until the swap is set, so it cannot end first.
    hold = hold_at(tmp_path, STRAGGLER_HOLD)
    proc, out, logs = launch(etcd_server.endpoint, run_id, tmp_path, STRAGGLER_STEPS, spares=1,
                             extra_args=("--straggler-factor", "3", "--health-interval", "0.2"),
                             env=faults_env(*STRAGGLER_FAULT, hold.fault))
    try:
        hold.release_after(_watch(proc, tmp_path), "swap_boundary")
    finally:
        hold.release()
        code, output = finish(proc, 240)
    assert code == 0, output[-3000:]
    records = events(logs)
    taint = assert_health_swap_in_order(records, "rank2")
    assert (taint["slot"], taint["rank"]) == (2, 2) and "straggler" in taint["reason"]
    assert_same_as_baseline(out, baselines[STRAGGLER_STEPS], STRAGGLER_STEPS)
