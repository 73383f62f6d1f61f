"""A private, real Slurm for tests: munged on its own socket and key, slurmctld and three slurmd "nodes" (n1-n3,
``slurmd -N``, all on this host, each on its own port) from a slurm.conf under a temp dir. Needs root and Debian's
``slurm-wlm`` and ``munge`` (scripts/bootstrap.sh installs them); :func:`unavailable` says why not, for a skip.

A node can die (:meth:`SlurmCluster.kill_node`: its slurmd and the given processes SIGKILLed at one instant) and
come back (:meth:`SlurmCluster.start_node`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Iterable

NODES = ("n1", "n2", "n3")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "squeue")
SLURMD_TIMEOUT = 10   # seconds before slurmctld marks a silent node DOWN (its pings go every third of it)


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm tests run slurmd, which needs root"
    missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return f"no Slurm here ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children...), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                ppid = int(fh.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rpartition(")")[2].split()[1])


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """``start()`` returns once every node is idle; ``close()`` cancels every job and stops every daemon."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.conf = os.path.join(root, "slurm.conf")
        self.procs: list[subprocess.Popen] = []
        self.slurmd: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment now (a job submitted by a test inherits its $TMPDIR and PYTEST_CURRENT_TEST: the test's
        leak check sees the job's processes), pointed at this cluster."""
        return {**os.environ, "SLURM_CONF": self.conf}

    def _write_conf(self) -> None:
        r = self.root
        os.makedirs(os.path.join(r, "state"), exist_ok=True)
        for n in NODES:
            os.makedirs(os.path.join(r, "spool", n), exist_ok=True)
        lines = [
            "ClusterName=tpassrun", "SlurmctldHost=localhost", f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge", f"AuthInfo=socket={r}/munge.sock", "CredType=cred/munge",
            "SlurmUser=root", "SlurmdUser=root", f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log", f"SlurmdLogFile={r}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/linear",
            "SchedulerType=sched/builtin", "ReturnToService=2", "MpiDefault=none", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            f"SlurmdTimeout={SLURMD_TIMEOUT}", "InactiveLimit=0", "KillWait=5", "MinJobAge=300",
        ]
        lines += [f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} CPUs=2 State=UNKNOWN"
                  for n in NODES]
        lines.append(f"PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        with open(self.conf, "w") as fh:
            fh.write("\n".join(lines) + "\n")

    def _spawn(self, *argv: str) -> subprocess.Popen:
        with open(os.path.join(self.root, f"{os.path.basename(argv[0])}-{len(self.procs)}.out"), "wb") as log:
            proc = subprocess.Popen(list(argv), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 60) -> "SlurmCluster":
        os.chmod(self.root, 0o755)
        self._write_conf()
        key = os.path.join(self.root, "munge.key")
        with open(key, "wb") as fh:
            fh.write(os.urandom(1024))
        os.chmod(key, 0o600)
        r = self.root
        self._spawn(_bin("munged"), "-F", "-f", f"--socket={r}/munge.sock", f"--key-file={key}",
                    f"--pid-file={r}/munged.pid", f"--log-file={r}/munged.log", f"--seed-file={r}/munged.seed")
        self._wait(lambda: os.path.exists(f"{r}/munge.sock"), timeout, "munged")
        self._spawn(_bin("slurmctld"), "-D", "-i")
        self._wait(lambda: self.run("scontrol", "ping", check=False).returncode == 0, timeout, "slurmctld")
        for n in NODES:
            self.slurmd[n] = self._spawn(_bin("slurmd"), "-D", "-N", n)
        self._wait(lambda: all(self.state(n) == "IDLE" for n in NODES), timeout, "three idle slurmd nodes")
        return self

    def kill_node(self, node: str, pids: Iterable[int]) -> float:
        """The node dies at one instant, as a host losing power: its slurmd and ``pids`` (the job's processes there)
        are stopped first (none of them sees another die), then SIGKILLed. Returns ``time.monotonic()`` of it."""
        victims = [self.slurmd[node].pid, *pids]
        _signal_all(victims, signal.SIGSTOP)
        when = time.monotonic()
        _signal_all(victims, signal.SIGKILL)
        self.slurmd[node].wait(10)
        self.procs.remove(self.slurmd[node])
        return when

    def start_node(self, node: str, timeout: float = 60) -> None:
        """A node killed by :meth:`kill_node` back: its slurmd runs and registers (resume it to schedule on it)."""
        if self.slurmd[node].poll() is None:
            return
        self.slurmd[node] = self._spawn(_bin("slurmd"), "-D", "-N", node)
        self._wait(lambda: "NOT_RESPONDING" not in self.state(node) and "*" not in self.state(node), timeout,
                   f"slurmd {node} again")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start ({', '.join(dead) or 'timeout'}):\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.root)):
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.root, name), errors="replace") as fh:
                    out.append(f"--- {name}\n{fh.read()[-1500:]}")
        return "\n".join(out)

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        done = subprocess.run([_bin(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done

    def state(self, node: str) -> str:
        """``State=`` of a node (``IDLE``, ``ALLOCATED+DRAIN``...), "" when scontrol cannot say."""
        out = self.run("scontrol", "show", "node", "-o", node, check=False).stdout
        for field in out.split():
            if field.startswith("State="):
                return field[len("State="):]
        return ""

    def node_field(self, node: str, name: str) -> str:
        out = self.run("scontrol", "show", "node", "-o", node, check=False).stdout
        head, _, reason = out.partition(" Reason=")
        if name == "Reason":
            return reason.strip()
        return next((f.split("=", 1)[1] for f in head.split() if f.startswith(f"{name}=")), "")

    def job_field(self, job: str, name: str) -> str:
        out = self.run("scontrol", "show", "job", "-o", job, check=False).stdout
        if name == "Comment":   # may hold spaces: up to the next known field
            text = out.partition(" Comment=")[2]
            return text.split(" StdErr=")[0].split(" StdIn=")[0].strip()
        return next((f.split("=", 1)[1] for f in out.split() if f.startswith(f"{name}=")), "")

    def sbatch(self, script: str, *args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run([_bin("sbatch"), "--parsable", *args, script], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise AssertionError(f"sbatch: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def resume_all(self) -> None:
        for n in NODES:
            if "DRAIN" in self.state(n) or "DOWN" in self.state(n):
                self.run("scontrol", "update", f"NodeName={n}", "State=RESUME", check=False)

    def close(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)
        deadline = time.monotonic() + 30
        while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in reversed(self.procs):   # slurmd, slurmctld, then munged
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs.clear()
