"""The scheduler watcher: one task in the leader agent that keeps the scheduler's view and the job's in step.

Each poll (``$TPASSRUN_SCHEDULER_POLL`` seconds, default 5; the scheduler is asked off the event loop) reads the
job's nodes from the scheduler and the run's taints, generation and swaps from etcd, and :func:`decide` (pure)
says what to do:

* a node an operator drained (``scontrol update NodeName=X State=DRAIN Reason=...``): a ``migrate`` taint on each
  of its slots, so each rank it holds moves to a spare at a step boundary (the path ``tpassctl drain`` takes) and
  its spares are not handed out; the console says who asked and why;
* a node the scheduler marks down while the run still counts on it: its agent's lease is revoked, so the run
  declares it lost now (the spare node takes its ranks) instead of when its lease would have run out;
* a node drained by an operator and back up (``State=RESUME``): those taints are removed; its slots serve as
  spares again (with ``--migrate-back`` its ranks go home);
* a node the health monitor tainted while the scheduler still schedules on it: drained in the scheduler with the
  reason (``tpassrun: GPU 3: ...``); once nothing taints it any more (``tpassctl untaint``), resumed;
* a node the run lost, up or down in the scheduler, not drained yet: drained with ``tpassrun: lost by job ...`` (and
  the scheduler's own reason, if it gave one), never resumed by tpassrun; a down it then reports changes nothing;
* a node an operator drained whose ranks have all left (the migrations done): handed back to the scheduler in two
  polls: a ``handbacks/<node>`` record asks its agent to leave the job (it stops its spares and exits 0: its task
  of the job step ends cleanly), and once its agent's registration is gone at two polls in a row the job's
  allocation is shrunk to the other nodes (``scontrol update JobId= NodeList=``: Slurm shows the node drained, no
  longer the job's, while the job runs on). The leader's own node too: its agent leaves, another agent leads on
  (what this one did is in etcd). Never the node that runs the batch script (Slurm refuses), hosts the run's etcd
  or the workers' store: the console says it stays until the job ends, and why;
* the job's record (the Slurm job's comment) lists the swaps done so far;
* each change of a node's state in the scheduler is one ``scheduler_node`` event (the event log's record of what
  the scheduler said, written once that poll's actions are done).

Only the leader acts, so one process per job asks the scheduler; what it did is re-derived from etcd and the
scheduler at every poll (deterministic taint ids, the ``tpassrun:`` prefix of its own drain reasons), so a new
leader carries on where the last one stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from tpassrun.records import HandBack, Keys, Phase, SwapKind, SwapPlan, Taint, TaintEffect, load
from tpassrun.scheduler.base import NodeState, SchedJob, SchedNode, SchedulerError, SchedulerPlugin
from tpassrun.settings import envnames as E

if TYPE_CHECKING:
    from tpassrun.rendezvous import EtcdRendezvous, NodeInfo
    from tpassrun.settings import LaunchConfig

log = logging.getLogger("tpassrun.scheduler")

SOURCE = "scheduler"           # Taint.source of the taints a scheduler drain wrote
OURS = "tpassrun:"             # the prefix of every drain reason tpassrun gives the scheduler
LOST = "tpassrun: lost"        # ... of a node the run lost (never resumed by tpassrun: an operator looks first)
DEFAULT_POLL_S = 5.0
SWAPS_SHOWN = 8


def short(node_id: str) -> str:
    """``n1-1234-ab12`` -> ``n1``: the scheduler's name of an agent's node (node ids start with it)."""
    parts = node_id.rsplit("-", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() else node_id


# ------------------------------------------------------------------------------------------- decisions (pure)
@dataclass(frozen=True)
class TaintSlot:
    taint: Taint


@dataclass(frozen=True)
class DeleteTaints:
    node: str
    ids: tuple[str, ...]


@dataclass(frozen=True)
class DeclareLost:
    node: str          # the scheduler's name
    node_id: str
    reason: str


@dataclass(frozen=True)
class Drain:
    node: str
    reason: str


@dataclass(frozen=True)
class ResumeNode:
    node: str
    reason: str


@dataclass(frozen=True)
class HandBackNode:
    """Ask the agent(s) of an operator's drained node, holding no rank, to leave the job (``handbacks/<id>``)."""

    node: str
    node_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class ReleaseNodes:
    """Shrink the job's allocation to ``keep``: ``nodes`` (handed back, their agents gone) leave the job."""

    nodes: tuple[str, ...]
    keep: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class KeepNode:
    """An operator's drained node whose ranks left stays in the job until it ends (said once per reason)."""

    node: str
    reason: str


