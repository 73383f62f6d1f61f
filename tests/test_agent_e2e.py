"""The launcher as a user meets it: several agents on one etcd, agents dying, bad input, etcd dying.

Real agents (``python -m tpassrun``), real workers, real etcd, real signals; nothing mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from faults import EXAMPLE, REPO, Job, faults_env, hold_at
from faults import alive as _alive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _agent(out: str, endpoint: str, run_id: str, *, nnodes: str, nproc: int, steps: int,
           step_sleep: float = 0.05, extra: list[str] | None = None, env: dict[str, str] | None = None) -> Job:
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
            "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", "lease_ttl=3,last_call_timeout=1", "--log-dir", os.path.join(out, "logs"),
            *(extra or []), EXAMPLE, "--steps", str(steps), "--step-sleep", str(step_sleep),
            "--out", os.path.join(os.path.dirname(out), "train"), "--quiet"]
    return Job(argv=argv, out=out, env=env or {})


def test_two_agents_run_a_four_rank_ddp_job(tmp_path, etcd_server, run_id):
    a = _agent(str(tmp_path / "a"), etcd_server.endpoint, run_id, nnodes="2", nproc=2, steps=20).start()
    b = _agent(str(tmp_path / "b"), etcd_server.endpoint, run_id, nnodes="2", nproc=2, steps=20).start()
    try:
        assert a.wait(240) == 0, a.log()[-2000:]
        assert b.wait(240) == 0, b.log()[-2000:]
    finally:
        a.kill()
        b.kill()
    train = tmp_path / "train"
    assert sorted(p.name for p in train.glob("final_rank*.pt")) == [f"final_rank{r}.pt" for r in range(4)]
    for r in range(4):
        rows = [json.loads(x) for x in (train / f"loss_rank{r}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == list(range(20))


def test_sigkilled_agent_takes_its_workers_and_the_other_agent_carries_on(tmp_path, etcd_server, run_id):
    # the first attempt stands at step 2 until B dies (the restarted one does not wait: the hold fires once)
    hold = hold_at(tmp_path, 2)
    a = _agent(str(tmp_path / "a"), etcd_server.endpoint, run_id, nnodes="1:2", nproc=2, steps=20,
               step_sleep=0.05, extra=["--max-restarts", "1"], env=faults_env(hold.fault)).start()
    b = _agent(str(tmp_path / "b"), etcd_server.endpoint, run_id, nnodes="1:2", nproc=2, steps=20,
               step_sleep=0.05, extra=["--max-restarts", "1"], env=faults_env(hold.fault)).start()
    try:
        # both agents in one generation, training underway: every rank ran steps 0 and 1
        hold.wait_reached(a, 240)
        for r in range(4):
            Job(argv=[], out=str(tmp_path / "train")).wait_step(1, 60, rank=r)
        started = [e for e in b.events() if e["event"] == "workers_started"][-1]
        b_pids = [s["pid"] for s in started["slots"]]
        killed_at = time.monotonic()
        os.kill(b.proc.pid, signal.SIGKILL)   # the agent only: its workers must not outlive it
        b.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in b_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in b_pids), "workers outlived their SIGKILLed agent"
        assert a.wait(300) == 0, a.log()[-3000:]
        seen = [e for e in a.events() if e["event"] in ("membership_change", "restart", "generation_ended")]
        assert seen, [e["event"] for e in a.events()]
        first = min(e["mono"] for e in seen)
        kill_mono = killed_at  # same clock (CLOCK_MONOTONIC) in this process and the agent
        # noticed at once (its workers' peers fail) or at the latest when its 3 s lease expires; the bound only
        # tells that from a wait on some long timeout, with room for a loaded machine
        assert first - kill_mono < 3 + 20, f"noticed {first - kill_mono:.1f}s after the kill (lease ttl 3 s)"
        joined = [e for e in a.events() if e["event"] == "generation_joined"]
        assert joined[-1]["world_size"] == 2   # carried on alone, under the restart policy
    finally:
        hold.release()
        a.kill()
        b.kill()


def _all_succeed(jobs: list[Job], timeout: float = 240) -> None:
    """Every launcher exits 0; none is left running, whatever happens."""
    try:
        for j in jobs:
            assert j.wait(timeout) == 0, j.log()[-2000:]
    finally:
        for j in jobs:
            j.kill()


def _run(argv: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpassrun", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


def test_unknown_flag_is_a_usage_error():
    r = _run(["--no-such-flag", EXAMPLE])
    assert r.returncode == 2
    assert "unrecognized arguments" in r.stderr or "no-such-flag" in r.stderr


@pytest.mark.parametrize("bad", ["0", "3:2", "a:b", "1:2:3"])
def test_malformed_nnodes_is_one_clear_line(bad):
    r = _run(["--nnodes", bad, EXAMPLE])
    assert r.returncode != 0
    assert "nnodes" in _last_line(r.stderr).lower(), r.stderr
    assert "Traceback" not in r.stderr


def test_unreachable_etcd_fails_fast_with_one_line(tmp_path):
    t0 = time.monotonic()
    r = _run(["--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:9", "--rdzv-id", "x",
              "--rdzv-conf", "read_timeout=2", "--log-dir", str(tmp_path), EXAMPLE], timeout=60)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 30
    assert "etcd" in _last_line(r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def test_missing_script_fails_like_torchrun(tmp_path):
    r = _run(["--standalone", "--nproc-per-node", "1", "--log-dir", str(tmp_path), str(tmp_path / "nope.py")])
    assert r.returncode == 1
    assert "FAILED" in r.stderr and "exitcode" in r.stderr


def test_two_runs_with_different_ids_share_one_etcd(tmp_path, etcd_server):
    jobs = [_agent(str(tmp_path / f"j{i}"), etcd_server.endpoint, f"iso-{i}-{os.getpid()}", nnodes="1", nproc=1,
                   steps=15, step_sleep=0.02) for i in range(2)]
    for j in jobs:
        j.argv[j.argv.index("--out") + 1] = os.path.join(j.out, "train")
        j.start()
    _all_succeed(jobs)
    for j in jobs:
        joined = [e for e in j.events() if e["event"] == "generation_joined"]
        assert len(joined) == 1 and joined[0]["world_size"] == 1 and len(joined[0]["members"]) == 1


def test_etcd_killed_mid_run_does_not_hang(tmp_path, fresh_etcd, run_id):
    hold = hold_at(tmp_path, 3)     # etcd dies with the job at step 3, whatever the machine's speed
    job = _agent(str(tmp_path / "a"), fresh_etcd.endpoint, run_id, nnodes="1", nproc=2, steps=30,
                 step_sleep=0.05, extra=["--rdzv-conf", "lease_ttl=3,read_timeout=3"], env=faults_env(hold.fault))
    job.start()
    try:
        hold.wait_reached(job)
        fresh_etcd.stop()
        hold.release()
        code = job.wait(120)   # no hang: the workers finish (or the agent fails cleanly)
    finally:
        hold.release()
        job.kill()
    assert code in (0, 1), job.log()[-2000:]
    if code == 1:
        assert "etcd" in job.log()


def test_a_signal_ends_fenced_agents_while_etcd_is_gone(tmp_path, fresh_etcd, run_id):
    """Found while the suite was stopped mid-run (its etcd killed with it): two agents that fenced their workers
    when etcd went away sat in the fence's request for a new generation, which waits out an outage for as long as
    it lasts, and a SIGTERM was never read: they outlived the test by minutes. A signal now cuts every such
    request short; both agents end, with torchrun's code for a signal after the workers started."""
    hold = hold_at(tmp_path, 3)
    jobs = [_agent(str(tmp_path / n), fresh_etcd.endpoint, run_id, nnodes="2", nproc=1, steps=400,
                   env=faults_env(hold.fault)).start() for n in ("a", "b")]
    try:
        hold.wait_reached(jobs[0])
        fresh_etcd.stop()
        hold.release()
        deadline = time.monotonic() + 120
        while not all(any(e["event"] == "fenced" for e in j.events()) for j in jobs):
            assert time.monotonic() < deadline, [j.log()[-1500:] for j in jobs]
            time.sleep(0.2)
        for j in jobs:
            j.proc.send_signal(signal.SIGTERM)
        codes = [j.wait(60) for j in jobs]
    finally:
        hold.release()
        for j in jobs:
            j.kill()
    assert codes == [1, 1], [j.log()[-1500:] for j in jobs]


