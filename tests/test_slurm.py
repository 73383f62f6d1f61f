"""Slurm without Slurm: the host-list and ``scontrol show node -o`` parsers, a step's allocation as rendezvous
settings (explicit flags win), and the scheduler watcher's decisions (``tpassrun.scheduler.watch.decide``), all pure.
The real Slurm runs in ``tests/test_slurm_e2e.py``."""

from __future__ import annotations

import pytest

from tpassrun.launch.config import ConfigError, parse_args
from tpassrun.records import HandBack, Move, Phase, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect
from tpassrun.rendezvous import NodeInfo
from tpassrun.scheduler import NodeState, SchedJob, SchedNode
from tpassrun.scheduler.slurm import (
    Allocation,
    allocation_from_env,
    expand_hostlist,
    parse_job,
    parse_node_line,
    parse_nodes,
    plan_launch,
)
from tpassrun.scheduler.watch import (
    Annotate,
    DeclareLost,
    DeleteTaints,
    Drain,
    HandBackNode,
    KeepNode,
    ReleaseNodes,
    ResumeNode,
    TaintSlot,
    Tell,
    View,
    decide,
    job_comment,
    slurm_taint_id,
)


# ------------------------------------------------------------------------------------------- parsers
@pytest.mark.parametrize("text,names", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,5],login", ["n1", "n2", "n5", "login"]),
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
    ("r[1-2]n[3-4]", ["r1n3", "r1n4", "r2n3", "r2n4"]),
    ("a-[1-2]-ib,b", ["a-1-ib", "a-2-ib", "b"]),
])
def test_host_lists_expand_as_scontrol_show_hostnames_does(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("bad", ["n[1-3", "n[3-1]", "n[a-b]"])
def test_a_host_list_it_cannot_read_is_a_value_error(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


LINE = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=2 CPUEfctv=2 CPUTot=2 CPULoad=2.71 NodeAddr=127.0.0.1 "
        "NodeHostName=localhost Port=16821 Version=22.05.8 OS=Linux 6.18.44 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1 "
        "State={state} ThreadsPerCore=1 Partitions=debug CfgTRES=cpu=2,mem=1M,billing=2 AllocTRES= CapWatts=n/a{reason}")


@pytest.mark.parametrize("state,expected", [
    ("IDLE", NodeState.UP), ("ALLOCATED", NodeState.UP), ("MIXED", NodeState.UP),
    ("ALLOCATED+DRAIN", NodeState.DRAIN), ("IDLE+DRAIN", NodeState.DRAIN),
    ("DOWN", NodeState.DOWN), ("DOWN*", NodeState.DOWN), ("IDLE+NOT_RESPONDING", NodeState.UP), ("IDLE*", NodeState.UP),
    ("DOWN+DRAIN", NodeState.DOWN), ("", NodeState.UNKNOWN),
])
def test_node_states_read_as_up_drain_or_down(state, expected):
    node = parse_node_line(LINE.format(state=state, reason=""))
    assert node is not None and node.name == "n1" and node.state is expected and node.raw_state == state


def test_the_reason_keeps_its_spaces_and_equal_signs_and_says_who_set_it():
    node = parse_node_line(LINE.format(state="ALLOCATED+DRAIN",
                                       reason=" Reason=firmware x=1 [admin@2026-11-28T22:13:58]"))
    assert node == SchedNode("n1", NodeState.DRAIN, reason="firmware x=1", who="admin", raw_state="ALLOCATED+DRAIN",
                             drain=True)
    assert parse_nodes(LINE.format(state="IDLE", reason="") + "\n\nnonsense\n").keys() == {"n1"}


# ------------------------------------------------------------------------------------------- the allocation
STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n2", "SLURM_STEP_NODELIST": "n[1-3]",
        "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_STEP_NUM_TASKS": "3"}


def test_an_srun_step_is_an_allocation_and_the_batch_script_is_not():
    assert allocation_from_env(STEP) == Allocation("77", ("n1", "n2", "n3"), "n2", 3)
    batch = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    assert allocation_from_env(batch) is None
    assert allocation_from_env({}) is None


