"""Issue 24's acceptance on separate hosts: two jobs sharing one pool node, real agents, network namespaces.

    .venv/bin/python bench/pool_acceptance.py share [--trials 1] [--steps 400] [--step-sleep 0.5]
    .venv/bin/python bench/pool_acceptance.py heal

Root only (iproute2). Every agent is a host of its own: a network namespace on a bridge (``tests/faults.NetLab``), the
one etcd on the bridge's address; each host's link has the same name (``tpeth0``), as a cluster's NICs do, so the
``GLOO_SOCKET_IFNAME`` a job ships to the pool node is right there too. The pool node learns its own address from
``PET_LOCAL_ADDR`` (the spare node it starts reads it as ``--local-addr``; on real hosts ``getfqdn()`` does).

``share``: job A (hosts a1, a2) and job B (b1, b2), each 2 nodes x 2 ranks, no spares of their own,
``--spare-pool P --migrate-back``, and one pool node (host p). A's node a2 dies at a random instant (its agent's
whole process group and its workers, SIGKILL): the pool node joins A, A recovers live. Then B's node b2 dies: B finds
the pool empty, says so, waits (``--pool-wait``). a2's agent is started again on its host with the same command line:
it rejoins A as a spare node, ``--migrate-back`` moves the pool node's ranks home, the pool node is given back and B
claims it and recovers live. Both jobs end ``torch.equal`` to plain torchrun, survivors keep their processes. The
timeline and the consoles' one-liners are printed; the last line is JSON.

``heal``: a pool node SIGKILLed while idle and while claimed, a claimer killed mid-claim: the claims expire with the
leases, nothing hangs, nothing is double-held (``tpassctl pool status --json`` and the history).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from common import EtcdServer  # noqa: F401  (puts tests/ on the path; kills what a stopped bench started)
from faults import Job, NetLab, assert_bit_exact

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
                    NetLab._ip(*args, ns=ns)
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
                                 "--rdzv-endpoint", self.endpoint, "--nproc-per-node", "2", "--node-id", node_id],
                          os.path.join(self.work, host), {"TPASSRUN_POOL_KEY": POOL_KEY,
                                                          "PET_LOCAL_ADDR": self.hosts[host].addr})
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
                raise AssertionError(f"{what}: {j.argv[4:8]} exited {j.proc.returncode}:\n{j.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


@dataclass
class JobRun:
    """One job of the lab: its two hosts' agents and its shared training directory."""

    name: str
    hosts: tuple[str, str]
    argv: list[str]
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
    run = JobRun(name, hosts, [], train, env)
    for h in hosts:
        lab.run_on(h, job_argv(lab, name, h, train, args, pool_wait), os.path.join(lab.work, h), env)
    return run


def kill_host(job: Job) -> float:
    """The host dies: its agent's whole process group and every worker the agent started, SIGKILL, back to back.
    Returns the wall time of the kill."""
    assert job.proc is not None
    pids = [s["pid"] for e in job.events() if e["event"] == "workers_started" for s in e["slots"]]
    when = time.time()
    for kill in (lambda: os.killpg(job.proc.pid, signal.SIGKILL), *(lambda p=p: os.kill(p, signal.SIGKILL)
                                                                    for p in pids)):
        try:
            kill()
        except ProcessLookupError:
            pass
    job.proc.wait(10)
    return when


def restart_host(lab: Lab, host: str) -> Job:
    """The host's agent again, same command line, same log directory (its first console kept aside)."""
    old = lab.hosts[host].job
    shutil.copy(old.log_path, old.log_path + f".{len(lab.hosts[host].jobs)}")
    job = Job(argv=old.argv, out=old.out, env=old.env).start()
    lab.hosts[host].jobs.append(job)
    return job


def said(job: Job, since_text: str = "") -> list[str]:
    text = job.log()
    if os.path.exists(job.log_path + ".1"):
        with open(job.log_path + ".1", errors="replace") as fh:
            text = fh.read() + text
    return [ln.strip() for ln in text.splitlines() if any(w in ln for w in SAID) and "Traceback" not in ln]


