"""The chaos harness's cluster: one external etcd, agents on their own hosts (network namespaces when root), a
small disk for their logs, in-process fault switches, and what the cluster says (events, etcd, loss logs).

Used by ``bench/chaos.py`` (the fault kinds and the report live there and in ``bench/chaos_kinds.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "tests"))

import common  # noqa: E402,F401  (a run stopped by SIGTERM/SIGHUP kills every agent and etcd it started)
from conftest import EtcdServer  # noqa: E402
from faults import EXAMPLE, FaultSwitches, Job, NetLab, SmallDisk, alive, faults_env  # noqa: E402

RANKS = 4


@dataclass
class Agent:
    name: str
    host: int                      # NetLab host index (0: no netns)
    job: Job
    event_log: str
    spare_node: bool = False
    killed: bool = False
    started: float = field(default_factory=time.time)

    @property
    def pid(self) -> int | None:
        return self.job.proc.pid if self.job.proc is not None else None

    @property
    def running(self) -> bool:
        return self.job.proc is not None and self.job.proc.poll() is None

    def events(self) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(OSError), open(self.event_log) as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


class Cluster:
    """Everything one chaos job runs on; ``close()`` removes it all (processes, netns, mounts)."""

    def __init__(self, work: str, *, steps: int, step_sleep: float, hang_timeout: float, netns: bool,
                 small_disk: bool, lease_ttl: int = 10, extra_faults: tuple[dict[str, Any], ...] = ()) -> None:
        self.work = work
        self.steps, self.step_sleep, self.hang_timeout, self.lease_ttl = steps, step_sleep, hang_timeout, lease_ttl
        self.run_id = "chaos-" + uuid.uuid4().hex[:8]
        self.train = os.path.join(work, "train")
        self.lab = NetLab(uuid.uuid4().hex[:4]) if netns else None
        self.etcd = EtcdServer(self.lab.gateway if self.lab else "127.0.0.1").start()
        self.disk = SmallDisk(os.path.join(work, "logs"), size_mb=256) if small_disk else None
        self.logs = self.disk.path if self.disk else os.path.join(work, "logs")
        self.switches = FaultSwitches(os.path.join(work, "markers"), RANKS)
        self.extra_faults = list(extra_faults)     # e.g. the hold that keeps the job from ending before the faults
        self.agents: list[Agent] = []
        self._hosts = 0
        # the etcd has no auth: every agent gets the run key that seals swap plans and reports
        # (tpassrun/records/provenance.py), from a file only this user can read, as a multi-node job would
        self.run_key_file = os.path.join(work, "run.key")
        fd = os.open(self.run_key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")

    @property
    def endpoint(self) -> str:
        return self.etcd.endpoint

    @property
    def prefix(self) -> str:
        return f"/tpassrun/v1/{self.run_id}/"

    # --- agents ---------------------------------------------------------------------------------------
    def start_agent(self, *, spare_node: bool = False) -> Agent:
        self._hosts += 1
        i = self._hosts
        name = f"n{i}"
        out = os.path.join(self.work, name)
        os.makedirs(out, exist_ok=True)
        prefix, env, local = [], {}, []
        if self.lab is not None:
            addr = self.lab.add_host(i)
            prefix, env, local = self.lab.argv(i), self.lab.env(i), ["--local-addr", addr]
        event_log = os.path.join(out, "events.jsonl")
        conf = (f"lease_ttl={self.lease_ttl},last_call_timeout=1,read_timeout=10,reconnect_timeout=120,"
                f"join_timeout=600,run_key_file={self.run_key_file}")
        argv = [*prefix, sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "2",
                "--spares-per-node", "1", "--max-restarts", "50", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id, "--rdzv-conf", conf,
                "--hang-timeout", str(self.hang_timeout), *local, "--log-dir", os.path.join(self.logs, name),
                "--tee", "3", "--event-log", event_log, *(["--spare-node"] if spare_node else []),
                EXAMPLE, "--steps", str(self.steps), "--step-sleep", str(self.step_sleep), "--out", self.train,
                "--quiet"]
        job = Job(argv=argv, out=out, env={**env, **faults_env(*self.switches.faults, *self.extra_faults)}).start()
        agent = Agent(name, i if self.lab else 0, job, event_log, spare_node=spare_node)
        self.agents.append(agent)
        return agent

    def start_job(self, timeout: float = 300) -> None:
        """Two members and a ``--spare-node``, until the job is at full strength and rank 0 is past step 3."""
        for _ in range(2):
            self.start_agent()
        self.start_agent(spare_node=True)
        deadline = time.monotonic() + timeout
        while not self.steady()[0] or self.step(0) < 3:
            if time.monotonic() > deadline or not self.running():
                raise SystemExit("the chaos job did not start:\n" + "\n".join(a.job.log()[-1500:] for a in self.agents))
            time.sleep(0.3)

    def live_agents(self) -> list[Agent]:
        return [a for a in self.agents if not a.killed]

    def kill_agent(self, agent: Agent) -> None:
        agent.killed = True
        if agent.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(agent.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                agent.job.proc.wait(10)

    def running(self) -> bool:
        live = self.live_agents()
        return bool(live) and all(a.running for a in live)

    def any_running(self) -> bool:
        return any(a.running for a in self.live_agents())

    # --- what the cluster says ------------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        return sorted((e for a in self.agents for e in a.events()), key=lambda e: e.get("time", 0))

    def losses(self, rank: int) -> list[dict[str, Any]]:
        path = os.path.join(self.train, f"loss_rank{rank}.jsonl")
        rows = []
        with contextlib.suppress(OSError), open(path) as fh:
            for line in fh:
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line))
        return rows

    def step(self, rank: int = 0) -> int:
        rows = self.losses(rank)
        return rows[-1]["step"] if rows else -1

    def pid_of_rank(self, rank: int) -> int | None:
        rows = self.losses(rank)
        if rows and alive(rows[-1]["pid"]):
            return rows[-1]["pid"]
        return None

    def etcd_call(self, fn: Any, timeout: float = 10.0) -> Any:
        """Run ``fn(store)`` (a coroutine function) against the run's etcd; None when etcd does not answer."""
        from tpassrun.rendezvous import EtcdConfig, EtcdStore

        async def go() -> Any:
            config = EtcdConfig.from_endpoint(self.endpoint, {"read_timeout": "3", "reconnect_timeout": "3"})
            async with EtcdStore(config) as store:
                return await fn(store)

        try:
            return asyncio.run(asyncio.wait_for(go(), timeout))
        except Exception:  # noqa: BLE001 - etcd down or restarting: the caller retries
            return None

    def snapshot(self) -> dict[str, Any] | None:
        """What etcd says now: the generation, every node's worker table, the swap plans, the taints."""
        from tpassrun.records import Keys, NodeStatus, SwapPlan, load

        keys = Keys(self.prefix)

        async def read(store: Any) -> dict[str, Any]:
            gen, _ = await store.get_json(self.prefix + "generation")
            status = {}
            for key, doc, rev in await store.get_prefix_json(keys.family("status")):
                st = load(NodeStatus.from_json, key, doc, rev)
                if st is not None:
                    status[st.node_id] = st
            plans = [p for p in (load(SwapPlan.from_json, k, d, r)
                                 for k, d, r in await store.get_prefix_json(keys.family("swaps"))) if p is not None]
            taints = [k for k, _d, _r in await store.get_prefix_json(keys.family("taints"))]
            return {"generation": gen, "status": status, "plans": plans, "taints": taints}

        return self.etcd_call(read)

    def steady(self) -> tuple[bool, str]:
        """Whether the job is back to full strength: an active generation, every rank running, a ready spare, no
        swap in flight. The reason when not."""
        snap = self.snapshot()
        if snap is None:
            return False, "etcd does not answer"
        gen = snap["generation"] or {}
        if gen.get("state") != "active":
            return False, f"generation {gen.get('number')} is {gen.get('state')}"
        busy = [p.id for p in snap["plans"] if not p.terminal]
        if busy:
            return False, f"swap {busy[0]} in flight"
        lost = set(gen.get("lost") or ())
        for member in gen.get("members", []):
            # a member lost that held no rank any more (swaps had moved them all) keeps its place, marked lost,
            # until the next restart: nothing of the job waits for it
            if member.get("node_id") not in snap["status"] and member.get("node_id") not in lost:
                return False, f"no status from {member.get('node_id')}"
        # a swap may move a rank to another node's spare (the spare node's too): count them job-wide
        ranks = {w.rank for st in snap["status"].values() for w in st.workers
                 if w.state == "running" and w.rank is not None}
        if ranks != set(range(RANKS)):
            return False, f"ranks running: {sorted(ranks)}"
        # a ready spare somewhere (a member's, or the spare node's): a spare re-warming after a swap takes ~40 s
        # on a loaded host, and the next fault need not wait for that one
        if not any(w.state == "spare" and w.managed for st in snap["status"].values() for w in st.workers):
            return False, "no ready spare anywhere"
        return True, "steady"

    def release_handled_taints(self) -> None:
        """``tpassctl untaint`` for every taint whose swap is over (its slot goes back to the spare pool, as an
        operator does once the GPU is fixed); queued taints stay."""
        from tpassrun.records import Keys, SwapPlan, Taint, load

        keys = Keys(self.prefix)

        async def release(store: Any) -> None:
            plans = {p.id: p for p in (load(SwapPlan.from_json, k, d, r)
                                       for k, d, r in await store.get_prefix_json(keys.family("swaps"))) if p}
            for key, doc, rev in await store.get_prefix_json(keys.family("taints")):
                t = load(Taint.from_json, key, doc, rev)
                done = t is not None and t.handled_by is not None and (
                    t.handled_by not in plans or plans[t.handled_by].terminal)
                if t is None or done:
                    await store.delete(key)
        self.etcd_call(release)

    def untaint_all(self) -> None:
        async def clear(store: Any) -> None:
            for key, _d, _r in await store.get_prefix_json(self.prefix + "taints/"):
                await store.delete(key)
        self.etcd_call(clear)

    # --- cleanup --------------------------------------------------------------------------------------
    def close(self) -> None:
        for a in self.agents:
            with contextlib.suppress(Exception):
                a.job.kill()
        for pid in self.our_processes():   # e.g. a SIGSTOPped worker: nothing of the run outlives the harness
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.etcd.cleanup()
        if self.disk is not None:
            self.disk.close()
        if self.lab is not None:
            self.lab.close()


    def our_processes(self) -> list[int]:
        """Live processes of this run (agents, workers, spares, stores): those whose command line or environment
        (the fault switches' markers live in the work directory) names this run's work directory or id. Zombies
        do not count."""
        out = []
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == os.getpid():
                continue
            text = ""
            for part in ("cmdline", "environ"):
                with contextlib.suppress(OSError), open(f"/proc/{name}/{part}", "rb") as fh:
                    text += fh.read().decode(errors="replace")
            if (self.work in text or self.run_id in text) and alive(int(name)):
                out.append(int(name))
        return out

    @staticmethod
    def describe(pid: int) -> str:
        """``pid``'s state, parent and command line, as the orphans line prints it (what was left, not only a pid)."""
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().decode(errors="replace").replace("\0", " ").strip()
        except OSError:
            return f"{pid} (gone)"
        return f"{pid} {fields[0]} ppid={fields[1]}: {argv[:200]}"