def test_the_last_k_nodes_are_spare_nodes_and_the_first_hosts_etcd():
    alloc = Allocation("1234", ("a", "b", "c"), "c", 3)
    launch = plan_launch(alloc, 1)
    assert (launch.run_id, launch.members, launch.spare_node, launch.first_node, launch.port) == \
        ("1234", 2, True, "a", 29400 + 234)
    assert not plan_launch(Allocation("1234", ("a", "b", "c"), "b", 3), 1).spare_node


@pytest.mark.parametrize("alloc,k,words", [
    (Allocation("1", ("a", "b"), "a", 4), 0, "one tpassrun per node"),
    (Allocation("1", ("a", "b"), "a", 2), 2, "at least one must be a member"),
    (Allocation("1", ("a", "b"), "z", 2), 0, "not in the step's node list"),
])
def test_layouts_it_cannot_run_are_one_line_errors(alloc, k, words):
    with pytest.raises(ValueError, match=words):
        plan_launch(alloc, k)


def _parse(argv, env):
    return parse_args([*argv, "train.py"], env, address_of=lambda name: f"{name}.cluster")


def test_no_rendezvous_flags_inside_a_step():
    cfg = _parse(["--nproc-per-node", "2", "--spare-nodes", "1"], STEP)
    assert (cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes, cfg.rdzv_backend, cfg.rdzv_endpoint) == \
        ("77", 2, 2, "c10d", "n1.cluster:29477")
    assert cfg.etcd_endpoint == "n1.cluster:29477" and not cfg.host_etcd and not cfg.spare_node
    assert (cfg.scheduler, cfg.node_name) == ("slurm", "n2")
    # the first node hosts the run's etcd, and only it (slurmd nodes sharing one host all have n1's address)
    assert _parse(["--spare-nodes", "1"], {**STEP, "SLURMD_NODENAME": "n1"}).host_etcd
    # an endpoint given on the command line: torchrun's rule (the agent where it is local hosts it)
    assert _parse(["--rdzv-backend", "c10d", "--rdzv-endpoint", "n9:29400"], STEP).host_etcd
    last = _parse(["--spare-nodes", "1"], {**STEP, "SLURMD_NODENAME": "n3"})
    assert last.spare_node
    assert _parse([], {**STEP, "TPASSRUN_SPARE_NODES": "1", "SLURMD_NODENAME": "n3"}).spare_node
    assert _parse(["--rdzv-backend", "c10d"], STEP).etcd_endpoint == "n1.cluster:29477"


def test_explicit_flags_win_over_the_allocation():
    cfg = _parse(["--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd.site:2379", "--rdzv-id", "mine",
                  "--nnodes", "1:3"], STEP)
    assert (cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes, cfg.etcd_endpoint, cfg.host_etcd) == \
        ("mine", 1, 3, "etcd.site:2379", False)
    assert cfg.scheduler == "slurm"   # the watcher runs all the same
    assert _parse(["--standalone"], STEP).standalone
    assert _parse(["--scheduler", "none"], STEP).scheduler == ""
    outside = _parse([], {})
    assert (outside.scheduler, outside.standalone) == ("", True)


def test_a_one_node_step_keeps_torchruns_single_node_behaviour():
    one = {**STEP, "SLURM_STEP_NODELIST": "n2", "SLURM_STEP_NUM_TASKS": "1"}
    cfg = _parse([], one)
    assert cfg.standalone and cfg.uses_embedded_etcd and cfg.node_name == "n2"


@pytest.mark.parametrize("argv,env,words", [
    (["--spare-nodes", "1"], {}, "need a Slurm step"),
    (["--scheduler", "slurm"], {}, "need a Slurm step"),
    (["--spare-nodes", "3"], STEP, "at least one must be a member"),
    (["--spare-nodes", "-1"], STEP, ">= 0"),
    (["--spare-nodes", "1", "--scheduler", "none"], STEP, "needs the Slurm allocation"),
])
def test_bad_slurm_settings_are_config_errors(argv, env, words):
    with pytest.raises(ConfigError, match=words):
        _parse(argv, env)