@dataclass(frozen=True)
class Annotate:
    text: str


@dataclass(frozen=True)
class Tell:
    text: str


SchedulerAction = (TaintSlot | DeleteTaints | DeclareLost | Drain | ResumeNode | HandBackNode | ReleaseNodes | KeepNode
                   | Annotate | Tell)


@dataclass(frozen=True)
class View:
    """What one poll saw."""

    sched: Mapping[str, SchedNode]              # the scheduler's state of the job's nodes, by name
    agents: Mapping[str, "NodeInfo"]             # live registrations, by node id
    homes: Mapping[int, tuple[str, int]]         # rank -> (node id, slot) in the current generation
    lost: frozenset[str] = frozenset()           # node ids the run lost
    counted: frozenset[str] = frozenset()        # node ids the current generation counts on (members, spare nodes)
    taints: Sequence[Taint] = ()
    swaps: Sequence[SwapPlan] = ()
    scheduler: str = "Slurm"
    job_id: str = ""
    now: float = 0.0
    comment: str | None = None                   # what this leader last wrote on the job (None: nothing yet)
    refused: frozenset[str] = frozenset()        # drains the scheduler refused (not retried); "release:<node>" too
    job: SchedJob | None = None                  # the job's allocation now (None: not read this poll)
    handbacks: Mapping[str, HandBack] = field(default_factory=dict)   # node id -> the hand-back asked of it
    gone: frozenset[str] = frozenset()           # handed-back node ids whose registration was gone at the last poll too
    etcd_node: str = ""                          # the scheduler's name of the node hosting the run's etcd
    store_host: str | None = None                # the node id running the workers' store


def slurm_taint_id(node_id: str, slot: int) -> str:
    return f"sched-{node_id}-slot{slot}"


def _asked(node: SchedNode) -> str:
    by = f"by {node.who}" if node.who else "by an operator"
    return f"{by}: {node.reason or 'no reason given'}"


def decide(view: View) -> list[SchedulerAction]:
    """Every action one poll calls for (see the module doc)."""
    # a node recovered from is lost for good, though the generation that lost it may be gone (its ranks moved on)
    recovered = {p.lost_node for p in view.swaps if p.kind is SwapKind.NODE and p.lost_node}
    view = replace(view, lost=view.lost | recovered)
    out: list[SchedulerAction] = []
    ids_of: dict[str, list[str]] = {}
    for node_id in {*view.agents, *view.lost, *view.counted, *(n for n, _s in view.homes.values())}:
        ids_of.setdefault(short(node_id), []).append(node_id)
    ours = [t for t in view.taints if t.source == SOURCE]
    for name, node in sorted(view.sched.items()):
        node_ids = sorted(ids_of.get(name, []))
        handed = bool(node_ids) and all(n in view.handbacks for n in node_ids)
        drained_by_us = node.reason.startswith(OURS)
        if node.state is NodeState.DRAIN and not drained_by_us:
            moving = _migrate_off(view, name, node, node_ids, ours)
            out += moving or _hand_back(view, name, node, node_ids)
        elif node.state is NodeState.DOWN:
            for node_id in node_ids:
                if node_id in view.counted and node_id not in view.lost and node_id not in view.handbacks:
                    out.append(DeclareLost(name, node_id, f"{view.scheduler} marks {name} {node.raw_state or 'down'} "
                                                          f"({_asked(node)}): declared lost now"))
        elif node.state is NodeState.UP:
            back = tuple(sorted(t.id for t in ours if t.node_id in node_ids))
            if back:
                out.append(DeleteTaints(name, back))
                out.append(Tell(f"{view.scheduler} resumed {name}: " + (
                    f"handed back to {view.scheduler} before, it is no longer the job's" if handed
                    else "its slots serve as spares again")))
        out += _tell_scheduler(view, name, node, [n for n in node_ids if n not in view.handbacks])
    out += _release(view)
    text = job_comment(view.swaps)
    if text and text != view.comment:
        out.append(Annotate(text))
    return out


