"""A real network partition: three "hosts" (network namespaces on a bridge, each its own address), one etcd on the
bridge's host, a 2-node job (2 ranks each) and a ``--spare-node``. Node B's cable is cut (its bridge port set
down: a black hole, nothing is reset) while its ranks are inside a step and A's are blocked in the next step's
all-reduce waiting for them. B's agent loses etcd and fences its workers; A and C see B's lease expire; A's
survivors, which no connection reset will ever reach, are broken out of gloo at once by their agent (a Break on
the watch connection: tpassrun/worker/watch.py) instead of waiting for the process group's timeout; C takes B's
ranks live, with their per-rank state from B's buddy's mirror (A). Then B's cable is plugged back in while the
job runs: B's agent re-registers and rejoins as a spare node (nobody re-forms) and exits 0 with the job. The run
ends ``torch.equal`` to torchrun.

Needs root and iproute2 (``ip netns``); the namespaces are deleted even when the test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import _etcd_binary, _free_port
from faults import Job, assert_bit_exact, faults_env, pid_of_rank, wait_dead

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(360)]

STEPS = 30
TTL = 3
SUBNET = "10.77.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    """Namespaces ``<prefix>sw`` (a bridge at SUBNET.254, where etcd runs) and one per host, each with a veth
    ``tpeth`` on the bridge. :meth:`cut` sets a host's bridge port down: a black hole both ways."""

    def __init__(self, names: str) -> None:
        self.prefix = f"tpp{uuid.uuid4().hex[:5]}"
        self.sw = self.prefix + "sw"
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        self.made: list[str] = []

    def ns(self, name: str) -> str:
        return self.prefix + name

    def up(self) -> "Hosts":
        _ip("netns", "add", self.sw)
        self.made.append(self.sw)
        sw = ("netns", "exec", self.sw, "ip")
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "addr", "add", f"{SUBNET}.254/24", "dev", "br0")
        _ip(*sw, "link", "set", "br0", "up")
        _ip(*sw, "link", "set", "lo", "up")
        for name, addr in self.addr.items():
            ns, port = self.ns(name), f"{self.prefix}{name}p"
            _ip("netns", "add", ns)
            self.made.append(ns)
            _ip("link", "add", f"{self.prefix}{name}", "type", "veth", "peer", "name", port)
            _ip("link", "set", f"{self.prefix}{name}", "netns", ns)
            _ip("link", "set", port, "netns", self.sw)
            _ip(*sw, "link", "set", port, "master", "br0")
            _ip(*sw, "link", "set", port, "up")
            inside = ("netns", "exec", ns, "ip")
            _ip(*inside, "link", "set", f"{self.prefix}{name}", "name", "tpeth")
            _ip(*inside, "addr", "add", f"{addr}/24", "dev", "tpeth")
            _ip(*inside, "link", "set", "tpeth", "up")
            _ip(*inside, "link", "set", "lo", "up")
        return self

    def cut(self, name: str) -> None:
        _ip("netns", "exec", self.sw, "ip", "link", "set", f"{self.prefix}{name}p", "down")

    def heal(self, name: str) -> None:
        _ip("netns", "exec", self.sw, "ip", "link", "set", f"{self.prefix}{name}p", "up")

    def down(self) -> None:
        for ns in reversed(self.made):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self.made = []


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a real partition needs root and iproute2 (ip netns)")
    h = Hosts("abc")
    try:
        h.up()
    except (subprocess.CalledProcessError, OSError) as exc:
        h.down()
        pytest.skip(f"network namespaces do not work here: {exc}")
    try:
        yield h
    finally:
        h.down()
        assert not [ns for ns in _ip("netns", "list").stdout.split() if ns.startswith(h.prefix)]


class NsEtcd:
    """etcd on the bridge's host (its namespace), so every host reaches it over its veth."""

    def __init__(self, hosts: Hosts, tmp: str) -> None:
        self.hosts, self.dir = hosts, tmp
        self.port = _free_port()
        self.endpoint = f"{SUBNET}.254:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "NsEtcd":
        peer = _free_port()
        url = f"http://{SUBNET}.254"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.hosts.sw, _etcd_binary(), "--name", "t", "--data-dir",
             os.path.join(self.dir, "etcd"), "--listen-client-urls", f"{url}:{self.port}",
             "--advertise-client-urls", f"{url}:{self.port}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
             f"t=http://127.0.0.1:{peer}", "--logger", "zap", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        probe = (f"import urllib.request,sys; sys.exit(0 if b'true' in urllib.request.urlopen("
                 f"'{url}:{self.port}/health', timeout=1).read() else 1)")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if subprocess.run(["ip", "netns", "exec", self.hosts.sw, sys.executable, "-c", probe],
                              capture_output=True, timeout=30).returncode == 0:
                return self
            time.sleep(0.2)
        raise AssertionError("etcd did not start in its namespace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _agent(hosts: Hosts, name: str, tmp: str, train: str, endpoint: str, run_id: str, env: dict[str, str],
           spare: bool = False) -> Job:
    job = Job.agent(os.path.join(tmp, name), train, endpoint=endpoint, run_id=run_id, steps=STEPS, step_sleep=0.01,
                    ttl=TTL, env={**env, "GLOO_SOCKET_IFNAME": "tpeth"},
                    extra=["--local-addr", hosts.addr[name], *(["--spare-node"] if spare else [])])
    job.argv = ["ip", "netns", "exec", hosts.ns(name), *job.argv]
    return job


