"""A real Slurm (slurmctld, munged, three slurmd nodes n1-n3 on this host: tests/slurmcluster.py): jobs are
submitted with ``sbatch``, their one step is ``srun tpassrun --nproc-per-node 2 --spare-nodes 1 train_ddp.py`` with
no rendezvous flag, and the tests never start tpassrun themselves.

* A 2-node job with a spare node (n3) runs from the allocation alone; mid-run an operator drains the member n2
  (``scontrol update NodeName=n2 State=DRAIN Reason=maintenance``): its two ranks move to n3 live (planned swaps,
  the other ranks keep their processes), n2 is handed back to Slurm while the job runs (its agent leaves, the
  allocation shrinks to n1,n3: ``IDLE+DRAIN``), the job ends ``torch.equal`` to torchrun, the console says who
  asked and why, and the job's comment lists both swaps.
* The member n2 dies as a host does (its slurmd, slurmstepd, agent and ranks SIGKILLed at one instant): n3 takes
  its ranks live before Slurm's verdict; Slurm's DOWN later is no second loss; Slurm shows n2 down and drained with
  tpassrun's reason and the job's comment lists the recovery.
* ``scancel`` ends every process of a job (agents, ranks, spares, the hosted etcd) within seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from faults import EXAMPLE, Job, alive, assert_bit_exact, faults_env, hold_at
from slurmcluster import NODES, SLURMD_TIMEOUT, SlurmCluster, descendants, parent, unavailable

from tpassrun.rendezvous.embedded import _DIR_PREFIX as ETCD_DIR_PREFIX
from tpassrun.scheduler.watch import short

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

STEPS = 40


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
    except RuntimeError as exc:
        cluster.close()
        pytest.skip(f"Slurm did not start here: {exc}")
    yield cluster
    cluster.close()


@pytest.fixture
def slurm(slurm_cluster):
    """The module's cluster with every node schedulable again after the test (a drain must not hold the next)."""
    yield slurm_cluster
    slurm_cluster.run("scancel", "--full", "--user=root", check=False)
    for node in NODES:
        slurm_cluster.start_node(node)
    slurm_cluster.resume_all()


def _script(out: str, train: list[str], extra: str = "") -> str:
    """The batch script: one srun step, one tpassrun per node, no rendezvous flag (each node's health readings
    file, a site tool's, is named after the node)."""
    path = os.path.join(out, "job.sh")
    with open(path, "w") as fh:
        fh.write(f"""#!/bin/bash
srun --no-kill --ntasks-per-node 1 --output={out}/agent-%t.log bash -c 'TPASSRUN_HEALTH_FILE={out}/health-$SLURMD_NODENAME.json \\
    exec {sys.executable} -m tpassrun --nproc-per-node 2 --spare-nodes 1 --health-interval 0.5 --log-dir {out}/logs \\
    {extra}{' '.join(train)}'
echo $? > {out}/rc
""")
    return path


