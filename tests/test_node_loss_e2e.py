"""Node loss with a spare node: a whole agent (and so its workers) dies; a --spare-node agent takes its place.

Three real agents (``python -m tpassrun``) on one real etcd: A and B are the two members of a 2-node job,
C is a ``--spare-node`` agent. B's agent is SIGKILLed mid-training; its workers die with it (PDEATHSIG), its
lease expires, the leader restarts the group and the re-formed generation promotes C into B's place.

Besides "it recovered", the test checks from the agents' event logs that no rank was ever held by two live
processes: every holder of a rank was dead before the next holder of that rank was started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import pytest

from faults import EXAMPLE, Job, alive as _alive

pytestmark = pytest.mark.timeout(300)

STEPS = 60
TTL = 3


def _agent(out: str, train: str, endpoint: str, run_id: str, *, extra: list[str] | None = None,
           conf: str = "") -> Job:
    argv = [sys.executable, "-m", "tpassrun", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--rdzv-conf", f"lease_ttl={TTL},last_call_timeout=1{conf}", "--max-restarts", "1",
            "--log-dir", os.path.join(out, "logs"), *(extra or []),
            EXAMPLE, "--steps", str(STEPS), "--step-sleep", "0.05", "--out", train, "--quiet"]
    return Job(argv=argv, out=out)


def _wait(cond: Any, timeout: float, what: str, *jobs: Job) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        for j in jobs:
            if j.proc is not None and j.proc.poll() is not None:
                raise AssertionError(f"{what}: an agent exited early ({j.proc.returncode}):\n{j.log()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s\n" + "\n".join(j.log()[-1500:] for j in jobs))
        time.sleep(0.1)


def _holdings(job: Job, killed: dict[int, float]) -> list[dict[str, Any]]:
    """Every (rank, pid) this agent started, with a lower bound on its start and an upper bound on its death.

    start >= the agent's ``generation_joined`` for that generation (written before it spawns anything);
    death <= the agent's ``worker_exit`` for that pid (written after reaping it), or its ``generation_ended``
    (written after it stopped and reaped every worker of the generation), or, for a SIGKILLed agent's
    workers, the moment this test saw them dead (``killed``).
    """
    ev = job.events()
    joined = {e["generation"]: e["mono"] for e in ev if e["event"] == "generation_joined"}
    ended = {e["generation"]: e["mono"] for e in ev if e["event"] == "generation_ended"}
    exits = {e["pid"]: e["mono"] for e in ev if e["event"] == "worker_exit"}
    out = []
    for e in ev:
        if e["event"] != "workers_started":
            continue
        g = e["generation"]
        for s in e["slots"]:
            if s["rank"] is None or s["rank"] < 0:
                continue
            bounds = [t for t in (exits.get(s["pid"]), ended.get(g), killed.get(s["pid"])) if t is not None]
            out.append({"rank": s["rank"], "pid": s["pid"], "node": e["node"], "generation": g,
                        "start_lb": joined[g], "end_ub": min(bounds) if bounds else None})
    return out


def _assert_one_holder_per_rank(held: list[dict[str, Any]]) -> None:
    """For every rank: each holder was dead (upper bound) before the next one was started (lower bound)."""
    for r in range(4):
        hs = sorted((h for h in held if h["rank"] == r), key=lambda h: h["start_lb"])
        assert len(hs) >= 2, f"rank {r} was not restarted: {hs}"
        for old, new in zip(hs, hs[1:]):
            assert old["end_ub"] < new["start_lb"], (
                f"rank {r}: pid {old['pid']} ({old['node']}) may still have been alive at "
                f"{old['end_ub']:.3f} when pid {new['pid']} ({new['node']}) could have started at "
                f"{new['start_lb']:.3f}")


def _watch_deaths(pids: list[int], since: float, timeout: float) -> dict[int, float]:
    """pid -> the first moment this test saw it dead (an upper bound on its death)."""
    dead_at: dict[int, float] = {}
    while len(dead_at) < len(pids) and time.monotonic() - since < timeout:
        for p in pids:
            if p not in dead_at and not _alive(p):
                dead_at[p] = time.monotonic()
        time.sleep(0.02)
    return dead_at


def _started(job: Job) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["event"] == "workers_started"]


def _joined(job: Job) -> bool:
    return any(e["event"] == "generation_joined" for e in job.events())


def _start_all(a: Job, b: Job, c: Job) -> None:
    """Start members A and B and spare node C; return once generation 0 runs on A and B and C has joined it
    as a spare node (C may start last and be slower: the test must not race its registration)."""
    for j in (a, b, c):
        j.start()
    _wait(lambda: _started(a) and _started(b) and _joined(c), 120, "generation 0 on A and B, C joined", a, b, c)


def test_node_loss_promotes_the_spare_node_and_no_rank_is_held_twice(tmp_path, etcd_server, run_id):
    train = str(tmp_path / "train")
    a = _agent(str(tmp_path / "a"), train, etcd_server.endpoint, run_id)
    b = _agent(str(tmp_path / "b"), train, etcd_server.endpoint, run_id)
    c = _agent(str(tmp_path / "c"), train, etcd_server.endpoint, run_id, extra=["--spare-node"])
    jobs = (a, b, c)
    started = _started
    try:
        _start_all(a, b, c)
        gen0 = [e for e in a.events() if e["event"] == "generation_joined"][-1]
        assert gen0["world_size"] == 4 and len(gen0["members"]) == 2
        b_node = started(b)[-1]["node"]
        c_node = next(e["node"] for e in c.events() if e["event"] == "agent_started")
        assert c_node not in gen0["members"] and b_node in gen0["members"]
        b_pids = [s["pid"] for s in started(b)[-1]["slots"]]
        b_ranks = sorted(s["rank"] for s in started(b)[-1]["slots"])
        # training underway on B's ranks too
        _wait(lambda: all(len(Job(argv=[], out=train).losses(r)) >= 10 for r in b_ranks), 120,
              "10 steps on B's ranks", *jobs)

        os.kill(b.proc.pid, signal.SIGKILL)   # node loss: the agent only; its workers must follow it
        kill_mono = time.monotonic()
        b.proc.wait(10)
        dead_at = _watch_deaths(b_pids, kill_mono, 10)
        assert len(dead_at) == len(b_pids), "B's workers outlived their SIGKILLed agent"
        assert max(dead_at.values()) - kill_mono < 3, "B's workers took more than 3 s to die"

        assert a.wait(240) == 0, a.log()[-3000:]
        assert c.wait(240) == 0, c.log()[-3000:]
    finally:
        for j in jobs:
            j.kill()

    # --- the new generation: A and C, world size 4 ---------------------------------------------------------
    a_node = next(e["node"] for e in a.events() if e["event"] == "agent_started")
    last_a = [e for e in a.events() if e["event"] == "generation_joined"][-1]
    last_c = [e for e in c.events() if e["event"] == "generation_joined"][-1]
    assert last_a["generation"] == last_c["generation"] > gen0["generation"]
    assert sorted(last_a["members"]) == sorted([a_node, c_node]) and last_a["world_size"] == 4
    noticed = [e["mono"] for e in a.events() if e["event"] in ("membership_change", "generation_ended")
               and e["mono"] > kill_mono]
    assert noticed and min(noticed) - kill_mono < TTL + 3, "node loss noticed late"

    # --- no rank ever held by two live processes ------------------------------------------------------------
    held = _holdings(a, {}) + _holdings(b, dead_at) + _holdings(c, {})
    assert {h["rank"] for h in held} == {0, 1, 2, 3}
    for h in held:
        assert h["end_ub"] is not None, f"no record of the death of {h}"
        assert not _alive(h["pid"]), h
    _assert_one_holder_per_rank(held)
    final = {h["rank"]: h for h in held if h["generation"] == last_a["generation"]}
    assert sorted(final) == [0, 1, 2, 3]
    for h in held:
        if h["rank"] in b_ranks and h["generation"] == gen0["generation"]:
            assert h["node"] == b_node
    moved = {final[r]["node"] for r in b_ranks}
    assert c_node in {h["node"] for h in final.values()} and b_node not in moved

    # --- the loss logs: the completed attempt has every step; the killed attempt's steps are redone ------------
    # examples/train_ddp.py keeps no checkpoint, so a whole-group restart starts again from step 0.
    logs = Job(argv=[], out=train)
    for r in range(4):
        rows = logs.losses(r)
        last_pid = final[r]["pid"]
        done = [x["step"] for x in rows if x["pid"] == last_pid]
        assert done == list(range(STEPS)), f"rank {r}: the completed attempt logged {done}"
        before = [x["step"] for x in rows if x["pid"] != last_pid]
        assert before == list(range(len(before))) and len(before) >= 1, f"rank {r}: first attempt {before}"
        assert rows[-1]["step"] == STEPS - 1
    redone = {r: len([x for x in logs.losses(r) if x["pid"] != final[r]["pid"]]) for r in range(4)}
    print(f"node loss: steps of the killed attempt, redone after the restart: {json.dumps(redone)}")


class _Proxy:
    """A TCP forwarder to etcd for one agent; ``cut()`` partitions that agent from etcd (and only it)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.endpoint = f"127.0.0.1:{self.lsock.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        self.is_cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(self.target)
            except OSError:
                c.close()
                continue
            with self.lock:
                if self.is_cut:
                    c.close()
                    u.close()
                    return
                self.socks += [c, u]
            for src, dst in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        with self.lock:
            self.is_cut = True
            socks, self.socks = self.socks, []
        for x in [self.lsock, *socks]:
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x.close()