# ------------------------------------------------------------------------------------------- the watcher
A, B, C = "n1-100-aaaa", "n2-200-bbbb", "n3-300-cccc"
AGENTS = {A: NodeInfo(A, "h", 2), B: NodeInfo(B, "h", 2), C: NodeInfo(C, "h", 2, spare_node=True)}
HOMES = {0: (A, 0), 1: (A, 1), 2: (B, 0), 3: (B, 1)}


def _view(sched: dict[str, tuple[NodeState, str, str] | SchedNode], **kw) -> View:
    nodes = {n: v if isinstance(v, SchedNode) else SchedNode(n, v[0], reason=v[1], who=v[2], raw_state=v[0].value.upper())
             for n, v in sched.items()}
    base = dict(sched=nodes, agents=AGENTS, homes=HOMES, counted=frozenset({A, B, C}), job_id="77", now=5.0)
    base.update(kw)
    return View(**base)


UP = (NodeState.UP, "", "")


def test_a_drain_by_an_operator_migrates_the_nodes_ranks_and_says_who_and_why():
    actions = decide(_view({"n1": (NodeState.DRAIN, "firmware", "root"), "n2": UP, "n3": UP}))
    assert actions[0] == Tell("Slurm drained n1 by root: firmware: moving rank(s) 0, 1 to spares")
    taints = [a.taint for a in actions if isinstance(a, TaintSlot)]
    assert [(t.id, t.node_id, t.slot, t.rank, t.effect, t.source) for t in taints] == [
        (slurm_taint_id(A, 0), A, 0, 0, TaintEffect.MIGRATE, "scheduler"),
        (slurm_taint_id(A, 1), A, 1, 1, TaintEffect.MIGRATE, "scheduler")]
    assert taints[0].reason == "Slurm drained n1 by root: firmware"
    # written once: the next poll finds them
    again = decide(_view({"n1": (NodeState.DRAIN, "firmware", "root"), "n2": UP, "n3": UP}, taints=taints))
    assert again == []


def test_a_drained_spare_node_has_its_slots_set_aside():
    actions = decide(_view({"n3": (NodeState.DRAIN, "", "")}))
    assert actions[0] == Tell("Slurm drained n3 by an operator: no reason given: its spares set aside")
    assert [(a.taint.slot, a.taint.rank) for a in actions if isinstance(a, TaintSlot)] == [(0, None), (1, None)]


def test_resume_lifts_the_drain_taints():
    taints = [Taint(slurm_taint_id(A, s), TaintEffect.MIGRATE, "x", "scheduler", node_id=A, slot=s) for s in (0, 1)]
    actions = decide(_view({"n1": UP}, taints=taints))
    assert actions == [DeleteTaints("n1", (slurm_taint_id(A, 0), slurm_taint_id(A, 1))),
                       Tell("Slurm resumed n1: its slots serve as spares again")]


def test_down_declares_a_node_the_run_counts_on_lost_once():
    actions = decide(_view({"n2": (NodeState.DOWN, "Not responding", "slurm")}))
    assert [type(a) for a in actions] == [DeclareLost] and actions[0].node_id == B
    assert "declared lost now" in actions[0].reason


def test_down_after_the_run_lost_the_node_is_no_second_loss_and_the_node_stays_drained():
    """The run loses a killed node before Slurm's verdict (its lease, or its agent's port refusing): the leader
    drains it while Slurm still calls it up (not responding); Slurm's DOWN later changes nothing. A DOWN that came
    first is drained too, with Slurm's reason kept: else the node returns to service when its slurmd is back."""
    lost = frozenset({B})
    ours = "tpassrun: lost by job 77: its agent stopped answering"
    assert decide(_view({"n2": UP}, lost=lost)) == [Drain("n2", ours)]
    down_drained = {"n2": SchedNode("n2", NodeState.DOWN, reason=ours, who="root",
                                    raw_state="DOWN+DRAIN+NOT_RESPONDING", drain=True)}
    assert decide(_view(down_drained, lost=lost)) == []
    assert decide(_view(down_drained, lost=lost, counted=frozenset({A, C}))) == []
    assert decide(_view({"n2": (NodeState.DOWN, "Not responding", "slurm")}, lost=lost)) == [
        Drain("n2", ours + " (Slurm: Not responding)")]
    # the node's recovery done, no generation names it any more: its recovery plan still says it was lost
    gone = dict(agents={A: AGENTS[A], C: AGENTS[C]}, homes={0: (A, 0), 1: (A, 1), 2: (C, 0), 3: (C, 1)},
                counted=frozenset({A, C}), swaps=[_plan("n-1", SwapKind.NODE, 1.0, 1.8, lost_node=B)])
    assert [a for a in decide(_view({"n2": UP}, **gone)) if isinstance(a, Drain)] == [Drain("n2", ours)]
    assert [a for a in decide(_view(down_drained, **gone)) if not isinstance(a, Annotate)] == []
    line = LINE.format(state="DOWN+DRAIN+NOT_RESPONDING", reason=f" Reason={ours} [root@2026-11-29T01:47:57]")
    assert parse_nodes(line)["n1"].drain and not parse_nodes(LINE.format(state="DOWN*", reason=""))["n1"].drain


