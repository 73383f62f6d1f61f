"""Slurm: the allocation a ``srun tpassrun ...`` step runs in, and the plugin that watches and updates it.

Inside an allocation (``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` set by ``srun``) tpassrun needs no rendezvous flags:
:func:`allocation_from_env` reads the step's nodes and this node's name, :func:`plan_launch` (pure) decides the run
id (the job id), the member count (the step's nodes minus ``--spare-nodes K``: the last K nodes are spare nodes) and
where the run's etcd lives (the first node, on port ``29400 + job id % 1000``, hosted there by its agent as the c10d
backend does). Every value a flag gives wins.

:class:`SlurmPlugin` is the :class:`~tpassrun.scheduler.base.SchedulerPlugin` over ``scontrol``: one
``scontrol show node -o`` call for all the job's nodes per poll, ``scontrol update NodeName=`` to drain and resume,
``scontrol update JobId= Comment=`` for the job's record, ``scontrol show job -o`` and ``scontrol update JobId=
NodeList=`` to hand a drained node back (the job's allocation shrunk to the others). The parsers
(:func:`expand_hostlist`, :func:`parse_nodes`, :func:`parse_job`) are pure.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from tpassrun.scheduler.base import NodeState, SchedJob, SchedNode, SchedulerError
from tpassrun.settings import envnames as E

C10D_DEFAULT_PORT = 29400      # torchrun's c10d default; a job's etcd port is this + job id % PORT_SPREAD
PORT_SPREAD = 1000             # two jobs sharing a first node (shared nodes) get different ports
SCONTROL_TIMEOUT_S = 30.0
COMMENT_MAX = 900              # Slurm keeps a job comment short; the newest swaps are kept


# ------------------------------------------------------------------------------------------- pure parsers
def _split_top(text: str) -> list[str]:
    """``a[1-2],b`` -> ``["a[1-2]", "b"]``: commas outside brackets separate host expressions."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    out.append(cur)
    return [x.strip() for x in out if x.strip()]


def _range(spec: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]`` (zero padding kept, as Slurm does)."""
    out: list[str] = []
    for part in spec.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in a host list")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"bad range {part!r} in a host list")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``n[1-3,5],gpu[01-02]-ib``) -> names, in order (``scontrol show
    hostnames`` without Slurm). Several bracket groups in one name expand as their product."""
    names: list[str] = []
    for item in _split_top(text):
        parts = re.split(r"(\[[^\]]*\])", item)
        expanded = [""]
        for p in parts:
            choices = _range(p[1:-1]) if p.startswith("[") else [p]
            expanded = [e + c for e in expanded for c in choices]
        names += expanded
    return names


_REASON_WHO = re.compile(r"^(?P<reason>.*?)\s*\[(?P<who>[^@\]]+)@[^\]]*\]\s*$")
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_]*)=")


def _flags(raw: str) -> set[str]:
    return set(raw.upper().rstrip("*").replace("+", " ").split())


def node_state(raw: str) -> NodeState:
    """Slurm's ``State=`` (``ALLOCATED+DRAIN``, ``IDLE*``, ``DOWN+NOT_RESPONDING``...) -> up, drain or down.
    Not responding (``*``, ``+NOT_RESPONDING``) alone is not down: Slurm itself waits ``SlurmdTimeout`` before it
    says DOWN, and a lease revoked on a missed ping would take a live node's ranks away."""
    flags = _flags(raw)
    if flags & {"DOWN", "FAIL", "FAILING"}:
        return NodeState.DOWN
    if flags & {"DRAIN", "DRAINING", "DRAINED"}:
        return NodeState.DRAIN
    return NodeState.UP if raw else NodeState.UNKNOWN


def parse_node_line(line: str) -> SchedNode | None:
    """One line of ``scontrol show node -o``. ``Reason=`` is the last field and may hold spaces and ``=``;
    the other values have no spaces that matter here."""
    head, sep, reason_text = line.partition(" Reason=")
    fields: dict[str, str] = {}
    matches = list(_FIELD.finditer(head))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(head)
        fields[m.group(1)] = head[m.end():end].strip()
    name = fields.get("NodeName")
    if not name:
        return None
    reason, who = reason_text.strip(), ""
    if sep:
        by = _REASON_WHO.match(reason)
        if by:
            reason, who = by.group("reason"), by.group("who")
    raw = fields.get("State", "")
    return SchedNode(name=name, state=node_state(raw), reason=reason if sep else "", who=who, raw_state=raw,
                     drain=bool(_flags(raw) & {"DRAIN", "DRAINING", "DRAINED"}))