def _migrate_off(view: View, name: str, node: SchedNode, node_ids: Sequence[str],
                 ours: Sequence[Taint]) -> list[SchedulerAction]:
    have = {t.id for t in ours}
    out: list[SchedulerAction] = []
    moved: list[int] = []
    for node_id in node_ids:
        info = view.agents.get(node_id)
        if info is None or node_id in view.lost:
            continue
        ranks = {slot: rank for rank, (n, slot) in view.homes.items() if n == node_id}
        for slot in range(info.nproc + info.spares):
            tid = slurm_taint_id(node_id, slot)
            if tid in have:
                continue
            rank = ranks.get(slot)
            if rank is not None:
                moved.append(rank)
            out.append(TaintSlot(Taint(id=tid, effect=TaintEffect.MIGRATE, source=SOURCE, node_id=node_id, slot=slot,
                                      local_rank=slot, rank=rank, time=view.now,
                                      reason=f"{view.scheduler} drained {name} {_asked(node)}")))
    if out:
        what = f"moving rank(s) {', '.join(map(str, sorted(moved)))} to spares" if moved else "its spares set aside"
        out.insert(0, Tell(f"{view.scheduler} drained {name} {_asked(node)}: {what}"))
    return out


def _hand_back(view: View, name: str, node: SchedNode, node_ids: Sequence[str]) -> list[SchedulerAction]:
    """An operator's drained node, its migrate taints written: once no rank runs there and no swap is under way,
    its agents are asked to leave the job (or it stays, and the console says why)."""
    live = tuple(n for n in node_ids if n in view.agents and n not in view.lost)
    if (not live or any(n in view.handbacks for n in node_ids) or view.job is None or name not in view.job.nodes
            or any(n in live for n, _slot in view.homes.values()) or any(not p.terminal for p in view.swaps)):
        return []
    sched = view.scheduler
    why = ("it runs the job's batch script (Slurm cannot take the batch host out of a job)"
           if name == view.job.batch_host else
           "it hosts the run's etcd" if name == view.etcd_node else
           "it runs the workers' store" if view.store_host in live else "")
    if why:
        return [KeepNode(name, f"{sched} drained {name}: no rank runs there any more, but it stays in the job until "
                               f"the job ends: {why}")]
    return [HandBackNode(name, live, f"{sched} drained {name} {_asked(node)}; no rank runs there any more")]


def _release(view: View) -> list[SchedulerAction]:
    """Handed-back nodes whose agents are gone (their registrations absent at two polls in a row: the process has
    exited, so Slurm kills nothing) leave the job's allocation, all in one update."""
    if view.job is None:
        return []
    by_name: dict[str, list[str]] = {}
    for node_id, hb in view.handbacks.items():
        by_name.setdefault(hb.node, []).append(node_id)
    names = tuple(sorted(name for name, ids in by_name.items()
                         if name in view.job.nodes and f"release:{name}" not in view.refused
                         and all(n not in view.agents and n in view.gone for n in ids)))
    keep = tuple(n for n in view.job.nodes if n not in names)
    if not names or not keep:
        return []
    return [ReleaseNodes(names, keep, f"{', '.join(names)}: drained, no rank or agent of the job there any more")]


def _tell_scheduler(view: View, name: str, node: SchedNode, node_ids: Sequence[str]) -> list[SchedulerAction]:
    """Drain a node the run found unhealthy or lost; resume one it drained once nothing holds it."""
    lost = [n for n in node_ids if n in view.lost]
    health = [t for t in view.taints if t.node_id in node_ids and t.source == "health"]
    if lost and name not in view.refused and not node.drain and node.state in (NodeState.UP, NodeState.DOWN):
        # a down node too: else it returns to service when its slurmd is back (ReturnToService), unlooked at
        said = f" ({view.scheduler}: {node.reason})" if node.reason and not node.reason.startswith(OURS) else ""
        return [Drain(name, f"{LOST} by job {view.job_id}: its agent stopped answering{said}")]
    if node.state is NodeState.UP and name not in view.refused:
        if health:
            return [Drain(name, f"{OURS} {health[0].reason}")]
    if (node.state is NodeState.DRAIN and node.reason.startswith(OURS) and not node.reason.startswith(LOST)
            and not health and not lost):
        return [ResumeNode(name, "no health taint holds it any more")]
    return []


def job_comment(swaps: Sequence[SwapPlan]) -> str:
    """The job's record: the swaps done, newest last (the scheduler keeps comments short)."""
    done = sorted((p for p in swaps if p.phase is Phase.DONE), key=lambda p: p.history[0][1] if p.history else 0.0)
    if not done:
        return ""
    parts = []
    for p in done[-SWAPS_SHOWN:]:
        moves = p.moves or ()
        if moves:
            where = ", ".join(f"rank {m.leaver.rank} {short(m.leaver.node)}->{short(m.joiner.node)}" for m in moves)
        else:
            where = f"rank {p.leaver.rank} {short(p.leaver.node)}->{short(p.joiner.node)}"
        pause = (p.history[-1][1] - p.history[0][1]) if len(p.history) > 1 else 0.0
        kind = "planned" if p.kind is SwapKind.PLANNED else "recovery"
        parts.append(f"{p.id} {kind} {where} {pause:.1f}s ({' '.join(p.reason.split())[:60]})")
    more = f" (+{len(done) - SWAPS_SHOWN} earlier)" if len(done) > SWAPS_SHOWN else ""
    return f"tpassrun: {len(done)} swap(s){more}: " + "; ".join(parts)