def _readings(out: str, node: str, ecc: int) -> None:
    path = os.path.join(out, f"health-{node}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"v": 1, "readings": [{"device": "gpu1", "metric": "ecc_uncorrected_volatile", "value": ecc}]}, fh)
    os.replace(path + ".tmp", path)


def _console(out: str) -> str:
    text = ""
    for name in sorted(os.listdir(out)):
        if name.startswith("agent-") and name.endswith(".log"):
            with open(os.path.join(out, name), errors="replace") as fh:
                text += fh.read()
    return text


def _wait(pred, timeout: float, what: str, slurm: SlurmCluster, out: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not in {timeout} s\n{_console(out)[-4000:]}\n{slurm.logs()[-2000:]}")
        time.sleep(0.2)


def _warm(job: Job) -> bool:
    events = job.events()
    spares = sum(len(e["slots"]) for e in events if e["event"] == "workers_started" and e.get("spare_node"))
    return bool(spares) and sum(1 for e in events if e["event"] == "spare_ready") >= spares


def _assert_moved_to_n3(train: Job, events: list[dict], placed: dict[int, tuple[str, int]], moved: list[int]) -> None:
    """Each moved rank ran in its first process, then in one of n3's spares; every other rank in one process."""
    pids: dict[int, list[int]] = {}
    for r in range(4):
        for row in train.losses(r):
            if not pids.setdefault(r, []) or pids[r][-1] != row["pid"]:
                pids[r].append(row["pid"])
    n3_spares = {s["pid"] for e in events if e["event"] == "workers_started" and short(e["node"]) == "n3"
                 for s in e["slots"]}
    for r in range(4):
        if r in moved:
            assert len(pids[r]) == 2 and pids[r][0] == placed[r][1] and pids[r][1] in n3_spares, (r, pids[r])
        else:
            assert pids[r] == [placed[r][1]], f"survivor rank {r} changed process: {pids[r]}"


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run(4, STEPS)


def _slurm_says(slurm: SlurmCluster, what: str) -> None:
    """What an operator sees at this moment (printed: docs/slurm.md's tables are these)."""
    print(f"--- {what}")
    for argv in (("sinfo",), ("squeue",), ("squeue", "-s")):
        print(f"$ {' '.join(argv)}\n{slurm.run(*argv, check=False).stdout.rstrip()}")
    print(f"$ scontrol show node n2 | grep State=\n   State={slurm.state('n2')} ...")


def test_a_drained_member_moves_its_ranks_to_the_spare_node_live_and_is_handed_back(slurm, tmp_path, reference):
    """The operator drains the member n2 mid-run. Its ranks move to the spare node n3 live; then the leader hands n2
    back to Slurm while the job runs: n2's agent leaves the job (exit 0, so the step's task there ends cleanly) and
    the allocation shrinks to n1,n3 (``scontrol update JobId= NodeList=``): Slurm shows n2 ``IDLE+DRAIN`` (sinfo
    ``drain``) and the job on 2 nodes, the job goes on and ends ``torch.equal`` to torchrun with srun's exit 0.
    n1 runs the batch script and the run's etcd: a drain of n1 would move its ranks but keep it in the job. When n2
    holds group rank 0 (the rendezvous' join order decides; seen in 1 run of 4), it runs the workers' store and
    stays in the job until it ends, drained, and the console says so: that path is checked instead."""
    out = str(tmp_path)
    early, late = hold_at(out, 1, name="early"), hold_at(out, STEPS - 3, name="late")
    env = {**faults_env(early.fault, late.fault), "TPASSRUN_SCHEDULER_POLL": "1"}
    _readings(out, "n1", 0)
    train = [EXAMPLE, "--steps", str(STEPS), "--step-sleep", "0.05", "--out", f"{out}/train", "--quiet"]
    job_id = slurm.sbatch(_script(out, train), "-N3", "--no-kill", f"--chdir={out}", f"--output={out}/batch.out",
                          env=env)
    logs = Job(argv=[], out=out)
    _wait(lambda: early.reached() and _warm(logs), 240, "the job held at step 1, the spare node warm", slurm, out)
    placed = {s["rank"]: (e["node"], s["pid"]) for e in logs.events() if e["event"] == "workers_started"
              for s in e["slots"] if s.get("rank") is not None and s["rank"] >= 0}
    on_n2 = sorted(r for r, (node, _pid) in placed.items() if node.startswith("n2-"))
    assert len(placed) == 4 and len(on_n2) == 2, placed
    # group rank 0 (the rendezvous' join order) runs the workers' store: a node holding it stays in the job
    store_on_n2 = 0 in on_n2

    slurm.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=maintenance")
    _slurm_says(slurm, "drain requested")
    early.release_after(logs, "swap_boundary")
    try:
        swaps = logs.wait_event("swap_resumed", 2, 240, distinct="swap_id")
        # the run -> Slurm: a health taint on the member n1 (its GPU 1's uncorrected ECC count rises; no spare is
        # left to take the rank, so the taint waits) drains n1 in Slurm with the reason; tpassctl untaint resumes it
        _readings(out, "n1", 2)
        _wait(lambda: slurm.node_field("n1", "Reason").startswith("tpassrun: gpu1: ") and "DRAIN" in slurm.state("n1"),
              120, "n1 drained in Slurm for its health taint", slurm, out)
        endpoint = next(e["endpoint"] for e in logs.events() if e["event"] == "etcd_hosted")
        untaint = subprocess.run([sys.executable, "-m", "tpassrun.ops.ctl", "untaint", "--rdzv-endpoint", endpoint,
                                  "--rdzv-id", job_id, "--node", "n1"], capture_output=True, text=True, timeout=60)
        assert untaint.returncode == 0, untaint.stderr
        _wait(lambda: "DRAIN" not in slurm.state("n1"), 120, "n1 resumed in Slurm after the untaint", slurm, out)
        # Slurm -> the run -> Slurm: n2, its ranks gone, handed back while the job still runs (held before its end)
        if store_on_n2:
            _wait(lambda: "stays in the job until the job ends: it runs the workers' store" in _console(out), 120,
                  "n2 kept in the job (it runs the workers' store)", slurm, out)
            assert "DRAIN" in slurm.state("n2") and slurm.job_field(job_id, "NodeList") == "n[1-3]"
        else:
            _wait(lambda: slurm.job_field(job_id, "NodeList") == "n[1,3]", 120, "the job shrunk to n1,n3", slurm,
                  out)
            assert slurm.state("n2") == "IDLE+DRAIN" and slurm.node_field("n2", "Reason").startswith("maintenance")
            assert slurm.job_field(job_id, "JobState") == "RUNNING" and slurm.job_field(job_id, "NumNodes") == "2"
            _slurm_says(slurm, "handed back (the job runs on n1, n3)")
    finally:
        late.release()
    _wait(lambda: os.path.exists(os.path.join(out, "rc")), 240, "the job's end", slurm, out)
    with open(os.path.join(out, "rc")) as fh:
        assert fh.read().strip() == "0", _console(out)[-4000:]

    train = Job(argv=[], out=os.path.join(out, "train"))
    assert_bit_exact(train, reference, 4)
    events = logs.events()
    _assert_moved_to_n3(train, events, placed, on_n2)
    console = _console(out)
    assert "Slurm drained n2 by root: maintenance: moving rank(s) " in console
    assert "drained n1 in Slurm: tpassrun: gpu1: " in console and "resumed n1 in Slurm" in console
    assert console.count("swapped and resumed") >= 2
    assert not [e for e in events if e["event"] == "node_lost"], "a node handed back is no loss"
    pauses = sorted({e["swap_id"]: e["seconds"] for e in swaps}.values())
    print(f"planned swap pauses after the Slurm drain: {', '.join(f'{p * 1000:.0f} ms' for p in pauses)}")
    if not store_on_n2:
        assert "handed back to the scheduler, leaving the job (Slurm drained n2 by root: maintenance" in console
        assert "handed n2 back to Slurm: the job runs on n1, n3" in console                      # the leader
        assert [short(e["lost_node"]) for e in events if e["event"] == "node_handed_back"] == ["n2"]
        assert not [n for n in os.listdir(out) if n.startswith("slurm_job_")], "scontrol's resize script left"
        asked = next(e["mono"] for e in events if e["event"] == "scheduler_event" and "handing n2 back" in e["message"])
        shrunk = next(e["mono"] for e in events if e["event"] == "scheduler_released")
        print(f"n2 handed back: its agent asked to leave, the allocation shrunk {shrunk - asked:.1f} s later")

    # Slurm's side: n2 drained (the operator's reason), out of the job; the job's comment lists the swaps
    assert slurm.state("n2") == "IDLE+DRAIN", slurm.state("n2")
    comment = slurm.job_field(job_id, "Comment")
    assert comment.startswith("tpassrun: 2 swap(s):") and comment.count("n2->n3") == 2, comment


def _first(pred, timeout: float, what: str, slurm: SlurmCluster, out: str) -> float:
    """``time.monotonic()`` when ``pred`` first held (polled every 0.1 s)."""
    _wait(pred, timeout, what, slurm, out)
    return time.monotonic()


@pytest.mark.acceptance     # 76-113 s here (the job, then Slurm's own DOWN ~25 s after the kill)
def test_a_member_node_killed_is_replaced_live_by_the_spare_node_and_slurm_says_what_happened(slurm, tmp_path,
                                                                                               reference):
    """The member n2 dies mid-run as a host does: its slurmd, the step's slurmstepd there, its agent and both its
    ranks SIGKILLed at one instant (n1 hosts the run's etcd and the batch script: it stays). The run does not wait
    for Slurm: n2's agent's port refuses (or its 3 s lease runs out), the spare node n3 takes its ranks live (one
    node recovery, the survivors keep their processes), the job ends ``torch.equal`` to torchrun. The leader drains
    n2 in Slurm (``tpassrun: lost by job ...``); Slurm's own verdict comes ~25 s later (its pings unanswered:
    DOWN, not responding) and changes nothing in the run: no second recovery. Slurm shows n2 DOWN and drained with
    tpassrun's reason, and the job's comment lists the recovery. ``--no-kill`` (sbatch and srun): Slurm keeps the
    job and its step when it loses the node."""
    out = str(tmp_path)
    early, late = hold_at(out, 1, name="early"), hold_at(out, STEPS - 3, name="late")
    env = {**faults_env(early.fault, late.fault), "TPASSRUN_SCHEDULER_POLL": "1"}
    train = [EXAMPLE, "--steps", str(STEPS), "--step-sleep", "0.05", "--out", f"{out}/train", "--quiet"]
    job_id = slurm.sbatch(_script(out, train, "--rdzv-conf lease_ttl=3 "), "-N3", "--no-kill",
                          f"--output={out}/batch.out", env=env)
    logs, losses = Job(argv=[], out=out), Job(argv=[], out=os.path.join(out, "train"))
    _wait(lambda: early.reached() and _warm(logs), 240, "the job held at step 1, the spare node warm", slurm, out)
    events = logs.events()
    assert [short(e["node"]) for e in events if e["event"] == "etcd_hosted"] == ["n1"]   # the first node's agent
    placed = {s["rank"]: (e["node"], s["pid"]) for e in events if e["event"] == "workers_started"
              for s in e["slots"] if s.get("rank") is not None and s["rank"] >= 0}
    moved = sorted(r for r, (node, _pid) in placed.items() if short(node) == "n2")
    assert len(placed) == 4 and len(moved) == 2, placed
    agent = next(int(e["node"].rsplit("-", 2)[1]) for e in events
                 if e["event"] == "agent_started" and short(e["node"]) == "n2")
    stepd = parent(agent)
    with open(f"/proc/{stepd}/comm") as fh:
        assert fh.read().strip() == "slurmstepd", "n2's agent is not the step's task"
    assert {placed[r][1] for r in moved} <= set(descendants(stepd)), (descendants(stepd), placed)

    early.release()
    try:
        _wait(lambda: all(losses.step_reached(r) >= 4 for r in range(4)), 240, "the run at step 4", slurm, out)
        n2_pids = [stepd, *descendants(stepd)]
        killed = slurm.kill_node("n2", n2_pids)
        _wait(lambda: any(e["event"] == "node_recovered" for e in logs.events()), 240, "n2's ranks recovered on n3",
              slurm, out)
        said_down = _first(lambda: "DOWN" in slurm.state("n2"), 120, "Slurm marking n2 DOWN", slurm, out)
        # the leader's poll that saw Slurm's DOWN of a node the run lost already is done: nothing to do but log it
        _wait(lambda: any(e["event"] == "scheduler_node" and e["sched_node"] == "n2" and "DOWN" in e["state"]
                          for e in logs.events()), 60, "the leader's poll of n2 DOWN", slurm, out)
    finally:
        late.release()
    _wait(lambda: os.path.exists(os.path.join(out, "rc")), 240, "the job's end", slurm, out)
    with open(os.path.join(out, "rc")) as fh:
        assert fh.read().strip() == "0", _console(out)[-4000:]

    events = logs.events()
    caught_up = [(e["rank"], e["step"]) for e in events if e["event"] == "rank_caught_up"]
    assert_bit_exact(losses, reference, 4, relogged_by=n2_pids, caught_up=caught_up)
    _assert_moved_to_n3(losses, events, placed, moved)
    recovered = {e["swap_id"]: e for e in events if e["event"] == "node_recovered"}
    assert len(recovered) == 1, recovered          # one recovery: Slurm's DOWN of the lost node was no second one
    [rec] = recovered.values()
    assert sorted(rec["ranks"]) == moved, rec
    console = _console(out)
    assert "recovered live on n3" in console and "whole-group restart" not in console.split("summary:")[0]
    assert f"drained n2 in Slurm: tpassrun: lost by job {job_id}: its agent stopped answering" in console
    lost_at = min(e["mono"] for e in events if e["event"] == "node_lost")
    print(f"n2 killed (slurmd, slurmstepd, agent, ranks): declared lost after {lost_at - killed:.1f} s, training "
          f"resumed on n3 {rec['mono'] - killed:.1f} s after the kill (paused {rec['seconds']:.1f} s); Slurm said DOWN "
          f"{said_down - killed:.1f} s after the kill (SlurmdTimeout={SLURMD_TIMEOUT}); the workers' store "
          f"{'moved off n2' if any(e['event'] == 'store_moved' for e in events) else 'was not on n2'}")

    # Slurm's side: n2 down (not responding) and drained with tpassrun's reason; the job's comment has the recovery
    state = slurm.state("n2")
    assert "DOWN" in state and "DRAIN" in state and ("NOT_RESPONDING" in state or "*" in state), state
    assert slurm.node_field("n2", "Reason").startswith(f"tpassrun: lost by job {job_id}: its agent stopped answering")
    comment = slurm.job_field(job_id, "Comment")
    assert comment.startswith("tpassrun: 1 swap(s):") and "recovery" in comment and comment.count("n2->n3") == 2, \
        comment
    for pid in n2_pids:
        assert not alive(pid), pid


SLEEPER = """import os, sys, time
open(os.path.join(sys.argv[1], "rank%s" % os.environ["RANK"]), "w").close()
while True:
    time.sleep(0.1)
"""


def test_scancel_ends_every_process_of_the_job(slurm, tmp_path):
    """Workers that never end (a script without torch, so the job starts in seconds): ``scancel`` is the only way
    out, and it takes the agents, the ranks, the spare node's spares and the etcd the first node hosts."""
    out = str(tmp_path)
    script = os.path.join(out, "sleeper.py")
    with open(script, "w") as fh:
        fh.write(SLEEPER)
    job_id = slurm.sbatch(_script(out, [script, out]), "-N3", f"--output={out}/batch.out")
    logs = Job(argv=[], out=out)

    def running() -> bool:
        started = {e["node"] for e in logs.events() if e["event"] == "workers_started"}
        return len(started) == 3 and all(os.path.exists(os.path.join(out, f"rank{r}")) for r in range(4))

    _wait(running, 240, "the job running", slurm, out)
    events = logs.events()
    agents = [int(e["node"].rsplit("-", 2)[1]) for e in events if e["event"] == "agent_started"]   # host-pid-rand
    workers = [s["pid"] for e in events if e["event"] == "workers_started" for s in e["slots"]]
    etcd = [e for e in events if e["event"] == "etcd_hosted"]
    assert len(agents) == 3 and len(workers) == 6 and len(etcd) == 1, (agents, workers, etcd)
    host, port = etcd[0]["endpoint"].rsplit(":", 1)
    cancelled = time.monotonic()
    slurm.run("scancel", job_id)
    gone = None
    while time.monotonic() - cancelled < 60:
        if not any(alive(p) for p in agents + workers):
            gone = time.monotonic() - cancelled
            break
        time.sleep(0.1)
    assert gone is not None, [p for p in agents + workers if alive(p)]
    print(f"scancel: every agent and worker gone {gone:.2f} s after it")
    with socket.socket() as s:
        assert s.connect_ex((host, int(port))) != 0, "the hosted etcd still answers"
    # the job ran with this test's $TMPDIR (sbatch exports the environment): the hosted etcd's data dir went too
    left = [n for n in os.listdir(os.environ["TMPDIR"]) if n.startswith(ETCD_DIR_PREFIX)]
    assert not left, left
    _wait(lambda: not slurm.run("squeue", "-h", "-j", job_id, check=False).stdout.strip(), 60, "the job leaving squeue",
          slurm, out)
