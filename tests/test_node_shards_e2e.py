"""A whole node of a sharded job lost, recovered live: examples/train_ddp.py --zero (ZeroAdamW, ZeRO-1 by hand:
each rank holds the AdamW state of one slice of the parameters only, tracked with ``sess.track_sharded``) on two
nodes of 2 ranks and a ``--spare-node``. Node B (its agent and workers) dies at a random point of a step; no
survivor holds B's slices, B's buddy (A) does, in its shard mirror: C's joiners fetch them from there, the model
and scheduler from A's ranks, and everyone resumes (rolled back to a common copy when B's last refresh had not
landed). Survivors keep their processes; the final state is torch.equal to plain torchrun."""

from __future__ import annotations

import random
import sys

import pytest
from faults import EXAMPLE, Job, faults_env
from test_node_loss_e2e import _pids_by_rank, _start
from test_shard_e2e import assert_same_run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(360)]

STEPS = 24
ARGS = ["--zero"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Job:
    out = str(tmp_path_factory.mktemp("ref"))
    job = Job(argv=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    EXAMPLE, "--steps", str(STEPS), "--step-sleep", "0", "--out", out, "--quiet", *ARGS],
              out=out).start()
    assert job.wait(240) == 0, job.log()[-3000:]
    return job


def test_a_lost_nodes_shards_come_back_from_its_buddys_mirror(tmp_path, etcd_server, run_id, reference):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    step, where = rng.randint(4, STEPS // 2), rng.choice(("step", "forward", "backward", "after_opt", "user"))
    print(f"seed {seed}: node B dies at step {step}, {where}")
    train = str(tmp_path / "train")
    release = str(tmp_path / "release")
    hold = {"rank": 0, "step": 1, "where": "step", "action": "hold", "release": release}
    die = faults_env(hold, *({"rank": r, "step": step, "where": where, "action": "kill_node",
                              "marker": str(tmp_path / "died")} for r in range(4)))
    jobs = {n: Job.agent(str(tmp_path / n), train, endpoint=etcd_server.endpoint, run_id=run_id, steps=STEPS,
                         step_sleep=0.05, extra=["--spare-node"] if n == "c" else [],
                         env=die if n == "b" else faults_env(hold)) for n in "abc"}
    for j in jobs.values():
        j.argv += ARGS
    a, b, c = jobs["a"], jobs["b"], jobs["c"]
    try:
        _start(a, b, c)                   # the job waits at step 1 until C's spares are warm
        b_pids = b.worker_pids()
        open(release, "w").close()
        assert b.proc is not None
        b.proc.wait(240)
        assert a.wait(240) == 0, a.log()[-3000:]
        assert c.wait(60) == 0, c.log()[-3000:]
    finally:
        for j in jobs.values():
            j.kill()
    assert_same_run(Job(argv=[], out=train), reference, 4)
    pids = _pids_by_rank(train, 4)
    lost = sorted(r for r, p in pids.items() if p[0] in b_pids)
    assert len(lost) == 2
    c_pids = {s["pid"] for e in c.events() if e["event"] == "workers_started" for s in e["slots"]}
    for r in range(4):
        if r in lost:
            assert len(pids[r]) == 2 and pids[r][1] in c_pids, (r, pids[r])
        else:
            assert len(pids[r]) == 1, f"survivor rank {r} changed process: {pids[r]}"
    recovered = [e for e in c.events() if e["event"] == "node_recovered"]
    assert recovered and sorted(recovered[0]["ranks"]) == lost
    assert "fallback to torchrun's whole-group restart" not in a.log() + c.log()
    shards = [e for j in (a, c) for e in j.events() if e["event"] == "swap_phase" and e.get("phase") == "transfer"]
    assert shards and "shard mirror" in shards[0]["reason"] or "rolls back" in shards[0]["reason"], shards
