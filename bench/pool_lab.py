"""The hosts of ``bench/pool_acceptance.py``: network namespaces on a bridge (``tests/faults.NetLab``), each with its
own host name and a link named ``tpeth0`` (as a cluster's NICs are named alike, so the ``GLOO_SOCKET_IFNAME`` a job
ships to a pool node is right there too), one etcd on the bridge's address, a spare pool, jobs of 2 agents with
``--spare-pool``, whole hosts killed and started again with the same command line, and a sampler that watches the
pool for a node held twice. Root only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from common import EtcdServer  # (puts tests/ on the path; kills what a stopped bench started)
from faults import Job, NetLab, descendants

from tpassrun.pool import Pool, PoolKeys, pool_prefix
from tpassrun.records.provenance import RunKey
from tpassrun.rendezvous import EtcdConfig, EtcdStore

IFACE = "tpeth0"
POOL_KEY = "pool-key-for-the-acceptance-0123456789"
RANKS = 4
# what a console says about the pool and the recoveries (the one-liners printed)
SAID = ("pool", "lost", "recovered", "migrate", "given back", "taint received", "spare node", "claimed", "back to")


@dataclass
class Host:
    name: str
    index: int
    addr: str
    jobs: list[Job] = field(default_factory=list)   # every agent started on it, the latest last

    @property
    def job(self) -> Job:
        return self.jobs[-1]


class Lab:
    """The hosts, the etcd, the pool: ``close()`` removes every process, namespace and directory it made."""

    def __init__(self, names: list[str], work: str, tag: str | None = None) -> None:
        self.work = work
        self.net = NetLab(tag or uuid.uuid4().hex[:4])
        self.hosts: dict[str, Host] = {}
        self.etcd: EtcdServer | None = None
        self.pool_name = "pool-" + uuid.uuid4().hex[:6]
        try:
            for i, name in enumerate(names, 1):
                addr = self.net.add_host(i)
                ns, _outer, inner, _ = self.net.hosts[i]
                for args in (("link", "set", inner, "down"), ("link", "set", inner, "name", IFACE),
                             ("link", "set", IFACE, "up")):
                    subprocess.run(["ip", "netns", "exec", ns, "ip", *args], check=True, capture_output=True,
                                   timeout=30)
                self.hosts[name] = Host(name, i, addr)
            self.etcd = EtcdServer(self.net.gateway).start()
        except BaseException:
            self.close()
            raise

    @property
    def endpoint(self) -> str:
        assert self.etcd is not None
        return self.etcd.endpoint

    def run_on(self, host: str, argv: list[str], out: str, env: dict[str, str]) -> Job:
        h = self.hosts[host]
        # a host of its own: its network namespace and its own host name (the consoles name nodes by host name)
        uts = ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', host]
        job = Job(argv=[*self.net.argv(h.index), *uts, *argv], out=out, env={"GLOO_SOCKET_IFNAME": IFACE, **env})
        h.jobs.append(job.start())
        return job

    def pool(self, op: str, key: str = POOL_KEY) -> Any:
        async def main() -> Any:
            async with EtcdStore(EtcdConfig.from_endpoint(self.endpoint, {"read_timeout": "5"})) as store:
                pool = Pool(store, PoolKeys(pool_prefix("/tpassrun/v1", self.pool_name)), RunKey.from_text(key),
                            self.pool_name)
                return await getattr(pool, op)()
        return asyncio.run(main())

    def status(self) -> dict[str, Any]:
        """``tpassctl pool status --json``, as an operator runs it."""
        out = subprocess.run([sys.executable, "-m", "tpassrun.ops.ctl", "pool", "status", self.pool_name,
                              "--rdzv-endpoint", self.endpoint, "--json"], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "TPASSRUN_POOL_KEY": POOL_KEY})
        if out.returncode != 0:
            raise RuntimeError(f"pool status: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def join_pool(self, host: str, node_id: str) -> Job:
        job = self.run_on(host, [sys.executable, "-m", "tpassrun.ops.ctl", "pool", "join", self.pool_name,
                                 "--rdzv-endpoint", self.endpoint, "--nproc-per-node", "2", "--node-id", node_id,
                                 "--local-addr", self.hosts[host].addr],
                          os.path.join(self.work, host), {"TPASSRUN_POOL_KEY": POOL_KEY})
        until(lambda: node_id in self.pool("read")[0].nodes, 120, f"pool node {node_id} registered", job)
        return job

    def close(self) -> None:
        for h in self.hosts.values():
            for j in h.jobs:
                j.kill()
        if self.etcd is not None:
            self.etcd.cleanup()
        self.net.close()


def until(pred: Callable[[], Any], timeout: float, what: str, *watch: Job) -> Any:
    """Poll ``pred`` until it is true; a deadline only catches a hang (and a watched process that exited)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        for j in watch:
            if j.proc is not None and j.proc.poll() is not None:
                raise AssertionError(f"{what}: the agent on {j.argv[10]} exited {j.proc.returncode}:\n"
                                     f"{j.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


@dataclass
class JobRun:
    """One job of the lab: its two hosts' agents and its shared training directory."""

    name: str
    hosts: tuple[str, str]
    train: str
    env: dict[str, str]

    def agents(self, lab: Lab) -> list[Job]:
        return [j for h in self.hosts for j in lab.hosts[h].jobs]

    def events(self, lab: Lab) -> list[dict[str, Any]]:
        seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        for j in self.agents(lab):
            for e in j.events():
                seen[(e.get("time"), e.get("event"), e.get("node"))] = e
        return sorted(seen.values(), key=lambda e: e["time"])

    def first(self, lab: Lab, name: str, since: float, pred: Callable[[dict[str, Any]], bool] = lambda e: True
              ) -> dict[str, Any] | None:
        return next((e for e in self.events(lab) if e["event"] == name and e["time"] >= since and pred(e)), None)

    def pids(self) -> dict[int, list[int]]:
        t = Job(argv=[], out=self.train)
        return {r: list(dict.fromkeys(row["pid"] for row in t.losses(r))) for r in range(RANKS)}

    def min_step(self) -> int:
        t = Job(argv=[], out=self.train)
        return min(t.step_reached(r) for r in range(RANKS))


def job_argv(lab: Lab, name: str, host: str, train: str, args: argparse.Namespace, pool_wait: float) -> list[str]:
    out = os.path.join(lab.work, host)
    return [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", lab.endpoint, "--rdzv-id", f"{name}-{lab.pool_name}", "--rdzv-conf",
            f"lease_ttl={args.lease_ttl},last_call_timeout=1", "--max-restarts", "1",
            "--local-addr", lab.hosts[host].addr, "--log-dir", os.path.join(out, "logs"),
            "--spare-pool", lab.pool_name, "--migrate-back", "--pool-wait", f"{pool_wait:g}",
            os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_ddp.py"),
            "--steps", str(args.steps), "--step-sleep", str(args.step_sleep), "--out", train, "--quiet"]


def start_job(lab: Lab, name: str, hosts: tuple[str, str], args: argparse.Namespace, pool_wait: float) -> JobRun:
    train = os.path.join(lab.work, f"train-{name}")
    env = {"TPASSRUN_POOL_KEY": POOL_KEY, "TPASSRUN_RUN_KEY": f"run-key-of-job-{name}-" + uuid.uuid4().hex}
    run = JobRun(name, hosts, train, env)
    for h in hosts:
        lab.run_on(h, job_argv(lab, name, h, train, args, pool_wait), os.path.join(lab.work, h), env)
    return run


def kill_host(job: Job) -> float:
    """The host dies: its agent's whole process group and every worker the agent started, SIGKILL, back to back.
    Returns the wall time of the kill."""
    assert job.proc is not None
    pids = [s["pid"] for e in job.events() if e["event"] == "workers_started" for s in e["slots"]]
    when = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.proc.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.proc.wait(10)
    return when


def restart_host(lab: Lab, host: str) -> Job:
    """The host's agent again, same command line, same log directory (its first console kept aside)."""
    old = lab.hosts[host].job
    shutil.copy(old.log_path, old.log_path + f".{len(lab.hosts[host].jobs)}")
    job = Job(argv=old.argv, out=old.out, env=old.env).start()
    lab.hosts[host].jobs.append(job)
    return job


def said(job: Job) -> list[str]:
    """The console lines of ``job``'s host (its first agent's too, when it was started again) about the pool and the
    recoveries."""
    text = job.log()
    if os.path.exists(job.log_path + ".1"):
        with open(job.log_path + ".1", errors="replace") as fh:
            text = fh.read() + text
    return [ln.strip() for ln in text.splitlines() if any(w in ln for w in SAID) and "Traceback" not in ln]


def idle_and_free(lab: Lab) -> bool:
    view = lab.pool("read")[0]
    return all(n.state == "idle" for n in view.nodes.values()) and not view.claims


def summarize_status(doc: dict[str, Any]) -> Any:
    return {k: doc[k] for k in ("nodes", "claims") if k in doc} or doc


def reference(args: argparse.Namespace, work: str) -> Job:
    ref = Job.torchrun(os.path.join(work, "ref"), nproc=RANKS, steps=args.steps, step_sleep=0.0,
                       script_args=["--ddp", "torch"]).start()
    assert ref.wait(600) == 0, ref.log()[-3000:]
    return ref


class Sampler:
    """Reads the pool every half second while a scenario runs and keeps what must never be: a node serving one job
    while claimed by another, two spare nodes at once on one pool node."""

    def __init__(self, lab: Lab, pool_jobs: dict[str, Job]) -> None:
        self.lab, self.pool_jobs = lab, pool_jobs
        self.bad: list[str] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                view = self.lab.pool("read")[0]
            except Exception:  # noqa: BLE001 - etcd busy: the next sample
                continue
            self.samples += 1
            for node_id, claim in view.claims.items():
                node = view.nodes.get(node_id)
                if node is not None and node.state == "serving" and node.job not in (None, claim.job):
                    self.bad.append(f"{node_id} serves {node.job} while claimed by {claim.job}")
            for node_id, job in self.pool_jobs.items():
                if job.proc is not None and job.proc.poll() is None:
                    spares = [p for p in descendants(job.proc.pid) if "--spare-node" in cmdline(p)
                              and "tpassrun" in cmdline(p) and "-c" not in cmdline(p).split()[:3]]
                    if len(spares) > 1:
                        self.bad.append(f"{node_id} runs {len(spares)} spare nodes at once")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def restart_pool_node(lab: Lab, host: str, node_id: str) -> Job:
    """The pool node's ``tpassctl pool join`` again, same command line; until it is in the pool again (a job waiting
    for the pool may claim it at once)."""
    job = restart_host(lab, host)
    until(lambda: node_id in lab.pool("read")[0].nodes, 120, f"{node_id} registered again", job)
    return job