def test_a_health_taint_or_a_lost_node_drains_the_node_in_slurm_and_untaint_resumes_it():
    health = Taint("h-1", TaintEffect.MIGRATE, "gpu3: 12 correctable ECC errors in 60 s", "health", node_id=B, slot=0)
    assert decide(_view({"n2": UP}, taints=[health])) == [Drain("n2", "tpassrun: gpu3: 12 correctable ECC errors in 60 s")]
    ours = (NodeState.DRAIN, "tpassrun: gpu3: 12 correctable ECC errors in 60 s", "root")
    assert decide(_view({"n2": ours}, taints=[health])) == []          # our own drain is no operator's drain
    assert decide(_view({"n2": ours})) == [ResumeNode("n2", "no health taint holds it any more")]
    assert decide(_view({"n2": UP}, lost=frozenset({B}))) == [Drain("n2", "tpassrun: lost by job 77: its agent stopped "
                                                                          "answering")]
    lost_drained = (NodeState.DRAIN, "tpassrun: lost by job 77: its agent stopped answering", "root")
    assert decide(_view({"n2": lost_drained}, lost=frozenset({B}))) == []
    assert decide(_view({"n2": UP}, taints=[health], refused=frozenset({"n2"}))) == []


def _plan(sid: str, kind: SwapKind, t0: float, t1: float, **kw) -> SwapPlan:
    base = dict(id=sid, kind=kind, generation=0, leaver=SlotRef(A, 0, 0), joiner=SlotRef(C, 0, 0), donor=None,
                phase=Phase.DONE, reason="Slurm drained n1 by root: firmware", nodes=(A, B, C),
                history=(("pause", t0), ("done", t1)))
    base.update(kw)
    return SwapPlan(**base)


def test_the_job_comment_lists_the_swaps_done_and_is_written_when_it_changes():
    node_plan = _plan("s-2", SwapKind.NODE, 20.0, 21.5, reason="node n2 lost",
                      moves=(Move(SlotRef(B, 0, 2), SlotRef(C, 0, 2)), Move(SlotRef(B, 1, 3), SlotRef(C, 1, 3))))
    swaps = [node_plan, _plan("s-1", SwapKind.PLANNED, 10.0, 10.75), _plan("s-0", SwapKind.PLANNED, 1, 2,
                                                                            phase=Phase.ABORTED)]
    text = job_comment(swaps)
    assert text == ("tpassrun: 2 swap(s): s-1 planned rank 0 n1->n3 0.8s (Slurm drained n1 by root: firmware); "
                    "s-2 recovery rank 2 n2->n3, rank 3 n2->n3 1.5s (node n2 lost)")
    assert decide(_view({}, swaps=swaps)) == [Annotate(text)]
    assert decide(_view({}, swaps=swaps, comment=text)) == []
    assert job_comment([]) == ""


# ------------------------------------------------------------------------------------------- handing a node back
JOB = SchedJob(nodes=("n1", "n2", "n3"), batch_host="n1")
MOVED = {0: (A, 0), 1: (A, 1), 2: (C, 0), 3: (C, 1)}        # n2's ranks moved to the spare node n3
N2_TAINTS = [Taint(slurm_taint_id(B, s), TaintEffect.MIGRATE, "Slurm drained n2 by root: firmware", "scheduler",
                   node_id=B, slot=s, rank=2 + s, handled_by=f"s-{s}") for s in (0, 1)]