def test_c10d_endpoint_without_an_etcd_is_hosted_by_one_agent(tmp_path, run_id):
    """torchrun users point c10d at a machine and run no etcd: the agent there hosts one, like torchrun's
    TCPStore host, keeps it until the other agent is done, and leaves nothing behind."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jobs = []
    for name in ("a", "b"):
        out = str(tmp_path / name)
        argv = [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "--rdzv-conf", "lease_ttl=3,last_call_timeout=1", "--log-dir", os.path.join(out, "logs"),
                EXAMPLE, "--steps", "15", "--step-sleep", "0.02", "--out", str(tmp_path / "train"), "--quiet"]
        jobs.append(Job(argv=argv, out=out).start())
    _all_succeed(jobs)
    hosted = [j for j in jobs if any(e["event"] == "etcd_hosted" for e in j.events())]
    assert len(hosted) == 1
    for r in range(2):
        rows = (tmp_path / "train" / f"loss_rank{r}.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in rows] == list(range(15))
    with socket.socket() as s:   # the hosted etcd is gone with its agent
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_static_multi_node_keeps_torchruns_node_ranks(tmp_path):
    """torchrun's classic two-node command line, no etcd anywhere: ``--node-rank`` decides GROUP_RANK and RANK
    whatever order the agents start in, MASTER_ADDR/PORT are the user's, and both agents exit 0."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "envdump.py"
    script.write_text(
        "import json, os, torch.distributed as dist\n"
        "dist.init_process_group('gloo'); dist.barrier()\n"
        "keys = ['RANK', 'GROUP_RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT']\n"
        "open(os.path.join(os.environ['OUT'], 'r' + os.environ['RANK'] + '.json'), 'w').write(\n"
        "    json.dumps({k: os.environ[k] for k in keys} | {'dist_rank': dist.get_rank()}))\n"
        "dist.destroy_process_group()\n")
    jobs = []
    for node_rank in (1, 0):    # node 1 first: it must not become group rank 0
        out = str(tmp_path / f"n{node_rank}")
        argv = [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--node-rank", str(node_rank),
                "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--log-dir", os.path.join(out, "logs"), str(script)]
        jobs.append(Job(argv=argv, out=out, env={"OUT": str(tmp_path)}).start())
        time.sleep(1.0)
    _all_succeed(jobs)
    for rank in range(4):
        got = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert got == {"RANK": str(rank), "GROUP_RANK": str(rank // 2), "LOCAL_RANK": str(rank % 2),
                       "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "dist_rank": rank}