def parse_nodes(text: str) -> dict[str, SchedNode]:
    out = {}
    for line in text.splitlines():
        node = parse_node_line(line.strip())
        if node is not None:
            out[node.name] = node
    return out


def parse_job(text: str) -> SchedJob:
    """``scontrol show job -o <id>`` -> the job's nodes and batch host. Raises ValueError without a node list."""
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    nodes = fields.get("NodeList", "")
    if not nodes or nodes == "(null)":
        raise ValueError("the job has no node list (not running?)")
    host = fields.get("BatchHost", "")
    return SchedJob(nodes=tuple(expand_hostlist(nodes)), batch_host="" if host == "(null)" else host)


def node_addr(line: str) -> str | None:
    m = re.search(r"(?:^|\s)NodeAddr=(\S+)", line)
    return m.group(1) if m else None


# ------------------------------------------------------------------------------------------- the allocation
@dataclass(frozen=True)
class Allocation:
    """The srun step this agent runs in."""

    job_id: str
    nodes: tuple[str, ...]       # the step's nodes, in Slurm's order
    node_name: str               # this node (SLURMD_NODENAME)
    tasks: int | None = None     # the step's task count (one agent per node: == len(nodes))


def allocation_from_env(environ: Mapping[str, str]) -> Allocation | None:
    """The allocation a ``srun`` step runs in, or None (not under Slurm, or in the batch script itself: there
    only one agent would start). Raises ValueError on a node list it cannot read."""
    job, step, me = environ.get(E.SLURM_JOB_ID), environ.get(E.SLURM_STEP_ID), environ.get(E.SLURMD_NODENAME)
    nodelist = environ.get(E.SLURM_STEP_NODELIST) or environ.get(E.SLURM_JOB_NODELIST)
    if not (job and step is not None and me and nodelist):
        return None
    tasks = environ.get(E.SLURM_STEP_NUM_TASKS)
    return Allocation(job_id=job, nodes=tuple(expand_hostlist(nodelist)), node_name=me,
                      tasks=int(tasks) if tasks and tasks.isdigit() else None)


@dataclass(frozen=True)
class SlurmLaunch:
    """What the allocation says for each rendezvous setting (a flag the user gave wins over each)."""

    run_id: str
    members: int             # --nnodes
    spare_node: bool         # this node is one of the last K
    first_node: str          # the node that hosts the run's etcd
    port: int


def plan_launch(alloc: Allocation, spare_nodes: int) -> SlurmLaunch:
    """Pure. Raises ValueError with a one-line message for a layout tpassrun cannot run."""
    n = len(alloc.nodes)
    if alloc.node_name not in alloc.nodes:
        raise ValueError(f"this node ({alloc.node_name}) is not in the step's node list ({','.join(alloc.nodes)})")
    if alloc.tasks is not None and alloc.tasks != n:
        raise ValueError(f"the srun step runs {alloc.tasks} tasks on {n} node(s): run one tpassrun per node "
                         "(srun --ntasks-per-node 1 tpassrun ...)")
    if not 0 <= spare_nodes < n:
        raise ValueError(f"--spare-nodes {spare_nodes}: the step has {n} node(s), at least one must be a member")
    digits = re.sub(r"\D", "", alloc.job_id) or "0"
    return SlurmLaunch(run_id=alloc.job_id, members=n - spare_nodes,
                       spare_node=alloc.nodes.index(alloc.node_name) >= n - spare_nodes,
                       first_node=alloc.nodes[0], port=C10D_DEFAULT_PORT + int(digits) % PORT_SPREAD)


# ------------------------------------------------------------------------------------------- the plugin
def _scontrol(*args: str, env: Mapping[str, str] | None = None) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                              env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SchedulerError(f"scontrol {args[0]}: {exc}") from None
    if done.returncode != 0:
        msg = (done.stderr or done.stdout).strip().splitlines()
        raise SchedulerError(f"scontrol {' '.join(args[:2])}: {msg[-1] if msg else f'exit {done.returncode}'}")
    return done.stdout


def node_address(name: str) -> str:
    """The address Slurm reaches a node at (``NodeAddr``; the name itself when scontrol cannot say)."""
    try:
        return node_addr(_scontrol("show", "node", "-o", name)) or name
    except SchedulerError:
        return name