def test_agent_cut_off_from_etcd_fences_its_workers_before_the_spare_node_takes_its_ranks(
        tmp_path, etcd_server, run_id):
    """A partition, not a crash: B's agent is alive but cannot reach etcd. Its lease expires, the others
    re-form with the spare node C; B must have stopped its own workers by then (nobody else can kill them)."""
    train = str(tmp_path / "train")
    proxy = _Proxy(etcd_server.endpoint)
    a = _agent(str(tmp_path / "a"), train, etcd_server.endpoint, run_id)
    b = _agent(str(tmp_path / "b"), train, proxy.endpoint, run_id, conf=",read_timeout=5,reconnect_timeout=5")
    c = _agent(str(tmp_path / "c"), train, etcd_server.endpoint, run_id, extra=["--spare-node"])
    jobs = (a, b, c)
    started = _started
    try:
        _start_all(a, b, c)
        b_pids = [s["pid"] for s in started(b)[-1]["slots"]]
        b_ranks = sorted(s["rank"] for s in started(b)[-1]["slots"])
        _wait(lambda: all(len(Job(argv=[], out=train).losses(r)) >= 10 for r in b_ranks), 120,
              "10 steps on B's ranks", *jobs)

        cut_mono = time.monotonic()
        proxy.cut()
        dead_at = _watch_deaths(b_pids, cut_mono, TTL + 5)
        assert len(dead_at) == len(b_pids), "a partitioned agent kept its workers running"
        assert max(dead_at.values()) - cut_mono <= TTL + 1.5, "fenced later than its lease could expire"

        assert a.wait(240) == 0, a.log()[-3000:]
        assert c.wait(240) == 0, c.log()[-3000:]
        assert b.wait(60) == 1, b.log()[-3000:]       # it cannot reach etcd at all: a clean failure
    finally:
        for j in jobs:
            j.kill()
        if not proxy.is_cut:
            proxy.cut()

    fenced = [e for e in b.events() if e["event"] == "fenced"]
    assert fenced and sorted(fenced[0]["pids"]) == sorted(b_pids), [e["event"] for e in b.events()]
    assert "etcd" in b.log()
    c_node = next(e["node"] for e in c.events() if e["event"] == "agent_started")
    last_a = [e for e in a.events() if e["event"] == "generation_joined"][-1]
    assert c_node in last_a["members"] and last_a["world_size"] == 4
    held = _holdings(a, {}) + _holdings(b, dead_at) + _holdings(c, {})
    for h in held:
        assert h["end_ub"] is not None and not _alive(h["pid"]), h
    _assert_one_holder_per_rank(held)
    logs = Job(argv=[], out=train)
    final = {h["rank"]: h["pid"] for h in held if h["generation"] == last_a["generation"]}
    for r in range(4):
        assert [x["step"] for x in logs.losses(r) if x["pid"] == final[r]] == list(range(STEPS))


def test_a_spare_node_that_was_never_needed_exits_0_when_the_job_succeeds(tmp_path, etcd_server, run_id):
    train = str(tmp_path / "train")

    def argv(out: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "tpassrun", "--nnodes", "1", "--nproc-per-node", "1",
                "--rdzv-backend", "etcd", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id,
                "--rdzv-conf", f"lease_ttl={TTL},last_call_timeout=1", "--log-dir", os.path.join(out, "logs"),
                *extra, EXAMPLE, "--steps", "10", "--out", train, "--quiet"]

    c = Job(argv=argv(str(tmp_path / "c"), "--spare-node"), out=str(tmp_path / "c")).start()
    a = Job(argv=argv(str(tmp_path / "a")), out=str(tmp_path / "a")).start()
    try:
        assert a.wait(120) == 0, a.log()[-3000:]
        assert c.wait(30) == 0, c.log()[-3000:]
    finally:
        a.kill()
        c.kill()
    assert not [e for e in c.events() if e["event"] == "workers_started"]