def _warm(jobs: list[Job], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        evs = [e for j in jobs for e in j.events()]
        spares = sum(len(e["slots"]) for e in evs if e["event"] == "workers_started" and e.get("spare_node"))
        started = {e["node"] for e in evs if e["event"] == "workers_started"}
        if len(started) == len(jobs) and spares and sum(e["event"] == "spare_ready" for e in evs) >= spares:
            return
        for j in jobs:
            assert j.proc is not None and j.proc.poll() is None, f"an agent exited early:\n{j.log()[-3000:]}"
        assert time.monotonic() < deadline, "the job did not start:\n" + "\n".join(j.log()[-1500:] for j in jobs)
        time.sleep(0.1)


def test_a_partitioned_node_is_replaced_live_and_survivors_blocked_on_it_are_broken_out(tmp_path, hosts):
    tmp = str(tmp_path)
    train = os.path.join(tmp, "train")
    ref = Job.torchrun(os.path.join(tmp, "ref"), nproc=4, steps=STEPS, step_sleep=0.0).start()
    etcd = NsEtcd(hosts, tmp).start()
    run_id = uuid.uuid4().hex[:8]
    step = 6
    release = os.path.join(tmp, "release")
    # the job waits at step 1 until C's spares are warm; B's ranks then stop in their user code of `step` (they
    # will be fenced there), and A's go on into the next step, where they block in its all-reduce on B's
    # near its end the job waits again, until B is back from the partition
    late = os.path.join(tmp, "late")
    faults = faults_env({"rank": 0, "step": 1, "where": "step", "action": "hold", "release": release},
                        *({"rank": r, "step": step, "where": "user", "action": "hold",
                           "release": os.path.join(tmp, "never")} for r in (2, 3)),
                        *({"rank": r, "step": STEPS - 3, "where": "step", "action": "hold", "release": late}
                          for r in range(4)))
    jobs = [_agent(hosts, n, tmp, train, etcd.endpoint, run_id, faults, spare=n == "c") for n in "abc"]
    a, b, c = jobs
    try:
        assert ref.wait(240) == 0, ref.log()[-3000:]
        a.start()
        # A is group rank 0 (it keeps the workers' store, B's ranks are 2 and 3): B starts once A is joining (its
        # next etcd request), not after a fixed second that a loaded host's start-up can outlast
        a.wait_event("agent_started")
        b.start()
        c.start()
        _warm(jobs)
        open(release, "w").close()
        logs = Job(argv=[], out=train)
        for r in range(4):
            logs.wait_step(step, 120, rank=r)
        b_pids = [p for p in b.worker_pids()]
        assert sorted(r for r in range(4) if pid_of_rank(train, r) in b_pids) == [2, 3]
        time.sleep(0.5)          # A's ranks are inside step+1's all-reduce by now, waiting for B's
        cut = time.monotonic()
        hosts.cut("b")
        dead = wait_dead(b_pids, cut, TTL + 10)
        assert len(dead) == len(b_pids), "the partitioned agent kept its workers running"
        c.wait_event("node_recovered")
        hosts.heal("b")               # the cable is back: B re-registers and rejoins as a spare node
        b.wait_event("spare_ready", 2)
        open(late, "w").close()
        assert a.wait(240) == 0, a.log()[-3000:]
        assert c.wait(60) == 0, c.log()[-3000:]
        assert b.wait(60) == 0, b.log()[-3000:]
    finally:
        open(late, "w").close()
        for j in jobs:
            j.kill()
        ref.kill()
        etcd.stop()
    fenced = [e for e in b.events() if e["event"] == "fenced"]
    assert len(fenced) == 1 and sorted(fenced[0]["pids"]) == sorted(b_pids), fenced
    assert len([e for e in b.events() if e["event"] == "generation_joined"]) == 2   # rejoined once, as a spare
    broken = [e for e in a.events() if e["event"] == "collectives_broken"]
    assert broken and sorted(broken[0]["ranks"]) == [0, 1], broken
    recovered = [e for e in c.events() if e["event"] == "node_recovered"]
    assert recovered and sorted(recovered[0]["ranks"]) == [2, 3]
    assert "fallback to torchrun's whole-group restart" not in a.log() + c.log()
    assert_bit_exact(Job(argv=[], out=train), ref, 4, relogged_by=b_pids)
    for r in (0, 1):
        assert len({row["pid"] for row in logs.losses(r)}) == 1, f"survivor rank {r} changed process"
    for j in (a, c):       # nobody re-formed the group for B's return
        assert len([e for e in j.events() if e["event"] == "generation_joined"]) == 1
    assert len([line for j in (a, c) for line in j.log().splitlines() if "is back as a spare node" in line]) == 1