def share_trial(args: argparse.Namespace, ref: Job, rng: random.Random) -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="tpassrun-poolacc-")
    lab = Lab(["a1", "a2", "b1", "b2", "p"], work, args.tag)
    t: dict[str, float] = {}
    row: dict[str, Any] = {}
    try:
        assert lab.pool("create")
        pool_node = lab.join_pool("p", "poolnode1")
        a = start_job(lab, "A", ("a1", "a2"), args, args.pool_wait_a)
        b = start_job(lab, "B", ("b1", "b2"), args, args.pool_wait_b)
        everyone = [*a.agents(lab), *b.agents(lab), pool_node]
        until(lambda: a.min_step() >= 3 and b.min_step() >= 3, 300, "both jobs past step 3", *everyone)
        pids0 = {"A": {r: p[-1] for r, p in a.pids().items()}, "B": {r: p[-1] for r, p in b.pids().items()}}
        time.sleep(rng.uniform(0.0, 5.0))      # a random instant of A's training
        a2_workers = lab.hosts["a2"].job.worker_pids()
        t["A kill"] = kill_host(lab.hosts["a2"].job)
        row["A_step_at_kill"] = a.min_step()
        claimed_a = until(lambda: a.first(lab, "pool_claimed", t["A kill"]), 300, "A claimed the pool node",
                          lab.hosts["a1"].job, pool_node)
        t["A pool claimed"] = claimed_a["time"]
        back_a = until(lambda: a.first(lab, "node_recovered", t["A kill"]), 300, "A recovered live",
                       lab.hosts["a1"].job, pool_node)
        t["A training again"] = back_a["time"]
        b2_workers = lab.hosts["b2"].job.worker_pids()
        t["B kill"] = kill_host(lab.hosts["b2"].job)
        waiting = until(lambda: b.first(lab, "pool_waiting", t["B kill"]), 300, "B waiting for the pool",
                        lab.hosts["b1"].job)
        t["B waiting"] = waiting["time"]
        row["B_waiting_said"] = waiting.get("reason")
        restart_host(lab, "a2")
        t["A node back"] = time.time()
        released = until(lambda: a.first(lab, "pool_released", t["A node back"]), args.timeout,
                         "A gave the pool node back", lab.hosts["a1"].job, lab.hosts["a2"].job)
        t["A migrated back, released"] = released["time"]
        row["A_released_reason"] = released.get("reason")
        moved = [e for e in a.events(lab) if e["event"] == "swap_resumed" and e["time"] >= t["A node back"]]
        if moved:
            t["A first rank home"] = moved[0]["time"]
        claimed_b = until(lambda: b.first(lab, "pool_claimed", t["B kill"]), args.timeout, "B claimed the pool node",
                          lab.hosts["b1"].job, pool_node)
        t["B pool claimed"] = claimed_b["time"]
        back_b = until(lambda: b.first(lab, "node_recovered", t["B kill"]), args.timeout, "B recovered live",
                       lab.hosts["b1"].job, pool_node)
        t["B training again"] = back_b["time"]
        codes = {"A": [j.wait(args.timeout) for j in (lab.hosts["a1"].job, lab.hosts["a2"].job)],
                 "B": [lab.hosts["b1"].job.wait(args.timeout)]}
        row["exit_codes"] = codes
        until(lambda: (lambda s: s)(idle_and_free(lab)), 120, "the pool node idle again, no claim")
        row["history"] = [h.event for h in lab.pool("read")[2]]
        row["status_json"] = summarize_status(lab.status())
        for name, job, dead in (("A", a, a2_workers), ("B", b, b2_workers)):
            try:
                assert_bit_exact(Job(argv=[], out=job.train), ref, RANKS, relogged_by=dead)
                row[f"{name}_bit_identical"] = True
            except AssertionError as exc:
                row[f"{name}_bit_identical"] = f"no: {exc}"
            now = job.pids()
            row[f"{name}_survivors_kept_pids"] = all(now[r] == [pid] for r, pid in pids0[name].items()
                                                     if pid not in dead)
            row[f"{name}_pids_per_rank"] = {r: len(p) for r, p in now.items()}
        k = t["A kill"]
        row["timeline_s"] = {what: round(when - k, 2) for what, when in sorted(t.items(), key=lambda kv: kv[1])}
        row["said"] = {"A": said(lab.hosts["a1"].job) + said(lab.hosts["a2"].job),
                       "B": said(lab.hosts["b1"].job), "pool": said(pool_node)}
        row["ok"] = (codes == {"A": [0, 0], "B": [0]} and row["A_bit_identical"] is True and
                     row["B_bit_identical"] is True and row["A_survivors_kept_pids"] and row["B_survivors_kept_pids"]
                     and row["history"].count("claimed") == 2 and row["history"].count("released") >= 1)
        return row
    except AssertionError as exc:
        row.update(ok=False, error=str(exc)[-4000:], timeline_s={w: round(v - t.get("A kill", v), 2)
                                                                  for w, v in t.items()})
        for h in lab.hosts.values():
            row.setdefault("tails", {})[h.name] = h.job.log()[-2500:]
        return row
    finally:
        lab.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            row["work"] = work


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


