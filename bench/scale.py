"""The control plane at scale: N simulated agents' real control-plane code in one process against a real etcd.

    python bench/scale.py --nodes 64,256                     # one size after the other, a fresh run id each
    python bench/scale.py --nodes 1024 --faults 3 --members 3

Each simulated agent is the real code an agent runs for the control plane, minus its workers: its rendezvous
handle (lease, keepalive, registration, the generation and leader watches, the campaign), its swapper (the
participant's watches of ``swaps/``, ``taints/`` and its fallback key; the coordinator with its kick watch, its
triage and its writes on the leader), and the status loop publishing ``status/<node>`` once a second (the agent's
period) through the same put. The workers are a stand-in: every slot "runs" and reports a step in the status
record, and a node plan's phases are answered by reports written the way the participant writes them (pause:
the step every survivor stopped at and the mirror's copies; transfer: the joiners' addresses; send, re-form: ok),
so the leader's real coordinator drives the plan through every phase and commits the generation. No data plane.

The leader (the first agent: it wins the campaign) runs on an event loop of its own in a thread, so its CPU is
its own (pthread CPU clock); the other agents share the main loop, 32 to a gRPC connection (one process cannot hold
thousands of channels; each agent still has its own lease, watches and keys).

A fault is a node loss: a member's agent stops and its lease is revoked (what a peer's probe does for an agent
that is gone; a lease expiry adds the TTL, 10 s by default, before the same path). The lost node's ranks go to a
spare node (a node plan); the lost node comes back as a new spare node. Faults come at a 16,384-GPU job's rate
(one per 1.8 h) times ``--speedup``, at every size (the worst case for the smaller ones).

Figures per size (printed as a table; bench/README.md and docs/scale.md carry them): decision time (the loss ->
the node plan written in etcd, and -> its generation committed), etcd requests/s and bytes/s summed over the
members (from etcd's own /metrics) at rest and under faults, the leader's CPU per decision and at rest, memory per
agent (RSS), watch events per agent per fault, ``tpassctl status`` wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any, AsyncIterator, Callable, TypeVar

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "tests"))

from conftest import EtcdCluster, EtcdServer  # noqa: E402  (tests/ is not a package)

from tpassrun.records import Keys, NodeStatus, Phase, Report, SwapKind, SwapPlan, WorkerRow, load  # noqa: E402
from tpassrun.rendezvous import (  # noqa: E402
    EtcdConfig,
    EtcdConnection,
    EtcdRendezvous,
    EtcdStore,
    EventKind,
    Generation,
    NodeInfo,
    RendezvousSettings,
)
from tpassrun.swapper import Swapper  # noqa: E402
from tpassrun.swapper.agentport import AgentPort, SwapSettings  # noqa: E402

T = TypeVar("T")
NPROC = 8
STEP = 1000                     # the step every stand-in worker stopped at when a plan pauses them
FAILURE_EVERY_S = 1.8 * 3600    # a 16,384-GPU job's mean time between failures (the seeds' number)


# ------------------------------------------------------------------------------------------ counting watch events
_WATCH = EtcdStore._watch


async def _counted_watch(self: EtcdStore, *a: Any, **kw: Any) -> AsyncIterator[Any]:
    async with contextlib.aclosing(_WATCH(self, *a, **kw)) as events:
        async for ev in events:
            self.watch_events = getattr(self, "watch_events", 0) + 1   # type: ignore[attr-defined]
            yield ev


def count_watch_events() -> None:
    """Every EtcdStore counts the watch events it receives (the simulation's stores; installed when one runs)."""
    EtcdStore._watch = _counted_watch    # type: ignore[method-assign]


def watch_events(store: EtcdStore) -> int:
    return int(getattr(store, "watch_events", 0))


# ------------------------------------------------------------------------------------------ one simulated agent
class Sink:
    trace = False

    def write(self, event: str, **fields: Any) -> None:
        if self.trace:
            say(f"leader event {event} {fields}")


class StandIn(Swapper):
    """The participant with its workers replaced: each phase of a node plan answered as the real participant
    would report it (tpassrun/swapper/nodeswap.py), at once."""

    def __init__(self, port: AgentPort, agent: "SimAgent") -> None:
        super().__init__(port)
        self.agent = agent

    async def _participate(self, plan: SwapPlan) -> Report | None:
        me, phase = self.port.node_id, plan.phase
        if plan.kind != SwapKind.NODE:
            return None
        joiners = {m.rank: m.joiner for m in plan.moves if m.joiner.node == me}
        if phase == Phase.PAUSE and me in plan.nodes:
            ranks = len(self.agent.ranks)
            return Report(node=me, phase=phase, steps=(STEP,) * ranks,
                          held={r: (STEP - 1, STEP) for r in plan.ranks})
        if phase == Phase.TRANSFER and joiners:
            return Report(node=me, phase=phase, joiner_addrs={r: ("127.0.0.1", 20000 + r) for r in joiners})
        if phase == Phase.SEND and joiners:
            return Report(node=me, phase=phase)
        if phase == Phase.REFORM and me in plan.nodes:
            return Report(node=me, phase=phase)
        if phase == Phase.DONE and joiners:
            for rank, ref in joiners.items():
                self.agent.ranks[ref.slot] = rank
            await self.agent.publish_status()
        return None


class SimAgent:
    def __init__(self, sim: "Sim", node_id: str, *, spare_node: bool, connection: EtcdConnection | None) -> None:
        self.sim = sim
        self.node_id = node_id
        self.ranks: dict[int, int | None] = {i: None for i in range(NPROC)}   # slot -> rank
        self.rdzv = EtcdRendezvous(sim.cfg, sim.settings, NodeInfo(node_id, "127.0.0.1", NPROC, spare_node=spare_node),
                                   connection=connection)

        async def nothing(*_a: Any) -> None:
            return None

        self.port = AgentPort(node_id=node_id, addr="127.0.0.1", settings=SwapSettings(NPROC, 0), events=Sink(),
                              rdzv=self.rdzv, slots=None,  # type: ignore[arg-type]  # the stand-in has no slots
                              generation=lambda: self.rdzv.generation, spawned_generation=lambda: sim.formed,
                              master=lambda: ("127.0.0.1", 29500), set_generation=lambda g: None,
                              spawn_spare=nothing, publish_status=self.publish_status, post=lambda ev: None,
                              formed_generation=lambda: sim.formed)
        self.swapper = StandIn(self.port, self)
        self.tasks: list[asyncio.Task[Any]] = []

    async def publish_status(self) -> None:
        gen = self.rdzv.generation
        workers = tuple(WorkerRow(i, rank=r, local_rank=i, state="running" if r is not None else "spare",
                                  step=STEP, managed=True, spare=r is None, last_step_ms=250.0)
                        for i, r in self.ranks.items())
        status = NodeStatus(self.node_id, addr="127.0.0.1", pid=os.getpid(),
                            generation=gen.number if gen else None, workers=workers, time=time.time())
        with contextlib.suppress(Exception):
            await self.rdzv.store.put_json(Keys(self.rdzv.key("")).status(self.node_id), status.to_json(), lease=True)

    async def _status_loop(self) -> None:
        await asyncio.sleep(random.random() * self.sim.status_period)    # agents do not start in step
        while True:
            await self.publish_status()
            await asyncio.sleep(self.sim.status_period)

    async def _pump(self) -> None:
        """The agent's supervision, for what the swapper hears from the rendezvous (agent/supervise.py)."""
        async for ev in self.rdzv.events():
            if ev.kind == EventKind.NODE_LOST and ev.node_id:
                await self.swapper.on_node_lost(ev.node_id)

    def start(self, gen: Generation) -> None:
        for coro in (self._status_loop(), self._pump(), self.swapper.run(gen)):
            self.tasks.append(asyncio.ensure_future(coro))

    async def stop(self, *, revoke: bool = True) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
        if revoke:
            await self.rdzv.__aexit__(None, None, None)


# ------------------------------------------------------------------------------------------ etcd's own counters
def etcd_counters(endpoints: list[str]) -> dict[str, float]:
    """Summed over the members: gRPC messages received (every request, a keepalive or a watch creation too), bytes
    received/sent on the client port, watch events sent."""
    out = {"requests": 0.0, "rx": 0.0, "tx": 0.0, "events": 0.0, "rss": 0.0}
    for ep in endpoints:
        with urllib.request.urlopen(f"http://{ep}/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_msg_received_total"):
                out["requests"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_network_client_grpc_received_bytes_total"):
                out["rx"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_network_client_grpc_sent_bytes_total"):
                out["tx"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_debugging_mvcc_events_total"):
                out["events"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("process_resident_memory_bytes"):
                out["rss"] += float(line.rsplit(" ", 1)[1])
    return out


def rate(a: dict[str, float], b: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: (b[k] - a[k]) / seconds for k in a if k != "rss"}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------------------------------------ the leader's own process
class LeaderProcess:
    """The leader's agent in a process of its own (``--leader-child``), so its CPU and its latency are its own, not
    shared (through the GIL) with the thousands of agents simulated here. Lines on its stdin: ``stats`` (answered
    with one JSON line: its process CPU seconds and watch events), ``stop``."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, sim: "Sim") -> "LeaderProcess":
        conf = {"endpoints": sim.endpoints, "run_id": sim.run_id, "n": sim.n, "status_period": sim.status_period,
                "lease_ttl": sim.lease_ttl, "trace": sim.trace}
        proc = await asyncio.create_subprocess_exec(sys.executable, os.path.abspath(__file__), "--leader-child",
                                                    json.dumps(conf), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self = cls(proc)
        assert await self.line() == "leading"
        return self

    async def line(self) -> str:
        assert self.proc.stdout is not None
        text = (await asyncio.wait_for(self.proc.stdout.readline(), 600)).decode().strip()
        if not text:
            raise RuntimeError(f"the leader's process ended ({await self.proc.wait()})")
        return text

    async def stats(self) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stats\n")
        await self.proc.stdin.drain()
        return dict(json.loads(await self.line()))

    async def stop(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(ConnectionError):
                self.proc.stdin.write(b"stop\n")
                await self.proc.stdin.drain()
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()


async def leader_child(conf: dict[str, Any]) -> None:
    """The leader's side of :class:`LeaderProcess`."""
    sim = Sim(conf["endpoints"], conf["n"], spares=0, status_period=conf["status_period"], lease_ttl=conf["lease_ttl"],
              per_connection=1, trace=conf["trace"], run_id=conf["run_id"])
    count_watch_events()
    agent = SimAgent(sim, "node00000", spare_node=False, connection=None)
    agent.port.events.trace = sim.trace   # type: ignore[attr-defined]
    if sim.trace:
        tick = agent.swapper.coordinator._leader_tick

        async def timed() -> None:
            t0, c0 = time.perf_counter(), cpu_s()
            await tick()
            say(f"leader tick {1000 * (time.perf_counter() - t0):.1f} ms, cpu {1000 * (cpu_s() - c0):.1f} ms")
        agent.swapper.coordinator._leader_tick = timed   # type: ignore[method-assign]
    await agent.rdzv.__aenter__()
    for _ in range(200):
        if agent.rdzv.is_leader:
            break
        await asyncio.sleep(0.05)
    print("leading" if agent.rdzv.is_leader else "not leading", flush=True)
    gen = await agent.rdzv.join()
    sim.formed = gen.number
    for rank, (node, slot) in gen.homes().items():
        if node == agent.node_id:
            agent.ranks[slot] = rank
    agent.start(gen)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "stats":
            print(json.dumps({"cpu": cpu_s(), "events": watch_events(agent.rdzv.store)}), flush=True)
        else:
            break
    with contextlib.suppress(Exception):
        await agent.rdzv.close("bench done")
    await agent.stop()


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ------------------------------------------------------------------------------------------ one size
@dataclasses.dataclass
class Sim:
    endpoints: list[str]
    n: int
    spares: int
    status_period: float
    lease_ttl: int
    per_connection: int
    trace: bool = False
    run_id: str = ""
    formed: int = 0

    def __post_init__(self) -> None:
        self.run_id = self.run_id or f"scale-{self.n}-{uuid.uuid4().hex[:6]}"
        self.cfg = EtcdConfig.from_endpoint(",".join(self.endpoints), {"read_timeout": "60"})
        self.settings = RendezvousSettings(run_id=self.run_id, min_nodes=self.n, max_nodes=self.n,
                                           lease_ttl=self.lease_ttl, join_timeout=600, last_call_timeout=0)
        self.connections: list[EtcdConnection] = []
        self.agents: dict[str, SimAgent] = {}     # every agent but the leader (its own process)
        self.leader: LeaderProcess | None = None
        self.restarted = 0

    def connection(self) -> EtcdConnection:
        if not self.connections or self._on_last >= self.per_connection:
            self.connections.append(EtcdConnection(self.cfg))
            self._on_last = 0
        self._on_last += 1
        return self.connections[-1]

    _on_last = 0

    async def leader_stats(self) -> dict[str, float]:
        assert self.leader is not None
        return await self.leader.stats()

    async def start(self) -> dict[str, float]:
        rss0 = rss_mib()
        t0 = time.perf_counter()
        self.leader = await LeaderProcess.start(self)     # first: it wins the campaign
        others = [SimAgent(self, f"node{i:05d}", spare_node=False, connection=self.connection())
                  for i in range(1, self.n)]
        spares = [SimAgent(self, f"spare{i:04d}", spare_node=True, connection=self.connection())
                  for i in range(self.spares)]
        await asyncio.gather(*(c.open() for c in self.connections))
        await asyncio.gather(*(a.rdzv.__aenter__() for a in others))
        for a in others:
            self.agents[a.node_id] = a
        t_open = time.perf_counter() - t0
        t1 = time.perf_counter()
        gens = await asyncio.gather(*(a.rdzv.join() for a in others))
        gen = gens[0]
        assert len(gen.members) == self.n and "node00000" in gen.member_ids, len(gen.members)
        await asyncio.gather(*(a.rdzv.__aenter__() for a in spares))
        await asyncio.gather(*(a.rdzv.join() for a in spares))
        for a in spares:
            self.agents[a.node_id] = a
        t_form = time.perf_counter() - t1
        self.formed = gen.number
        for rank, (node, slot) in gen.homes().items():
            if node in self.agents:
                self.agents[node].ranks[slot] = rank
        for a in self.agents.values():
            a.start(gen)
        return {"open_s": t_open, "form_s": t_form, "rss_mib": rss_mib() - rss0}

    async def lose(self, victim: SimAgent, observer: "Observer") -> dict[str, float]:
        """One node loss: its agent stops and its lease is revoked; the time until the node plan is in etcd, and
        until it is done (the generation that replaces the node committed)."""
        await victim.stop(revoke=False)
        del self.agents[victim.node_id]
        before = {a.node_id: watch_events(a.rdzv.store) for a in self.agents.values()}
        cpu0 = (await self.leader_stats())["cpu"]
        observer.reset()
        t0 = time.perf_counter()
        await victim.rdzv.__aexit__(None, None, None)   # the lease revoked: its keys vanish
        planned = await observer.until(lambda p: p.kind == SwapKind.NODE and p.lost_node == victim.node_id, 120)
        t_plan = observer.seen[planned.id] - t0
        cpu_plan = (await self.leader_stats())["cpu"] - cpu0
        done = await observer.until(lambda p: p.id == planned.id and p.terminal, 120)
        t_done = time.perf_counter() - t0
        assert done.phase == Phase.DONE, done.outcome
        t_lost = (observer.lost_at - t0) if observer.lost_at else float("nan")
        await asyncio.sleep(0.5)      # the last watch events of this fault arrive
        cpu_done = (await self.leader_stats())["cpu"] - cpu0
        after = {a.node_id: watch_events(a.rdzv.store) for a in self.agents.values()}
        per_agent = [after[n] - before[n] for n in before if n in after]
        # the lost node comes back as a new spare node
        self.restarted += 1
        back = SimAgent(self, f"back{self.restarted:04d}", spare_node=True, connection=self.connection())
        await back.rdzv.__aenter__()
        gen = await back.rdzv.join()
        self.agents[back.node_id] = back
        back.start(gen)
        return {"lost_s": t_lost, "plan_s": t_plan, "done_s": t_done, "cpu_plan_s": cpu_plan, "cpu_done_s": cpu_done,
                "events_mean": statistics.mean(per_agent), "events_max": max(per_agent)}

    async def stop(self) -> None:
        if self.leader is not None:
            await self.leader.stop()
        await asyncio.gather(*(a.stop() for a in self.agents.values()))
        await asyncio.gather(*(c.close() for c in self.connections))


class Observer:
    """The bench's own eyes on etcd (not counted as an agent): the plans as written, the lost annotation."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.store = EtcdStore(sim.cfg)
        self.plans: list[SwapPlan] = []
        self.seen: dict[str, float] = {}     # plan id -> when its first version arrived
        self.changed = asyncio.Event()
        self.lost_at = 0.0
        self.tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        await self.store.open()
        keys = Keys(self.sim.settings.run_prefix)
        self.tasks = [asyncio.ensure_future(self._plans(keys.family("swaps"))),
                      asyncio.ensure_future(self._generation(self.sim.settings.run_prefix + "generation"))]

    async def _plans(self, prefix: str) -> None:
        async for ev in self.store.watch_prefix(prefix):
            plan = load(SwapPlan.from_json, ev.key, ev.value, ev.mod_revision) if ev.kind == "put" else None
            if plan is not None:
                self.seen.setdefault(plan.id, time.perf_counter())
                self.plans.append(plan)
                self.changed.set()

    async def _generation(self, key: str) -> None:
        async for ev in self.store.watch_key(key):
            if ev.kind == "put" and ev.value and ev.value.get("lost") and not self.lost_at:
                self.lost_at = time.perf_counter()

    def reset(self) -> None:
        self.lost_at = 0.0

    async def until(self, pred: Callable[[SwapPlan], bool], timeout: float) -> SwapPlan:
        deadline = time.monotonic() + timeout
        while True:
            hit = next((p for p in reversed(self.plans) if pred(p)), None)
            if hit is not None:
                return hit
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.store.close()


def tpassctl_status_s(endpoints: list[str], run_id: str) -> float:
    """``tpassctl status`` (the console script, a process of its own) wall time, text and --json."""
    exe = os.path.join(os.path.dirname(sys.executable), "tpassctl")
    t0 = time.perf_counter()
    subprocess.run([exe, "status", "--rdzv-endpoint", ",".join(endpoints), "--rdzv-id", run_id],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=120)
    return time.perf_counter() - t0


async def one_size(endpoints: list[str], n: int, args: argparse.Namespace) -> dict[str, Any]:
    count_watch_events()
    sim = Sim(endpoints, n, spares=args.spare_nodes, status_period=args.status_period, lease_ttl=args.lease_ttl,
              per_connection=args.agents_per_connection, trace=args.trace)
    row: dict[str, Any] = {"n": n}
    try:
        row.update(await sim.start())
        say(f"{n} nodes: {len(sim.agents)} agents up ({row['open_s']:.1f} s open, {row['form_s']:.1f} s formed)")
        observer = Observer(sim)
        await observer.start()
        gen_bytes = len(json.dumps((await observer.store.get_json(sim.settings.run_prefix + "generation"))[0]))
        row["gen_kib"] = gen_bytes / 1024
        await asyncio.sleep(args.settle)
        # at rest
        l0 = await sim.leader_stats()
        c0, t0 = etcd_counters(endpoints), time.perf_counter()
        ev0 = {a.node_id: watch_events(a.rdzv.store) for a in sim.agents.values()}
        await asyncio.sleep(args.rest)
        c1, t1 = etcd_counters(endpoints), time.perf_counter()
        l1 = await sim.leader_stats()
        ev1 = {a.node_id: watch_events(a.rdzv.store) for a in sim.agents.values()}
        rest = rate(c0, c1, t1 - t0)
        leader_events = l1["events"] - l0["events"]
        row.update(rest_req=rest["requests"], rest_rx=rest["rx"], rest_tx=rest["tx"],
                   rest_leader_cpu=(l1["cpu"] - l0["cpu"]) / (t1 - t0),
                   rest_events_agent=(sum(ev1[k] - ev0[k] for k in ev0) + leader_events) / (t1 - t0) / (len(ev0) + 1),
                   rest_events_leader=leader_events / (t1 - t0),
                   rest_events_follower_max=max(ev1[k] - ev0[k] for k in ev0),
                   etcd_rss_mib=c1["rss"] / 2**20)
        row["status_s"] = tpassctl_status_s(endpoints, sim.run_id) if args.ctl else float("nan")
        # faults: node losses at a 16,384-GPU job's rate x speedup
        interval = FAILURE_EVERY_S / args.speedup
        rng = random.Random(n)
        faults = []
        c2, t2 = etcd_counters(endpoints), time.perf_counter()
        for k in range(args.faults):
            start = time.perf_counter()
            victim = rng.choice([a for a in sim.agents.values()
                                 if any(r is not None for r in a.ranks.values())])
            faults.append(await sim.lose(victim, observer))
            say(f"{n} nodes: fault {k + 1}: {json.dumps({k: round(v, 3) for k, v in faults[-1].items()})}")
            wait = interval - (time.perf_counter() - start)
            if k < args.faults - 1 and wait > 0:
                await asyncio.sleep(wait)
        c3, t3 = etcd_counters(endpoints), time.perf_counter()
        under = rate(c2, c3, t3 - t2)
        row.update(fault_req=under["requests"], fault_rx=under["rx"], fault_tx=under["tx"], faults=faults)
        row["rss_total_mib"] = rss_mib()
        await observer.stop()
    finally:
        await sim.stop()
    return row


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def med(faults: list[dict[str, float]], key: str) -> float:
    return statistics.median(f[key] for f in faults) if faults else float("nan")


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    mib = 2**20
    out = [f"etcd: {args.members} member(s); {NPROC} ranks per node; status every {args.status_period:g} s; "
           f"lease ttl {args.lease_ttl} s; faults: node losses (lease revoked), medians of {args.faults}",
           "",
           f"{'nodes':>6} {'lost':>7} {'plan':>7} {'done':>7} {'ldr cpu':>8} {'ldr cpu':>8} {'watch ev':>9} "
           f"{'MiB/':>6} {'status':>7} {'gen':>6}",
           f"{'':>6} {'':>7} {'(decide)':>7} {'':>7} {'/decide':>8} {'at rest':>8} {'/agent':>9} "
           f"{'agent':>6} {'(ctl)':>7} {'KiB':>6}",
           f"{'':>6} {'':>7} {'':>7} {'':>7} {'':>8} {'':>8} {'/fault':>9} {'':>6} {'':>7} {'':>6}"]
    for r in rows:
        f = r["faults"]
        out.append(f"{r['n']:>6} {med(f, 'lost_s') * 1000:>5.0f}ms {med(f, 'plan_s') * 1000:>5.0f}ms "
                   f"{med(f, 'done_s') * 1000:>5.0f}ms {med(f, 'cpu_plan_s') * 1000:>6.0f}ms "
                   f"{r['rest_leader_cpu'] * 100:>7.1f}% {med(f, 'events_mean'):>9.1f} "
                   f"{r['rss_mib'] / (r['n'] + args.spare_nodes):>6.2f} {r['status_s']:>6.2f}s {r['gen_kib']:>6.1f}")
    out += ["", f"{'nodes':>6} {'req/s':>8} {'rx MiB/s':>9} {'tx MiB/s':>9} {'req/s':>8} {'rx MiB/s':>9} "
                f"{'tx MiB/s':>9} {'ev/agent/s':>11} {'open':>6} {'form':>6}",
            f"{'':>6} {'at rest':>8} {'':>9} {'':>9} {'faults':>8} {'':>9} {'':>9} {'at rest':>11}"]
    for r in rows:
        out.append(f"{r['n']:>6} {r['rest_req']:>8.0f} {r['rest_rx'] / mib:>9.2f} {r['rest_tx'] / mib:>9.2f} "
                   f"{r['fault_req']:>8.0f} {r['fault_rx'] / mib:>9.2f} {r['fault_tx'] / mib:>9.2f} "
                   f"{r['rest_events_agent']:>11.2f} {r['open_s']:>5.1f}s {r['form_s']:>5.1f}s")
    return "\n".join(out)


async def main(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.nodes.split(",")]
    etcd: EtcdCluster | EtcdServer = EtcdCluster().start() if args.members == 3 else EtcdServer().start()
    endpoints = etcd.endpoints.split(",") if isinstance(etcd, EtcdCluster) else [etcd.endpoint]
    rows = []
    try:
        for n in sizes:
            rows.append(await one_size(endpoints, n, args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        etcd.cleanup()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(table(rows, args))
    print(f"(bench process: max RSS {usage.ru_maxrss / 1024:.0f} MiB, CPU {usage.ru_utime + usage.ru_stime:.0f} s)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="64,256", help="comma-separated sizes (member nodes, 8 ranks each)")
    p.add_argument("--members", type=int, choices=(1, 3), default=3, help="etcd members (3: the tests' cluster)")
    p.add_argument("--spare-nodes", type=int, default=2)
    p.add_argument("--faults", type=int, default=3, help="node losses per size")
    p.add_argument("--speedup", type=float, default=1000.0,
                   help="faults come at a 16,384-GPU job's rate (one per 1.8 h) times this")
    p.add_argument("--status-period", type=float, default=1.0, help="seconds between status/ writes (agent: 1)")
    p.add_argument("--lease-ttl", type=int, default=10)
    p.add_argument("--rest", type=float, default=5.0, help="seconds measured at rest")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after the start before measuring")
    p.add_argument("--agents-per-connection", type=int, default=32)
    p.add_argument("--uvloop", action="store_true")
    p.add_argument("--no-ctl", dest="ctl", action="store_false", help="do not time tpassctl status")
    p.add_argument("--trace", action="store_true", help="print the leader's events and ticks")
    p.add_argument("--leader-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.leader_child:
        asyncio.run(leader_child(json.loads(a.leader_child)))
    elif a.uvloop:
        import uvloop
        uvloop.run(main(a))
    else:
        asyncio.run(main(a))
