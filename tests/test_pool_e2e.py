"""A job without spares of its own draws a node from a spare pool when one of its nodes dies (issue 24).

Real agents (``python -m tpassrun``, separate processes) on one real etcd: the job is 2 nodes x 1 rank with
``--spare-pool``, and one pool node (``tpassctl pool join``) waits idle. Node B is SIGKILLed (agent and worker):
the leader finds no own spare, claims the pool node (compare-and-set under its lease), the pool node starts the
job's ``--spare-node`` from the sealed claim, and the node plan moves B's rank onto it when its spare is up. The
run ends ``torch.equal`` to plain torchrun, the survivor keeps its process, and the pool node is idle again once
the job ended. Bad input (a pool that does not exist, no pool key) is one line and exit 1 at start."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from faults import Job, assert_bit_exact, pid_of_rank, sigkill_node, wait_dead
from tpassrun.pool import Pool, PoolKeys, pool_prefix
from tpassrun.provenance import RunKey
from tpassrun.rendezvous import EtcdConfig, EtcdStore

pytestmark = pytest.mark.timeout(400)

STEPS = 30
POOL_KEY = "pool-key-for-the-e2e-0123456789"
RUN_KEY = "run-key-for-the-e2e-0123456789"


def _pool_op(endpoint: str, name: str, op: str):
    async def main():
        async with EtcdStore(EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"})) as store:
            pool = Pool(store, PoolKeys(pool_prefix("/tpassrun/v1", name)), RunKey.from_text(POOL_KEY), name)
            if op == "create":
                return await pool.create()
            if op == "delete":
                return await pool.delete()
            return await pool.read()
    return asyncio.run(main())


def test_bad_pool_input_is_one_line_at_start(tmp_path, etcd_server, run_id):
    base = [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id, "--spare-pool", run_id,
            "-m", "this_module_is_never_run"]
    env = {**{k: v for k, v in os.environ.items() if k != "TPASSRUN_POOL_KEY"}, "TPASSRUN_RUN_KEY": RUN_KEY}
    out = subprocess.run(base, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no pool key" in out.stderr and out.stderr.count("\n") == 1, out.stderr
    out = subprocess.run(base, env={**env, "TPASSRUN_POOL_KEY": POOL_KEY}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "does not exist" in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_a_lost_node_is_replaced_live_by_a_pool_node_which_is_idle_again_after_the_job(tmp_path, etcd_server,
                                                                                        run_id, reference_run):
    reference = reference_run(2, STEPS)
    assert _pool_op(etcd_server.endpoint, run_id, "create")
    keys = {"TPASSRUN_POOL_KEY": POOL_KEY, "TPASSRUN_RUN_KEY": RUN_KEY}
    pool_node = Job(argv=[sys.executable, "-m", "tpassrun.ctl", "pool", "join", run_id, "--rdzv-endpoint",
                          etcd_server.endpoint, "--nproc-per-node", "1", "--node-id", "poolnode1"],
                    out=str(tmp_path / "pool"), env=keys)
    train = str(tmp_path / "train")
    a, b = (Job.agent(str(tmp_path / n), train, endpoint=etcd_server.endpoint, run_id=run_id, nproc=1, steps=STEPS,
                      step_sleep=0.2, extra=["--spare-pool", run_id, "--pool-wait", "120"], env=keys) for n in "ab")
    try:
        pool_node.start()
        deadline = time.monotonic() + 60
        while "poolnode1" not in _pool_op(etcd_server.endpoint, run_id, "read")[0].nodes:
            assert time.monotonic() < deadline and pool_node.proc.poll() is None, pool_node.log()[-2000:]
            time.sleep(0.2)
        a.start(), b.start()
        logs = Job(argv=[], out=train)
        for r in range(2):
            logs.wait_step(3, 180, rank=r)
        b_pids = b.worker_pids()
        b_rank = next(r for r in range(2) if pid_of_rank(train, r) in b_pids)
        survivor_pid = pid_of_rank(train, 1 - b_rank)
        t_kill = sigkill_node(b)
        assert len(wait_dead(b_pids, t_kill, 10)) == len(b_pids)
        assert a.wait(180) == 0, a.log()[-4000:] + pool_node.log()[-3000:]
        claimed = [e for e in a.events() if e["event"] == "pool_claimed"]
        assert claimed and claimed[0]["pool_node"] == "poolnode1", a.log()[-3000:]
        deadline = time.monotonic() + 60
        while True:      # the job ended: its spare node on the pool node exits, the node is idle again
            view = _pool_op(etcd_server.endpoint, run_id, "read")[0]
            node = view.nodes.get("poolnode1")
            if node is not None and node.state == "idle" and not view.claims:
                break
            assert time.monotonic() < deadline, (view, pool_node.log()[-3000:])
            time.sleep(0.2)
        history = [h.event for h in _pool_op(etcd_server.endpoint, run_id, "read")[2]]
        recovered = [e for e in a.events() if e["event"] in ("swap_resumed", "node_recovered")]
        print(f"\npool claim after the kill: {claimed[0]['mono'] - t_kill if 'mono' in claimed[0] else '?'}; "
              f"pool history {history}; a: {[e['event'] for e in recovered]}")
    finally:
        for j in (a, b):
            j.kill()
        if pool_node.proc is not None and pool_node.proc.poll() is None:
            pool_node.proc.send_signal(signal.SIGTERM)
            try:
                pool_node.proc.wait(30)
            except subprocess.TimeoutExpired:
                pool_node.kill()
        _pool_op(etcd_server.endpoint, run_id, "delete")
    assert_bit_exact(Job(argv=[], out=train), reference, 2, relogged_by=b_pids)
    pids = {row["pid"] for row in Job(argv=[], out=train).losses(1 - b_rank)}
    assert pids == {survivor_pid}, "the survivor changed process"
    moved = [row["pid"] for row in Job(argv=[], out=train).losses(b_rank)]
    assert moved[0] in b_pids and moved[-1] not in b_pids           # its rank went on elsewhere: the pool node
    assert "claimed pool node" in a.log()
