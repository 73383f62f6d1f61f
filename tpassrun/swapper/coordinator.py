"""The swap coordinator: the rendezvous leader's half of live swaps (every agent runs the participant half,
:class:`tpassrun.swapper.Swapper`).

On every relevant change in etcd (a taint, a worker failure, a report, a node's status, a plan) the leader
reads the control plane once, asks :func:`tpassrun.plan.triage.triage` (pure) what to do, and writes it: plans are
created and advanced by compare-and-swap, so a leader change mid-swap cannot fork a plan. A REFORM commits the
next generation (the swap's) before the plan moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from tpassrun.plan import (
    REPORT_DEADLINE_S,
    Action,
    CasPlan,
    ClaimFromPool,
    ClusterView,
    CreatePlan,
    Decision,
    GiveBack,
    MoveHome,
    Phase,
    PutFailure,
    PutFallback,
    PutTaint,
    RestartGroup,
    Say,
    Seen,
    SlotView,
    plan_give_back,
    seen_ranks,
    triage,
)
from tpassrun.records import (
    Failure,
    GenerationCommitted,
    Keys,
    NodeStatus,
    RecordError,
    RecordReplaced,
    Report,
    StoreMoved,
    SwapDecided,
    SwapKind,
    SwapPhaseChanged,
    SwapPlan,
    Taint,
    TaintEffect,
    TaintSource,
    emit,
    load,
    node_info,
    seal,
)
from tpassrun.rendezvous import GenState, NodeInfo
from tpassrun.swapper.agentport import AgentPort, HealthRestartRequested, annotated

if TYPE_CHECKING:
    from tpassrun.pool import JobPool
    from tpassrun.rendezvous import EtcdStore, Generation

log = logging.getLogger(__name__)

STORE_READY_S = 30.0   # how long a re-form waits for a workers' store just started here to listen


class Coordinator:
    """Construct once per agent; ``await run()`` in every generation; :meth:`kick` on any local change."""

    def __init__(self, port: AgentPort) -> None:
        self.port = port
        self._kick = asyncio.Event()
        self._waiting_said: set[str] = set()
        self._taints_said: set[str] = set()    # taint ids whose arrival the event log has
        self._newest: dict[str, SwapPlan] = {}   # plan id -> the newest version of it this agent read as leader
        self.pool: "JobPool | None" = None        # --spare-pool (tpassrun.pool.job), set by the agent
        self._wake: asyncio.TimerHandle | None = None     # the next report deadline of a plan in flight
        self._job_lost: tuple[str, ...] = ()      # the lost nodes of the last view read (a claimed pool node's too)

    def kick(self) -> None:
        self._kick.set()

    @property
    def _keys(self) -> Keys:
        return Keys(self.port.rdzv.key(""))

    @property
    def _store(self) -> EtcdStore:
        return self.port.rdzv.store

    async def run(self) -> None:
        await self._coordinate()

    # ------------------------------------------------------------------ reads (the participant uses them too)
    async def view(self) -> ClusterView:
        return await self._view()

    async def taints(self) -> list[Taint]:
        return await self._taints()

    # ------------------------------------------------------------------ the loop
    async def _coordinate(self) -> None:
        """Re-evaluate on every relevant change; only the leader acts, and only the leader watches: with every
        agent watching the run's records, each status write (every agent, every second) reached every agent, N^2
        watch events a second (2,048 nodes: 4 million), and a busy loop of no-op kicks on each of them."""
        prefix = self._keys.prefix
        watcher: asyncio.Future[None] | None = None
        listeners: list[Callable[[], None]] = getattr(self.port.rdzv, "leadership_listeners", [])
        listeners.append(self.kick)      # (a test's fake handle has none: its is_leader never changes)
        backoff, said = 0.2, ""
        self._kick.set()
        try:
            while True:
                await self._kick.wait()
                self._kick.clear()
                leading = self.port.rdzv.is_leader
                if leading and watcher is None:
                    watcher = asyncio.ensure_future(self._watch_kicks(prefix))   # kicks once it watches
                    continue
                if not leading and watcher is not None:
                    watcher.cancel()
                    watcher = None
                if leading:
                    try:
                        await self._leader_tick()
                        backoff, said = 0.2, ""
                    except Exception as exc:  # the next kick re-reads everything
                        # Once per distinct error, then retry with a growing pause: never a traceback per tick.
                        if repr(exc) != said:
                            said = repr(exc)
                            log.exception("swap coordinator tick failed; retrying")
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                        self._kick.set()
        finally:
            with contextlib.suppress(ValueError):
                listeners.remove(self.kick)
            if watcher is not None:
                watcher.cancel()

    async def _watch_kicks(self, prefix: str) -> None:
        """Kick on every change the triage reads, from the moment etcd confirmed the watch (the tick that follows
        reads everything). A status write kicks only when what the triage reads of it changed (status_shape):
        the step and the clock every agent writes each second change nothing it decides."""
        ready = asyncio.Event()
        ready_kick = asyncio.ensure_future(_kick_when(ready, self.kick))
        shapes: dict[str, object] = {}
        interesting = ("taints/", "failures/", "reports/", "swaps/")
        try:
            async for ev in self._store.watch_prefix(prefix, ready=ready):
                rel = ev.key[len(prefix):]
                if rel.startswith("status/"):
                    shape = status_shape(ev.value) if ev.kind == "put" else None
                    if ev.kind == "reset" or shape is None or shapes.get(ev.key) != shape:
                        self.kick()
                    if shape is None:
                        shapes.pop(ev.key, None)
                    else:
                        shapes[ev.key] = shape
                elif rel.startswith(interesting) or ev.kind == "reset":
                    self.kick()
        finally:
            ready_kick.cancel()

    async def _view(self, taints: list[Taint] | None = None) -> ClusterView:
        gen = self.port.generation()
        assert gen is not None
        slots: list[SlotView] = []
        # A taint naming a slot but no rank (health: a bad spare), or any "exclude" taint, keeps that slot out
        # of the spare pool.
        barred = {(t.node_id, t.slot) for t in (await self._taints() if taints is None else taints)
                  if t.rank is None or t.effect is TaintEffect.EXCLUDE}
        for key, doc, rev in await self._store.get_prefix_json(self._keys.family("status")):
            status = load(NodeStatus.from_json, key, doc, rev)
            if status is None:
                continue
            for w in status.workers:
                state = w.state
                if state == "spare" and (status.node_id, w.slot) in barred:
                    state = "tainted"
                slots.append(SlotView(node=status.node_id, slot=w.slot, rank=w.rank, state=state,
                                      managed=w.managed, step=w.step, replicas=w.replicas,
                                      sharded=w.sharded or bool(w.shard_held)))
        lost = tuple(annotated(gen, self.port.latest()).lost)   # lost nodes are annotations: written in place
        slots = [s for s in slots if s.node not in lost]   # a lost node's last status may outlive it briefly
        return ClusterView(generation=gen.number, members=tuple(m.node_id for m in gen.members),
                           spare_nodes=tuple(gen.spare_nodes), slots=tuple(slots), lost=lost, homes=homes_of(gen))

    async def _taints(self) -> list[Taint]:
        out = []
        for key, doc, rev in await self._store.get_prefix_json(self._keys.family("taints")):
            taint = load(Taint.from_json, key, doc, rev)
            if taint is not None and taint.id == self._keys.last(key):
                out.append(taint)
            elif taint is not None:
                load(_mismatched_id, key, taint, rev)
        return out

    async def _plans(self) -> list[tuple[SwapPlan, int]]:
        plans = []
        for key, doc, rev in await self._store.get_prefix_json(self._keys.family("swaps")):
            plan = load(SwapPlan.from_json, key, doc, rev)
            if plan is not None and is_replayed(self._newest, plan):
                load(_replayed, key, plan, rev)      # logged once; the newest version read stands for it (a CAS
                plans.append((self._newest[plan.id], rev))   # then writes over the replay)
            elif plan is not None:
                plans.append((plan, rev))
        return plans

    async def _leader_tick(self) -> None:
        """Read -> decide (:func:`tpassrun.plan.triage.triage`, pure) -> write."""
        latest, gen = self.port.latest(), self.port.generation()
        if latest is not None and gen is not None and (latest.number > gen.number or latest.state != GenState.ACTIVE):
            return    # a restart (or a commit this agent has not seen yet) is under way: nothing to plan in this one
        seen = await self._read(time.time())
        self._job_lost = seen.view.lost
        result = triage(seen)
        self._waiting_said |= result.said
        self._taints_said |= result.received
        for action in result.actions:
            await self._carry_out(action)
        if self.pool is not None:
            await self._give_back(seen, busy=bool(result.actions))
        active = [p.history[-1][1] for p, _ in seen.plans if not p.terminal and p.history]
        if active:      # nothing in etcd may change when a silent participant's deadline passes: look again then
            self._wake_at(min(active) + REPORT_DEADLINE_S - seen.now)

    def _wake_at(self, delay: float) -> None:
        if self._wake is not None:
            self._wake.cancel()
        self._wake = asyncio.get_running_loop().call_later(max(delay, 0.0) + 0.5, self.kick)

    async def _give_back(self, seen: Seen, busy: bool) -> None:
        """--spare-pool with --migrate-back: once the job's own spares can hold a pool node's ranks, they go home
        (a migrate-back taint each, one at a time) and the pool node is given back (tpassrun.plan.giveback)."""
        pool = self.pool
        assert pool is not None
        if not self.port.settings.migrate_back or not pool.held:
            return
        agents = await pool.agents()
        pool.used = seen_ranks(seen.view, agents, pool.used)
        action = plan_give_back(seen.view, agents, pool.used, seen.taints, migrate_back=True,
                                busy=busy or any(not p.terminal for p, _ in seen.plans))
        if isinstance(action, MoveHome):
            tid = f"pool-home-{action.rank}-{int(seen.now * 1000)}"
            taint = Taint(id=tid, effect=TaintEffect.MIGRATE, rank=action.rank, reason=action.reason,
                          source=TaintSource.MIGRATE_BACK.value, home_node=action.home[0], home_slot=action.home[1],
                          time=seen.now)
            await self._store.put_json(self._keys.taint(tid), taint.to_json())
        elif isinstance(action, GiveBack):
            pool.used.pop(action.node, None)
            await pool.give_back(agents[action.node], action.reason, self.port.events.write)

    async def _read(self, now: float) -> Seen:
        keys = self._keys
        plans = await self._plans()
        active = [p for p, _ in plans if not p.terminal and p.generation >= self.port.epoch()]
        reports: list[Report] = []
        if active:
            seq = len(active[0].history)
            reports = [r for k, d, rv in await self._store.get_prefix_json(keys.reports(active[0].id, seq))
                       if (r := load(Report.from_json, k, d, rv)) is not None]
        # the status before the failures: an agent writes a dead worker's failure record before the status that
        # shows the slot dead, so every death this view shows has its failure read too (a dead sender always
        # comes with its failure: both dead ranks are planned again at once, not the recovery aborted)
        # one read of the taints for both the spare pool and the taints to act on: a node that bars its own spare
        # and then taints its ranks (netwatch: a degraded link) is seen with both or neither, so no rank is
        # planned onto that spare
        taints = await self._taints()
        view = await self._view(taints)
        failures = [(keys.last(k), f) for k, d, rv in await self._store.get_prefix_json(keys.family("failures"))
                    if (f := load(Failure.from_json, k, d, rv)) is not None]
        return Seen(now=now, epoch=self.port.epoch(), plans=plans, reports=reports,
                    failures=failures, taints=taints, view=view,
                    waiting_said=frozenset(self._waiting_said), received_said=frozenset(self._taints_said),
                    pool=self.pool is not None,
                    pool_gave_up=frozenset(self.pool.gave_up) if self.pool is not None else frozenset())

    async def _carry_out(self, action: Action) -> None:
        keys, store, events = self._keys, self._store, self.port.events
        if isinstance(action, CasPlan):
            if action.decision is None:     # a stale plan, aborted quietly
                await store.cas_json(keys.swap(action.old.id), _sealed(keys.swap(action.old.id), action.new), action.revision)
            else:
                await self._apply(action.decision, action.old, action.revision)
        elif isinstance(action, CreatePlan):
            plan = action.plan if action.plan.terminal else await self._with_store(_with_secret(action.plan))
            key = keys.swap(plan.id)
            created = await store.create_json(key, _sealed(key, plan)) or await self._replace_foreign(key, plan)
            if created and action.taint is not None:
                await store.put_json(keys.taint(action.taint.id), action.taint.handled(plan.id, "migrating").to_json())
                emit(events, SwapDecided(swap_id=plan.id, reason=action.reason, taint=action.taint.id))
        elif isinstance(action, PutFailure):
            await store.put_json(keys.failure_by_id(action.failure_id), action.failure.to_json())
        elif isinstance(action, PutTaint):
            await store.put_json(keys.taint(action.taint.id), action.taint.to_json())
        elif isinstance(action, PutFallback):
            await store.put_json(keys.fallback(action.node), action.fallback.to_json())
        elif isinstance(action, Say):
            events.write(action.event, **action.fields)
        elif isinstance(action, RestartGroup):
            self.port.post(HealthRestartRequested(action.reason, action.rank))
        elif isinstance(action, ClaimFromPool) and self.pool is not None:
            gave_up = len(self.pool.gave_up)
            await self.pool.need(action.lost, 0, events.write, job_lost=self._job_lost)
            if len(self.pool.gave_up) > gave_up:
                self.kick()                     # the restart is decided at once
            elif self.pool.waiting:             # no etcd change may come: look at the pool again in a second
                asyncio.get_running_loop().call_later(1.0, self.kick)

    async def _replace_foreign(self, key: str, plan: SwapPlan) -> bool:
        """A value at a new plan's key that is not the job's (no good MAC of the run key, or malformed) was refused
        on read, so triage did not count its id as taken: it must not block the plan (plan ids are predictable).
        It is replaced, by compare-and-swap, and the event log says so."""
        doc, rev = await self._store.get_json(key)
        if not rev or load(SwapPlan.from_json, key, doc, rev) is not None:
            return False
        replaced = await self._store.cas_json(key, _sealed(key, plan), rev)
        if replaced:
            emit(self.port.events, RecordReplaced(key=key, swap_id=plan.id,
                                                  reason="the value there was not the job's (refused on read)"))
        return replaced

    async def _apply(self, decision: Decision, plan: SwapPlan, rev: int) -> None:
        if decision.plan is None:
            return
        new = decision.plan
        if new.phase == Phase.REFORM:
            if new.store_host == self.port.node_id and self.port.store_ready is not None:
                # the world re-forms at a store this agent started for the swap: listening before anyone connects
                await self.port.store_ready(STORE_READY_S)
            await self._commit_generation(new)
        ok = await self._store.cas_json(self._keys.swap(plan.id), _sealed(self._keys.swap(plan.id), new), rev)
        if ok:
            emit(self.port.events, SwapPhaseChanged(swap_id=new.id, phase=new.phase, reason=decision.reason))
            if new.phase == Phase.DONE and new.taint_id and new.release:
                await self._store.delete(self._keys.taint(new.taint_id))   # migrate-back done: nothing sick
            elif new.phase == Phase.DONE and new.taint_id:
                key = self._keys.taint(new.taint_id)
                doc, trev = await self._store.get_json(key)
                taint = load(Taint.from_json, key, doc, trev) if doc is not None else None
                if taint is not None:
                    await self._store.put_json(key, taint.handled(new.id, "quarantined", slot=new.leaver.slot,
                                                                  node_id=new.leaver.node).to_json())

    async def _with_store(self, plan: SwapPlan) -> SwapPlan:
        """Where the re-formed world meets: this generation's workers' store, or a new one this agent hosts when
        the node that ran it was lost (the store dies with its agent)."""
        addr, port = self.port.master()
        host = self.port.store_host()
        if not port or (host is not None and not self._alive(host)):
            if self.port.start_store is None:
                return plan        # (tests' ports) the participants use the store they know
            addr, port = await self.port.start_store()
            host = self.port.node_id
            emit(self.port.events, StoreMoved(addr=addr, port=port, swap_id=plan.id,
                                              reason=f"the workers' store was on lost node {plan.lost_node}"))
        return dataclasses.replace(plan, store=(addr, port), store_host=host)

    def _alive(self, node: str) -> bool:
        """Whether ``node`` is a live member or spare node of the latest generation (not one lost in it, nor one
        lost in an earlier generation and gone from the record since)."""
        latest = self.port.latest() or self.port.generation()
        return latest is None or latest.includes(node)

    async def _commit_generation(self, plan: SwapPlan) -> None:
        """One swap = one generation transition (compare-and-swap), carrying the swap id."""
        old = await self.port.rdzv.current()
        if old is None:
            return
        infos = {}
        for taker in {*plan.replacing.values(), *([plan.replaces] if plan.replaces else [])}:
            key = self._keys.node(taker)
            doc, rev = await self._store.get_json(key)
            info = load(node_info, key, doc, rev) if doc is not None else None
            if info is not None:
                infos[taker] = info
        new = committed_generation(old, plan, infos)
        if await self.port.rdzv.commit(old, new):
            self.port.set_generation(new)
            emit(self.port.events, GenerationCommitted(generation=new.number, swap_id=plan.id))


def status_shape(doc: Any) -> object | None:
    """What the triage reads of a ``status/<node>`` value, as a comparable value (pure): each slot's rank, state,
    whether its worker runs tpassrun.init(), its replica group and whether it holds sharded state (the coordinator's
    ``_view``). The step, the time and the step time, rewritten every second, are left out. None: not a value
    the strict reader would take apart here (malformed: the tick's reader judges it)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("workers", ()), (list, tuple)):
        return None
    shape = []
    for w in doc.get("workers", ()):
        if not isinstance(w, dict):
            return None
        replicas = w.get("replicas")
        shape.append((w.get("slot"), w.get("rank"), w.get("state"), bool(w.get("managed")),
                      tuple(replicas) if isinstance(replicas, list) else replicas, bool(w.get("shard_held"))))
    return (doc.get("node_id"), tuple(shape))


async def _kick_when(ready: asyncio.Event, kick: Callable[[], None]) -> None:
    await ready.wait()
    kick()


def homes_of(gen: "Generation") -> tuple[tuple[int, str, int], ...]:
    """(rank, node, slot) where a generation placed each rank: its member's range, moved by swaps' assignments."""
    return tuple((r, n, s) for r, (n, s) in sorted(gen.homes().items()))


def committed_generation(old: "Generation", plan: SwapPlan,
                         replacing: "NodeInfo | Mapping[str, NodeInfo] | None" = None) -> "Generation":
    """The generation a swap's REFORM commits (pure): the moved ranks' new places, the swap's store; for a node
    plan whose ranks all went to one node (``plan.replaces``; with several lost nodes, ``plan.replacing``), that
    node takes the lost member's place (its group rank and rank range), so a later restart keeps every rank where
    it is now. ``replacing``: the registration of the node taking the place (by node id for several)."""
    assignments = dict(old.assignments or {})
    for move in plan.all_moves:
        assignments[str(move.rank)] = {"node": move.joiner.node, "slot": move.joiner.slot}
    members, spare_nodes, lost = old.members, old.spare_nodes, old.lost
    places = dict(plan.replacing) if plan.replacing else (
        {plan.lost_node: plan.replaces} if plan.lost_node and plan.replaces else {})
    infos = replacing if isinstance(replacing, Mapping) else (
        {plan.replaces: replacing} if plan.replaces and replacing is not None else {})
    for lost_node, taker in places.items() if plan.kind == SwapKind.NODE else ():
        gone = old.member(lost_node)
        if gone is None:
            continue
        info = infos.get(taker)
        new_member = dataclasses.replace(gone, node_id=taker, addr=info.addr if info is not None else gone.addr,
                                         spares=info.spares if info is not None else gone.spares)
        members = tuple(new_member if m.node_id == gone.node_id else m for m in members)
        spare_nodes = tuple(n for n in spare_nodes if n != taker)
        lost = tuple(n for n in lost if n != gone.node_id)
    return dataclasses.replace(old, number=old.number + 1, swap_id=plan.id, reason=plan.reason,
                               assignments=assignments, members=members, spare_nodes=spare_nodes, lost=lost,
                               bootstrap=plan.store or old.bootstrap)


def _sealed(key: str, plan: SwapPlan) -> dict[str, Any]:
    """The plan as stored: with the MAC of the run key (tpassrun/records/provenance.py) when the run has one."""
    return seal(key, plan.to_json())


def _with_secret(plan: SwapPlan) -> SwapPlan:
    """The plan as the leader writes it: with a fresh secret that only the job's control plane ever sees."""
    return dataclasses.replace(plan, secret=secrets.token_hex(32))

def is_replayed(newest: dict[str, SwapPlan], plan: SwapPlan) -> bool:
    """Whether ``plan`` is an older version of one already read (``newest``, updated): a plan only ever grows its
    history, so fewer phases, or not terminal after terminal, is an old value written back. Its MAC is genuine
    (tpassrun/records/provenance.py binds a record to its key, not to its revision): anyone who can write to the etcd
    could replay it, e.g. a finished swap back into its SEND phase."""
    seen = newest.get(plan.id)
    if seen is not None and (len(plan.history) < len(seen.history) or (seen.terminal and not plan.terminal)):
        return True
    newest[plan.id] = plan
    return False


def _replayed(plan: SwapPlan) -> SwapPlan:
    raise RecordError(f"swap {plan.id}: an older version of the plan ({len(plan.history)} phases) written back")


def _mismatched_id(taint: Taint) -> Taint:
    raise RecordError(f"taint id {taint.id!r} differs from its key")