def _clean_reason(text: str) -> str:
    # scontrol takes the reason as one argument; Slurm shows it on one line
    return " ".join(text.split())[:200]


class SlurmPlugin:
    """The scheduler plugin over ``scontrol`` (draining needs Slurm operator rights: a refusal is a
    :class:`SchedulerError` the watcher reports once)."""

    name = "Slurm"

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id

    def nodes(self, names: Sequence[str]) -> Mapping[str, SchedNode]:
        if not names:
            return {}
        return parse_nodes(_scontrol("show", "node", "-o", ",".join(names)))

    def drain(self, node: str, reason: str) -> None:
        _scontrol("update", f"NodeName={node}", "State=DRAIN", f"Reason={_clean_reason(reason)}")

    def resume(self, node: str) -> None:
        _scontrol("update", f"NodeName={node}", "State=RESUME")

    def annotate(self, text: str) -> None:
        # Comment=, not AdminComment=: the job's owner may set it (AdminComment needs an administrator), and it is
        # what squeue -o %k, scontrol show job and sacct -o Comment show
        _scontrol("update", f"JobId={self.job_id}", "Comment=" + " ".join(text.split())[:COMMENT_MAX])

    def allocation(self) -> SchedJob:
        try:
            return parse_job(_scontrol("show", "job", "-o", self.job_id))
        except ValueError as exc:
            raise SchedulerError(f"scontrol show job {self.job_id}: {exc}") from None

    def release(self, keep: Sequence[str]) -> None:
        # Inside a job (SLURM_JOB_ID set) scontrol writes slurm_job_<id>_resize.{sh,csh} into its working directory
        # after a resize (to re-source in a batch script): not into the user's directory from here
        env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOBID", "SLURM_JOB_ID")}
        _scontrol("update", f"JobId={self.job_id}", f"NodeList={','.join(keep)}", env=env)


# ------------------------------------------------------------------------------------------- the command line
@dataclass(frozen=True)
class Given:
    """The rendezvous settings as the command line (and ``PET_*``) left them; argparse's defaults mean 'not given'."""

    rdzv_id: str = "none"
    nnodes: str = "1:1"
    backend: str = "static"
    endpoint: str = ""
    spare_node: bool = False
    standalone: bool = False
    master_port: int | None = None
    hosts_etcd: bool = True      # this agent may host the run's etcd (torchrun's rule: the endpoint is local)


def resolve(given: Given, alloc: Allocation | None, spare_nodes: int, *, forced: bool,
            address_of: Callable[[str], str]) -> tuple[Given, str]:
    """``(settings, node name)``: each setting the user left alone taken from the allocation (see
    :func:`plan_launch`); a node name ``""`` when there is no allocation. A one-node step without spare nodes
    keeps torchrun's behaviour (its private etcd): Slurm adds nothing to a single node. Raises ValueError."""
    if alloc is None:
        if forced or spare_nodes:
            raise ValueError("--spare-nodes and --scheduler slurm need a Slurm step: srun --ntasks-per-node 1 "
                             "tpassrun ... inside an allocation (SLURM_JOB_ID, SLURM_STEP_ID, SLURMD_NODENAME)")
        return given, ""
    if given.standalone or (len(alloc.nodes) == 1 and not spare_nodes and not forced):
        return given, alloc.node_name
    launch = plan_launch(alloc, spare_nodes)
    out = Given(rdzv_id=launch.run_id if given.rdzv_id == "none" else given.rdzv_id,
                nnodes=str(launch.members) if given.nnodes == "1:1" else given.nnodes,
                backend=given.backend, endpoint=given.endpoint, spare_node=given.spare_node or launch.spare_node,
                standalone=False, master_port=given.master_port)
    if not given.endpoint and given.backend in ("static", "c10d") and given.master_port is None:
        # the first node's agent hosts it, and only it (nodes sharing a host, as in tests, would otherwise race)
        out = Given(**{**out.__dict__, "backend": "c10d", "endpoint": f"{address_of(launch.first_node)}:{launch.port}",
                       "hosts_etcd": alloc.node_name == launch.first_node})
    return out, alloc.node_name


__all__ = ["Allocation", "Given", "SlurmLaunch", "SlurmPlugin", "allocation_from_env", "expand_hostlist",
           "node_address", "node_state", "parse_job", "parse_node_line", "parse_nodes", "plan_launch", "resolve"]