def share(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    refdir = tempfile.mkdtemp(prefix="tpassrun-poolacc-ref-")
    rows = []
    try:
        ref = reference(args, refdir)
        for i in range(args.trials):
            load = os.getloadavg()
            row = share_trial(args, ref, rng)
            row["load_before"] = [round(x, 1) for x in load]
            row["load_after"] = [round(x, 1) for x in os.getloadavg()]
            rows.append(row)
            print(f"--- trial {i + 1}: {'ok' if row['ok'] else 'FAILED'} (load {row['load_before'][0]} -> "
                  f"{row['load_after'][0]})", flush=True)
            for what, s in row.get("timeline_s", {}).items():
                print(f"  {s:8.2f} s  {what}")
            for who, lines in row.get("said", {}).items():
                for ln in lines:
                    print(f"  [{who}] {ln}")
            for k in ("B_waiting_said", "A_released_reason", "history", "status_json", "exit_codes",
                      "A_bit_identical", "B_bit_identical", "A_survivors_kept_pids", "B_survivors_kept_pids",
                      "error"):
                if k in row:
                    print(f"  {k}: {row[k]}")
            for h, tail in row.get("tails", {}).items():
                print(f"  --- {h} tail ---\n{tail}")
            sys.stdout.flush()
    finally:
        shutil.rmtree(refdir, ignore_errors=True)
    return rows


class Sampler:
    """Reads the pool every half second while a scenario runs: what it saw that must never be (a node serving one job
    while claimed by another, two spare nodes at once on one pool node), and when each node was first seen gone,
    idle, claimed."""

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


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def restart_pool_node(lab: Lab, host: str, node_id: str) -> Job:
    """The pool node's ``tpassctl pool join`` again, same command line; until it is in the pool again (a job waiting
    for the pool may claim it at once)."""
    job = restart_host(lab, host)
    until(lambda: node_id in lab.pool("read")[0].nodes, 120, f"{node_id} registered again", job)
    return job


def heal(args: argparse.Namespace) -> dict[str, Any]:
    """(1) the idle pool node SIGKILLed, then started again; (2) job C's leader SIGKILLed right after it claimed the
    pool node for C's lost node (mid-claim); (3) job D's claimed pool node SIGKILLed once D's ranks run on it, then
    started again: D claims it again and recovers live. One pool node on host p, every kill a whole host."""
    work = tempfile.mkdtemp(prefix="tpassrun-poolheal-")
    refdir = os.path.join(work, "ref")
    lab = Lab(["c1", "c2", "d1", "d2", "p"], work, args.tag)
    out: dict[str, Any] = {}
    sampler: Sampler | None = None
    try:
        ref = reference(args, refdir)
        assert lab.pool("create")
        lab.join_pool("p", "poolnode1")
        sampler = Sampler(lab, {"poolnode1": lab.hosts["p"].job})
        gone = lambda: "poolnode1" not in lab.pool("read")[0].nodes  # noqa: E731
        free = lambda: idle_and_free(lab) and "poolnode1" in lab.pool("read")[0].nodes  # noqa: E731

        # (1) idle, killed: its record leaves with its lease; started again, it is idle in the pool again
        t0 = kill_host(lab.hosts["p"].job)
        until(gone, 120, "the killed idle pool node left the pool")
        out["idle_killed_left_pool_s"] = round(time.time() - t0, 2)
        restart_pool_node(lab, "p", "poolnode1")
        until(free, 60, "the pool node idle again")

        # (2) a claimer dying mid-claim: C's node c2 dies, C's leader (c1) claims the pool node and dies at once
        c = start_job(lab, "C", ("c1", "c2"), args, 120)
        until(lambda: c.min_step() >= 3, 300, "C past step 3", *c.agents(lab))
        kill_host(lab.hosts["c2"].job)
        claimed = until(lambda: c.first(lab, "pool_claimed", 0), 300, "C claimed the pool node", lab.hosts["c1"].job)
        t1 = kill_host(lab.hosts["c1"].job)
        out["claimer_killed_after_claim_s"] = round(t1 - claimed["time"], 2)
        joined_first = "joined" in [h.event for h in lab.pool("read")[2] if h.job and h.job.startswith("C-")]
        until(free, 180, "the dead claimer's claim expired and the pool node is idle again")
        out["claim_expired_pool_node_idle_s"] = round(time.time() - t1, 2)
        out["claimer_died_after_its_spare_node_joined"] = joined_first

        # (3) claimed and serving, killed: D's ranks on it are a lost node again; D waits, the node comes back, D
        # claims it again and recovers live
        d = start_job(lab, "D", ("d1", "d2"), args, args.pool_wait_b)
        until(lambda: d.min_step() >= 3, 300, "D past step 3", *d.agents(lab))
        pids0 = {r: p[-1] for r, p in d.pids().items()}
        d2_workers = lab.hosts["d2"].job.worker_pids()
        t2 = kill_host(lab.hosts["d2"].job)
        until(lambda: d.first(lab, "node_recovered", t2), 300, "D recovered on the pool node", lab.hosts["d1"].job)
        on_pool = [r for r, p in d.pids().items() if p[-1] not in (pids0[r],)]
        pool_workers = [p[-1] for r, p in d.pids().items() if r in on_pool]
        t3 = kill_host(lab.hosts["p"].job)
        waiting = until(lambda: d.first(lab, "pool_waiting", t3), 300, "D waiting for the pool", lab.hosts["d1"].job)
        out["claimed_killed_D_waiting_s"] = round(waiting["time"] - t3, 2)
        out["claimed_killed_D_said"] = waiting.get("reason")
        until(gone, 120, "the killed claimed pool node left the pool")
        out["claimed_killed_left_pool_s"] = round(time.time() - t3, 2)
        t4 = time.time()
        restart_pool_node(lab, "p", "poolnode1")
        again = until(lambda: d.first(lab, "node_recovered", t4), args.timeout, "D recovered on the pool node again",
                      lab.hosts["d1"].job)
        out["node_back_to_D_training_s"] = round(again["time"] - t4, 2)
        out["D_exit"] = lab.hosts["d1"].job.wait(args.timeout)
        until(free, 120, "the pool node idle again after D")
        try:
            assert_bit_exact(Job(argv=[], out=d.train), ref, RANKS, relogged_by=[*d2_workers, *pool_workers])
            out["D_bit_identical"] = True
        except AssertionError as exc:
            out["D_bit_identical"] = f"no: {exc}"
        now = d.pids()
        out["D_survivors_kept_pids"] = all(now[r] == [pid] for r, pid in pids0.items() if pid not in d2_workers)
        out["history"] = [(h.event, (h.job or "")[:1]) for h in sorted(lab.pool("read")[2], key=lambda h: h.time)]
        out["status_json"] = summarize_status(lab.status())
        out["double_held"] = sampler.bad
        out["samples"] = sampler.samples
        out["ok"] = (out["D_exit"] == 0 and out["D_bit_identical"] is True and out["D_survivors_kept_pids"]
                     and not sampler.bad)
        return out
    except AssertionError as exc:
        out.update(ok=False, error=str(exc)[-4000:])
        out["tails"] = {h.name: h.job.log()[-2500:] for h in lab.hosts.values() if h.jobs}
        return out
    finally:
        if sampler is not None:
            sampler.close()
        lab.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            out["work"] = work


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("share")
    s.add_argument("--trials", type=int, default=1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--steps", type=int, default=400)
    s.add_argument("--step-sleep", type=float, default=0.5)
    s.add_argument("--lease-ttl", type=int, default=5)
    s.add_argument("--pool-wait-a", type=float, default=120)
    s.add_argument("--pool-wait-b", type=float, default=400, help="B's finite --pool-wait")
    s.add_argument("--timeout", type=float, default=600, help="a deadline that only catches a hang")
    s.add_argument("--keep", action="store_true", help="keep the work directory")
    s.add_argument("--tag", default=None, help="the namespaces' name tag (tp<tag>-h<i>; default random)")
    h = sub.add_parser("heal")
    h.add_argument("--steps", type=int, default=300)
    h.add_argument("--step-sleep", type=float, default=0.3)
    h.add_argument("--lease-ttl", type=int, default=5)
    h.add_argument("--pool-wait-b", type=float, default=400, help="D's finite --pool-wait")
    h.add_argument("--timeout", type=float, default=600, help="a deadline that only catches a hang")
    h.add_argument("--keep", action="store_true", help="keep the work directory")
    h.add_argument("--tag", default=None, help="the namespaces' name tag (tp<tag>-h<i>; default random)")
    args = p.parse_args()
    if not NetLab.available():
        raise SystemExit("needs root and iproute2 (network namespaces)")
    if args.what == "heal":
        res = heal(args)
        for k, v in res.items():
            if k != "tails":
                print(f"  {k}: {v}")
        for host, tail in res.get("tails", {}).items():
            print(f"  --- {host} tail ---\n{tail}")
        print(json.dumps({k: v for k, v in res.items() if k != "tails"}, default=str))
        if not res["ok"]:
            raise SystemExit(1)
        return
    rows = share(args)
    print(json.dumps({"trials": [{k: v for k, v in r.items() if k not in ("said", "tails")} for r in rows]},
                     default=str))
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