ASKED = "Slurm drained n2 by root: firmware; no rank runs there any more"


def _n2(state=(NodeState.DRAIN, "firmware", "root"), **kw) -> View:
    base = dict(homes=MOVED, taints=N2_TAINTS, job=JOB, etcd_node="n1", store_host=A)
    base.update(kw)
    return _view({"n1": UP, "n2": state, "n3": UP}, **base)


def test_parse_job_reads_the_allocation_and_the_batch_host():
    line = ("JobId=7 JobName=job.sh UserId=root(0) JobState=RUNNING Reason=None NodeList=n[1-3] BatchHost=n1 "
            "NumNodes=3 NumCPUs=6 Comment=tpassrun: 1 swap(s): s-1 planned rank 2 n2->n3")
    assert parse_job(line) == SchedJob(nodes=("n1", "n2", "n3"), batch_host="n1")
    with pytest.raises(ValueError):
        parse_job("JobId=7 JobState=PENDING NodeList=(null) BatchHost=(null)")


def test_a_drained_node_whose_ranks_left_is_handed_back_then_taken_out_of_the_job():
    """Slurm's rule (measured on 22.05): ``scontrol update JobId= NodeList=<the others>`` SIGKILLs the step's tasks
    still on the node taken out (srun then exits 137), so the node's agent leaves first (exit 0: its task ends
    cleanly) and the allocation shrinks only once its registration is gone at two polls in a row."""
    assert decide(_n2()) == [HandBackNode("n2", (B,), ASKED)]
    asked = {B: HandBack(node="n2", reason=ASKED, time=5.0)}
    assert decide(_n2(handbacks=asked)) == []                                   # its agent is still there
    left = dict(handbacks=asked, agents={A: AGENTS[A], C: AGENTS[C]})
    assert decide(_n2(**left)) == []                                            # gone at one poll only
    assert decide(_n2(**left, gone=frozenset({B}))) == [
        ReleaseNodes(("n2",), ("n1", "n3"), "n2: drained, no rank or agent of the job there any more")]
    shrunk = dict(left, gone=frozenset({B}), job=SchedJob(("n1", "n3"), "n1"), lost=frozenset({B}))
    assert decide(_n2(**shrunk)) == []                                          # done; its leaving is no loss
    assert decide(_n2(**shrunk, refused=frozenset({"release:n2"}))) == []
    assert decide(_n2(**dict(shrunk, job=JOB), refused=frozenset({"release:n2"}))) == []   # refused: said once
    # the operator resumes it: the job's taints go, it is not drained as lost, and the console does not say it serves
    resumed = decide(_n2(UP, **shrunk))
    assert resumed == [DeleteTaints("n2", tuple(t.id for t in N2_TAINTS)),
                       Tell("Slurm resumed n2: handed back to Slurm before, it is no longer the job's")]


def test_a_drained_node_is_not_handed_back_while_a_rank_runs_there_or_a_swap_is_under_way():
    assert decide(_n2(homes=HOMES)) == []                 # its ranks are still moving (taints written already)
    in_flight = _plan("s-9", SwapKind.PLANNED, 1.0, 1.5, phase=Phase.TRANSFER)
    assert decide(_n2(swaps=[in_flight])) == []
    assert decide(_n2(job=None)) == []                    # the allocation not read this poll
    assert decide(_n2(job=SchedJob(("n1", "n3"), "n1"))) == []    # no longer the job's


@pytest.mark.parametrize("kw,why", [
    (dict(job=SchedJob(("n1", "n2", "n3"), "n2")), "it runs the job's batch script (Slurm cannot take the batch host "
                                                   "out of a job)"),
    (dict(etcd_node="n2"), "it hosts the run's etcd"),
    (dict(store_host=B), "it runs the workers' store"),
])
def test_a_drained_node_the_job_cannot_do_without_stays_and_the_console_says_why(kw, why):
    assert decide(_n2(**kw)) == [KeepNode("n2", "Slurm drained n2: no rank runs there any more, but it stays in the "
                                                f"job until the job ends: {why}")]
