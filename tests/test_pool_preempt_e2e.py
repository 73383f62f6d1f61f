"""Issue 24, item 3, with real agents on one real etcd: a high-priority job pre-empts a lower-priority elastic job's
member on the one pool node.

The low job (``--nnodes 1:2``, 2 ranks per node, priority 1) runs its own node and claims the idle pool node as a
member at start (``--pool-members 1``): the pool node starts the job's member node and it joins the rendezvous. The
high job (2 nodes x 2 ranks, priority 5, ``--spare-pool``, no spares of its own) loses node B (SIGKILL): its leader
finds no idle pool node, asks the pool node to give up the low job's member (a sealed pre-emption request); the pool
node SIGTERMs its member node, and once it exited the node is idle; the high job's claim takes it, its spare node
joins and B's ranks train again live there, ``torch.equal`` to torchrun, the survivors keep their processes. The
low job shrinks as torchrun's elastic membership change does (one node, its workers restart from their
checkpoint), never claims the node back, and exits 0. Both consoles say what happened."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from faults import Job, assert_bit_exact, sigkill_node, wait_dead
from test_pool_e2e import POOL_KEY, RUN_KEY, STEPS, _join, _pool_op, _train_to_step_3, stop_pool_node

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

LOW_RUN_KEY = "low-run-key-for-the-e2e-0123456789"

# The low job's worker (no torch): a step counter checkpointed by rank 0, resumed from at start; it records its
# generation (world, restart count, the step it resumed from) and steps until released by a file.
LOW_WORKER = r'''
import json, os, sys, time
out = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ckpt = os.path.join(out, "ckpt")
step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
with open(os.path.join(out, f"gen-{restart}-{rank}-{os.getpid()}.json"), "w") as f:
    json.dump({"rank": rank, "world": world, "restart": restart, "resumed": step}, f)
while not os.path.exists(os.path.join(out, "go")):
    time.sleep(0.1)
    step += 1
    if rank == 0:
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(ckpt + ".tmp", ckpt)
'''


def _gens(out: Path) -> list[dict]:
    rows = []
    for p in out.glob("gen-*.json"):
        try:
            rows.append(json.loads(p.read_text()))
        except ValueError:
            pass        # being written: the next poll reads it
    return rows


def _until(cond, timeout: float, what: str, *jobs: Job) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}\n" + "\n----\n".join(j.log()[-3000:] for j in jobs)
        time.sleep(0.1)


def preempt_run(tmp_path: Path, endpoint: str, run_id: str) -> dict:
    """The scenario (module docstring), to its end: the high job exited 0, the low job shrank and exited 0. Returns
    what the checks and the bench read (events, logs, pids, the monotonic time of the kill)."""
    pool = run_id
    assert _pool_op(endpoint, pool, "create")
    keys = {"TPASSRUN_POOL_KEY": POOL_KEY, "TPASSRUN_RUN_KEY": RUN_KEY}
    pool_node = Job(argv=[sys.executable, "-m", "tpassrun.ops.ctl", "pool", "join", pool, "--rdzv-endpoint",
                          endpoint, "--nproc-per-node", "2", "--node-id", "poolnode1"],
                    out=str(tmp_path / "pool"), env=keys)
    script, low_out = tmp_path / "low_worker.py", tmp_path / "low_out"
    script.write_text(LOW_WORKER)
    low_out.mkdir()
    low = Job(argv=[sys.executable, "-m", "tpassrun", "--nnodes", "1:2", "--nproc-per-node", "2",
                    "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", f"low-{run_id}",
                    "--rdzv-conf", "lease_ttl=3,last_call_timeout=30", "--max-restarts", "3",
                    "--spare-pool", pool, "--priority", "1", "--pool-members", "1",
                    "--log-dir", str(tmp_path / "low" / "logs"), str(script), str(low_out)],
              out=str(tmp_path / "low"), env={**keys, "TPASSRUN_RUN_KEY": LOW_RUN_KEY})
    train = str(tmp_path / "train")
    a, b = (Job.agent(str(tmp_path / n), train, endpoint=endpoint, run_id=run_id, nproc=2, steps=STEPS,
                      extra=["--spare-pool", pool, "--priority", "5", "--pool-wait", "60"], env=keys)
            for n in "ab")
    try:
        _join(pool_node, endpoint, pool, "poolnode1")
        low.start()
        # the low job runs on both nodes: its own and the pool node's member (4 ranks of one generation)
        _until(lambda: len({g["rank"] for g in _gens(low_out) if g["world"] == 4}) == 4, 180,
               "the low job never ran on its own node and the pool node", low, pool_node)
        view = _pool_op(endpoint, pool, "read")[0]
        assert view.claims["poolnode1"].kind == "member" and view.claims["poolnode1"].job == f"low-{run_id}"
        pids = _train_to_step_3(a, b, train)
        b_pids = b.worker_pids()
        t_kill = sigkill_node(b)
        assert len(wait_dead(b_pids, t_kill, 10)) == len(b_pids)
        assert a.wait(240) == 0, a.log()[-5000:] + pool_node.log()[-3000:] + low.log()[-3000:]
        # the low job shrank to its own node, its workers resumed from their checkpoint (a membership change is no
        # failure: TORCHELASTIC_RESTART_COUNT stays, as under torchrun)
        _until(lambda: any(g["world"] == 2 and g["resumed"] > 0 for g in _gens(low_out)), 120,
               "the low job did not re-form on its own node", low, pool_node)
        (low_out / "go").touch()
        assert low.wait(120) == 0, low.log()[-5000:]
        return {"events": a.events(), "log": a.log(), "low_events": low.events(), "low_log": low.log(),
                "pids": pids, "b_pids": b_pids, "t_kill": t_kill, "train": train,
                "history": _pool_op(endpoint, pool, "read")[2]}
    finally:
        for j in (a, b, low):
            j.kill()
        stop_pool_node(pool_node)
        _pool_op(endpoint, pool, "delete")


def spare_node_run(tmp_path: Path, endpoint: str, run_id: str) -> dict:
    """The same high job and failure with a dedicated ``--spare-node`` of its own instead of the pool (the bench's
    comparison)."""
    train = str(tmp_path / "train")
    a, b, s = (Job.agent(str(tmp_path / n), train, endpoint=endpoint, run_id=run_id, nproc=2, steps=STEPS,
                         extra=["--spare-node"] if n == "s" else [], env={"TPASSRUN_RUN_KEY": RUN_KEY})
               for n in "abs")
    try:
        s.start()
        pids = _train_to_step_3(a, b, train)
        b_pids = b.worker_pids()
        t_kill = sigkill_node(b)
        assert a.wait(240) == 0, a.log()[-5000:]
        return {"events": a.events(), "log": a.log(), "pids": pids, "b_pids": b_pids, "t_kill": t_kill,
                "train": train}
    finally:
        for j in (a, b, s):
            j.kill()


def training_again(run: dict) -> float:
    """Seconds from the kill to the lost node's ranks training again (the leader's ``node_recovered``)."""
    return next(e["mono"] for e in run["events"] if e["event"] in ("node_recovered", "swap_resumed")) - run["t_kill"]


@pytest.mark.acceptance     # ~2 min on 2 loaded cores (the low job's start, both jobs' ends): past CI's budget;
                            # the same flow in one process runs in CI (tests/test_pool_preempt_node.py)
def test_a_higher_priority_job_preempts_a_lower_priority_member_on_the_pool_node(tmp_path, etcd_server, run_id,
                                                                                 reference_run):
    reference = reference_run(4, STEPS)
    run = preempt_run(tmp_path, etcd_server.endpoint, run_id)
    events, b_pids, pids = run["events"], run["b_pids"], run["pids"]
    preempting = [e for e in events if e["event"] == "pool_preempting"]
    assert preempting and preempting[0]["victim"] == f"low-{run_id}", run["log"][-4000:]
    claimed = [e for e in events if e["event"] == "pool_claimed"]
    assert claimed and claimed[0]["pool_node"] == "poolnode1"
    assert f"pre-empting pool node poolnode1 from job low-{run_id} (priority 1 < 5)" in run["log"]
    assert_bit_exact(Job(argv=[], out=run["train"]), reference, 4, relogged_by=b_pids)
    b_ranks = [r for r, pid in pids.items() if pid in b_pids]
    for r, pid in pids.items():
        if r not in b_ranks:
            assert {row["pid"] for row in Job(argv=[], out=run["train"]).losses(r)} == {pid}, f"survivor {r} moved"
    assert f"pool node poolnode1 taken back by job {run_id} (priority 5): shrinking to 1 nodes" in run["low_log"]
    assert not [e for e in run["low_events"] if e["event"] in ("pool_claimed", "pool_waiting", "pool_preempting")]
    assert "preempted" in [h.event for h in run["history"]], run["history"]
    print(f"\npre-emption: request {preempting[0]['mono'] - run['t_kill']:.2f} s, claim "
          f"{claimed[0]['mono'] - run['t_kill']:.2f} s, B's ranks training again {training_again(run):.2f} s after "
          f"B's SIGKILL (same host's monotonic clock)")
