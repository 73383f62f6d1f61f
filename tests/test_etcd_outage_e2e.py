"""An etcd restart mid-run is survived live: real agents, real workers, a real etcd stopped and started again.

Two agents (2 ranks each) train against one etcd; etcd is SIGKILLed mid-run and started again on the same
data a few seconds later (shorter than the lease). Nothing is fenced or restarted: every rank keeps its one
process from the first step to the last, no step is lost or repeated, the job exits 0, and each agent's
console says the outage and the recovery once each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from faults import EXAMPLE, Job

pytestmark = pytest.mark.timeout(300)

STEPS = 60


def _agent(out: str, train: str, endpoint: str, run_id: str) -> Job:
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", "lease_ttl=10,last_call_timeout=1,read_timeout=5,reconnect_timeout=30",
            "--log-dir", os.path.join(out, "logs"), EXAMPLE, "--steps", str(STEPS), "--step-sleep", "0.1",
            "--out", train, "--quiet"]
    return Job(argv=argv, out=out)


def restart_etcd(server, down_s: float) -> None:
    """SIGKILL the fixture's etcd, keep it down ``down_s``, start it again with the same argv (same ports and
    data: revisions and leases survive, as after a real etcd restart)."""
    server.proc.kill()
    server.proc.wait()
    time.sleep(down_s)
    server.proc = subprocess.Popen(server.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{server.endpoint}/health", timeout=1) as resp:
                if b"true" in resp.read():
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("etcd did not come back")


def test_an_etcd_restart_mid_run_is_survived_without_a_restart(tmp_path, fresh_etcd, run_id):
    train = str(tmp_path / "train")
    jobs = [_agent(str(tmp_path / n), train, fresh_etcd.endpoint, run_id).start() for n in ("a", "b")]
    try:
        rank0 = Job(argv=[], out=train)
        deadline = time.monotonic() + 180
        while rank0.step_reached(0) < 8:
            assert time.monotonic() < deadline and all(j.proc.poll() is None for j in jobs), \
                "\n".join(j.log()[-2000:] for j in jobs)
            time.sleep(0.1)
        at = rank0.step_reached(0)
        restart_etcd(fresh_etcd, 3.0)
        codes = [j.wait(240) for j in jobs]
    finally:
        for j in jobs:
            j.kill()
    assert codes == [0, 0], "\n".join(j.log()[-3000:] for j in jobs)
    logs = Job(argv=[], out=train)
    for r in range(4):
        rows = logs.losses(r)
        assert [x["step"] for x in rows] == list(range(STEPS)), f"rank {r}: steps lost or repeated"
        assert len({x["pid"] for x in rows}) == 1, f"rank {r} changed process: nothing should have restarted"
    assert at < STEPS - 10, "etcd restarted too late in the run to mean anything"
    for j in jobs:
        names = [e["event"] for e in j.events()]
        assert names.count("etcd_connection_lost") == 1 and names.count("etcd_connection_restored") == 1, names
        assert "fenced" not in names and "restart" not in names and "fallback" not in names, names
        log = j.log()
        assert log.count("etcd unreachable") == 1 and log.count("etcd reachable again after") == 1, log[-3000:]