# ------------------------------------------------------------------------------------------- effects
class SchedulerHost(Protocol):
    """One agent as its scheduler watcher sees it."""

    node_id: str
    cfg: "LaunchConfig"
    environ: dict[str, str]
    rdzv: "EtcdRendezvous"
    events: Any


@dataclass
class SchedulerWatch:
    """The watcher of one agent: construct once, :meth:`run` in every generation (cancelled at its end)."""

    host: SchedulerHost
    plugin: SchedulerPlugin
    job_nodes: tuple[str, ...]
    interval: float = DEFAULT_POLL_S
    comment: str | None = None
    refused: set[str] = field(default_factory=set)
    seen: dict[str, str] = field(default_factory=dict)   # node -> the scheduler's state last logged
    annotate_failing: str = ""
    kept: set[str] = field(default_factory=set)          # KeepNode reasons said
    gone: set[str] = field(default_factory=set)          # handed-back node ids absent at the last poll
    _failing: str = ""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if not self.host.rdzv.is_leader:
                continue
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the scheduler or etcd failing must not end the job
                if str(exc) != self._failing:
                    self._failing = str(exc)
                    self.host.events.write("scheduler_error", message=f"{self.plugin.name}: {exc}")

    async def poll(self) -> list[SchedulerAction]:
        view = await self.view()
        actions = decide(view)
        for action in actions:
            await self.apply(action)
        for name, node in sorted(view.sched.items()):   # after the actions: a reader knows this poll is handled
            if self.seen.get(name) != node.raw_state:
                self.seen[name] = node.raw_state
                self.host.events.write("scheduler_node", sched_node=name, state=node.raw_state, reason=node.reason)
        self._failing = ""
        return actions

    async def view(self) -> View:
        rdzv = self.host.rdzv
        sched = await asyncio.to_thread(self.plugin.nodes, list(self.job_nodes))
        keys = Keys(rdzv.key(""))
        taints = [t for k, d, r in await rdzv.store.get_prefix_json(keys.family("taints"))
                  if (t := load(Taint.from_json, k, d, r)) is not None]
        swaps = [p for k, d, r in await rdzv.store.get_prefix_json(keys.family("swaps"))
                 if (p := load(SwapPlan.from_json, k, d, r)) is not None]
        handbacks = {keys.last(k): hb for k, d, r in await rdzv.store.get_prefix_json(keys.family("handbacks"))
                     if (hb := load(HandBack.from_json, k, d, r)) is not None}
        gen = rdzv.generation
        agents = {info.node_id: info for info in await rdzv.registrations()}
        job = None
        if handbacks or any(n.drain and not n.reason.startswith(OURS) for n in sched.values()):
            job = await asyncio.to_thread(self.plugin.allocation)
        absent = {n for n in handbacks if n not in agents}
        gone, self.gone = frozenset(absent & self.gone), absent
        store_host = None
        if gen is not None:
            moved = sorted((p for p in swaps if p.phase is Phase.DONE and p.store_host and p.generation >= gen.formed),
                           key=lambda p: p.history[0][1] if p.history else 0.0)
            store_host = moved[-1].store_host if moved else next(
                (m.node_id for m in gen.members if m.group_rank == 0), None)
        return View(sched=sched, agents=agents, homes=gen.homes() if gen else {},
                    lost=frozenset(gen.lost if gen else ()),
                    counted=frozenset((*gen.member_ids, *gen.spare_nodes) if gen else ()),
                    taints=taints, swaps=swaps, scheduler=self.plugin.name, job_id=self.plugin.job_id,
                    now=time.time(), comment=self.comment, refused=frozenset(self.refused), job=job,
                    handbacks=handbacks, gone=gone, etcd_node=self.job_nodes[0] if self.job_nodes else "",
                    store_host=store_host)

    async def apply(self, action: SchedulerAction) -> None:
        rdzv, events, name = self.host.rdzv, self.host.events, self.plugin.name
        keys = Keys(rdzv.key(""))
        if isinstance(action, Tell):
            events.write("scheduler_event", message=action.text)
        elif isinstance(action, TaintSlot):
            t = action.taint
            created = await rdzv.store.create_json(keys.taint(t.id), t.to_json())
            events.write("scheduler_taint", id=t.id, target_node=t.node_id, slot=t.slot, rank=t.rank,
                         reason=t.reason, created=created)
        elif isinstance(action, DeleteTaints):
            for tid in action.ids:
                await rdzv.store.delete(keys.taint(tid))
            events.write("scheduler_untaint", node=action.node, ids=list(action.ids))
        elif isinstance(action, DeclareLost):
            revoked = await rdzv.store.revoke_lease_of(keys.node(action.node_id))
            events.write("scheduler_event", message=f"node {action.node}: {action.reason}", lost_node=action.node_id,
                         revoked=revoked)
        elif isinstance(action, (Drain, ResumeNode)):
            try:
                if isinstance(action, Drain):
                    await asyncio.to_thread(self.plugin.drain, action.node, action.reason)
                else:
                    await asyncio.to_thread(self.plugin.resume, action.node)
            except SchedulerError as exc:
                self.refused.add(action.node)
                events.write("scheduler_event", message=f"{name} refused to {'drain' if isinstance(action, Drain) else 'resume'} "
                                                        f"{action.node} ({exc}); an operator can run: "
                                                        f"{_command(action)}")
                return
            self.refused.discard(action.node)
            verb = "drained" if isinstance(action, Drain) else "resumed"
            events.write("scheduler_event", message=f"{verb} {action.node} in {name}: {action.reason}")
        elif isinstance(action, KeepNode):
            if action.reason not in self.kept:
                self.kept.add(action.reason)
                events.write("scheduler_event", message=action.reason)
        elif isinstance(action, HandBackNode):
            for node_id in action.node_ids:
                record = HandBack(node=action.node, reason=action.reason, time=time.time())
                await rdzv.store.create_json(keys.handback(node_id), record.to_json())
            events.write("scheduler_event", message=f"handing {action.node} back to {name}: {action.reason}: its "
                                                    "agent leaves the job", sched_node=action.node,
                         node_ids=list(action.node_ids))
        elif isinstance(action, ReleaseNodes):
            try:
                await asyncio.to_thread(self.plugin.release, action.keep)
            except SchedulerError as exc:
                self.refused.update(f"release:{n}" for n in action.nodes)
                events.write("scheduler_event", message=f"{name} refused to take {', '.join(action.nodes)} out of "
                                                        f"the job ({exc}); they stay allocated to it until it ends "
                                                        f"(an administrator can run: scontrol update "
                                                        f"JobId={self.plugin.job_id} NodeList={','.join(action.keep)})")
                return
            events.write("scheduler_released", nodes=list(action.nodes), keep=list(action.keep),
                         message=f"handed {', '.join(action.nodes)} back to {name}: the job runs on "
                                 f"{', '.join(action.keep)} ({action.reason})")
        elif isinstance(action, Annotate):
            try:
                await asyncio.to_thread(self.plugin.annotate, action.text)
            except SchedulerError as exc:
                # the next poll tries again (one scontrol call); the console says so once per cause
                if str(exc) != self.annotate_failing:
                    self.annotate_failing = str(exc)
                    events.write("scheduler_event", message=f"{name} did not take the job's comment ({exc}); "
                                                            "trying again at the next poll")
                return
            self.annotate_failing = ""
            self.comment = action.text
            events.write("scheduler_annotated", text=action.text)


def _command(action: Drain | ResumeNode) -> str:
    if isinstance(action, Drain):
        return f"scontrol update NodeName={action.node} State=DRAIN Reason='{action.reason}'"
    return f"scontrol update NodeName={action.node} State=RESUME"


def poll_interval(environ: Mapping[str, str]) -> float:
    try:
        value = float(environ.get(E.TPASSRUN_SCHEDULER_POLL) or DEFAULT_POLL_S)
    except ValueError:
        return DEFAULT_POLL_S
    return value if value > 0 else DEFAULT_POLL_S


__all__ = ["SchedulerAction", "Annotate", "DeclareLost", "DeleteTaints", "Drain", "HandBackNode", "KeepNode", "ReleaseNodes",
           "TaintSlot", "ResumeNode", "Tell",
           "SchedulerHost", "SchedulerWatch", "View", "decide", "job_comment", "poll_interval", "short",
           "slurm_taint_id"]
