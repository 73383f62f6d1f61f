"""Fault injection for tests and benchmarks: run a job, kill rank R at step S, stall it, taint it.

In-process faults (a SIGKILL during backward, a SIGSTOP, a straggler) go through ``TPASSRUN_FAULTS`` and
:func:`tpassrun.worker.faultpoints.fault_point`, which ``examples/train_ddp.py`` calls. Out-of-process faults
(taints, killing an agent) act on the running job from outside. :class:`Job` runs one launcher
(``tpassrun`` or ``torchrun``) as a real subprocess in its own session and always cleans it up.

A job of a fixed number of steps must not end before the event a test is about (a taint handled, a spare
ready, an etcd restart noticed): on a loaded machine a spare can take 20 s to warm up while the job runs to
its end. :class:`Hold` stops the job at a chosen step until the test has seen what it needs in the job's
event log (:meth:`Job.wait_event`), so the outcome never depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_ddp.py")


def kill_at(rank: int, step: int, marker: str, where: str = "backward") -> dict[str, Any]:
    return {"rank": rank, "step": step, "where": where, "action": "kill", "marker": marker}


def stop_at(rank: int, step: int, marker: str) -> dict[str, Any]:
    return {"rank": rank, "step": step, "where": "step", "action": "stop", "marker": marker}


def slow_from(rank: int, step: int, seconds: float) -> dict[str, Any]:
    return {"rank": rank, "step": step, "where": "step", "action": "sleep", "seconds": seconds}


def pid_of_rank(out: str, rank: int) -> int | None:
    """The process holding ``rank`` now, from the latest line of its loss log (a joiner's after a swap)."""
    path = os.path.join(out, f"loss_rank{rank}.jsonl")
    try:
        with open(path, "rb") as fh:
            lines = [line for line in fh.read().splitlines() if line.strip()]
        return int(json.loads(lines[-1])["pid"]) if lines else None
    except (OSError, ValueError, KeyError):
        return None


def sigkill_rank(out: str, rank: int) -> tuple[int, float] | None:
    """SIGKILL the process holding ``rank`` at this very instant, from outside (wherever it is in its step).
    Returns (pid, wall time of the kill), or None if no such process is known yet."""
    pid = pid_of_rank(out, rank)
    if pid is None:
        return None
    when = time.time()
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return pid, when


def sigkill_agent(job: "Job") -> float:
    """A whole node dies: SIGKILL its agent at this very instant (its workers follow it through PDEATHSIG, as
    a host's processes die together). Returns ``time.monotonic()`` of the kill."""
    assert job.proc is not None
    when = time.monotonic()
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)
    return when


def sigkill_node(job: "Job") -> float:
    """A whole node dies at this very instant: SIGKILL its agent and every worker it started (ranks and spares),
    back to back, from outside (wherever each process is; the agent first, so that it never sees its workers die
    and reports nothing, as a crashed host cannot). Returns ``time.monotonic()`` of the kill."""
    assert job.proc is not None
    pids = [s["pid"] for e in job.events() if e["event"] == "workers_started" for s in e["slots"]]
    when = time.monotonic()
    for pid in [job.proc.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.proc.wait(10)
    return when


def wait_dead(pids: list[int], since: float, timeout: float) -> dict[int, float]:
    """pid -> the first moment (monotonic) it was seen dead (an upper bound on its death)."""
    dead_at: dict[int, float] = {}
    while len(dead_at) < len(pids) and time.monotonic() - since < timeout:
        for p in pids:
            if p not in dead_at and not alive(p):
                dead_at[p] = time.monotonic()
        time.sleep(0.005)
    return dead_at


def faults_env(*faults: dict[str, Any]) -> dict[str, str]:
    return {"TPASSRUN_FAULTS": json.dumps(list(faults))}


@dataclass(frozen=True)
class Hold:
    """A step the job cannot pass until the test lets it.

    ``rank`` waits at the start of step ``step`` (``where="step"``, before any collective; its peers then wait
    in that step's first collective) until :meth:`release`. It fires once per job, even across processes (a
    joiner that re-executes the step does not wait again), costs nothing per step, and changes no numerics: the
    job just stands still, so runs with holds stay ``torch.equal`` to a torchrun reference without them.

    The pattern: hold the job, cause the event (a taint, a kill, an etcd restart), wait until the job is
    committed to it (a planned swap's boundary is fixed once its ``swap_boundary`` event is logged: the ranks
    will pause there; see :meth:`release_after`), then release. The job can no longer end first.
    While held the job makes no progress, so a swap cannot *complete* before the release: release once the
    boundary is fixed, not after ``swap_resumed``.
    """

    step: int
    dir: str
    rank: int = 0
    name: str = "hold"
    where: str = "step"

    @property
    def release_path(self) -> str:
        return os.path.join(self.dir, f"{self.name}.release")

    @property
    def marker(self) -> str:
        return os.path.join(self.dir, f"{self.name}.held")

    @property
    def fault(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "where": self.where, "action": "hold",
                "release": self.release_path, "marker": self.marker}

    def reached(self) -> bool:
        return os.path.exists(self.marker)

    def wait_reached(self, job: "Job", timeout: float = 240) -> None:
        """Until the job stands at the hold (a deadline that only catches a hang)."""
        deadline = time.monotonic() + timeout
        while not self.reached():
            job.assert_running(f"the hold at step {self.step}")
            if time.monotonic() > deadline:
                raise AssertionError(f"hold at step {self.step} not reached in {timeout}s:\n{job.log()[-3000:]}")
            time.sleep(0.05)

    def release(self) -> None:
        with open(self.release_path, "w"):
            pass

    def release_after(self, job: "Job", event: str, count: int = 1, timeout: float = 240,
                      distinct: str | None = "swap_id") -> list[dict[str, Any]]:
        """Release once ``count`` (distinct ``distinct`` values of) ``event`` are logged; returns them."""
        try:
            return job.wait_event(event, count, timeout, distinct=distinct)
        finally:
            self.release()


def hold_at(dir: str, step: int, *, rank: int = 0, name: str = "hold") -> Hold:
    return Hold(step=step, dir=str(dir), rank=rank, name=name)


def run_through(jobs: list["Job"], down: Hold, back: Hold, fault: Callable[[], None], timeout: float = 240) -> None:
    """Started agents held at ``down`` (as the first reaches it), ``fault()`` (it releases ``down`` when the job is to
    train on through it), then ``back`` released: every agent must exit 0. Holds released and agents killed on the
    way out, whatever happened."""
    try:
        down.wait_reached(jobs[0])
        fault()
        back.release()
        codes = [j.wait(timeout) for j in jobs]
    finally:
        down.release()
        back.release()
        for j in jobs:
            j.kill()
    assert codes == [0] * len(jobs), "\n".join(j.log()[-3000:] for j in jobs)


# Set by tests/conftest.py to the id of the running test when that test is not marked ``e2e``: a real job started
# there would put a multi-process run into the fast tier (``-m "not e2e"``), so Job.start refuses it.
UNMARKED_TEST: str | None = None


@dataclass
class Job:
    """One launcher process running the example job (or any script)."""

    argv: list[str]
    out: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: str = ""
    proc: subprocess.Popen | None = None
    started: float = 0.0

    @classmethod
    def tpassrun(cls, out: str, *, endpoint: str | None, run_id: str, nproc: int = 4, spares: int = 0,
                 steps: int = 40, step_sleep: float = 0.02, extra: list[str] | None = None,
                 script_args: list[str] | None = None, env: dict[str, str] | None = None) -> "Job":
        rdzv = (["--nnodes", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
                if endpoint else ["--standalone"])
        argv = [sys.executable, "-m", "tpassrun", *rdzv, "--nproc-per-node", str(nproc),
                "--spares-per-node", str(spares), "--log-dir", os.path.join(out, "logs"), *(extra or []),
                EXAMPLE, "--steps", str(steps), "--step-sleep", str(step_sleep), "--out", out, "--quiet",
                *(script_args or [])]
        return cls(argv=argv, out=out, env=env or {})

    @classmethod
    def agent(cls, out: str, train: str, *, endpoint: str, run_id: str, nnodes: str = "2", nproc: int = 2,
              steps: int = 40, step_sleep: float = 0.05, conf: str = "", extra: list[str] | None = None,
              env: dict[str, str] | None = None, ttl: float = 3, script: list[str] | None = None) -> "Job":
        """One node's agent of a multi-node job (several of them share one etcd): its logs and events under
        ``out``, the training's loss logs and final states under ``train`` (shared by every node). ``script``:
        another training script and its arguments (it takes ``--out``) instead of the example's."""
        command = ([*script, "--out", train] if script is not None else
                   [EXAMPLE, "--steps", str(steps), "--step-sleep", str(step_sleep), "--out", train, "--quiet"])
        argv = [sys.executable, "-m", "tpassrun", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
                "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--rdzv-conf", f"lease_ttl={ttl:g},last_call_timeout=1{conf}", "--max-restarts", "1",
                "--log-dir", os.path.join(out, "logs"), *(extra or []), *command]
        return cls(argv=argv, out=out, env=env or {})

    def node_id(self) -> str | None:
        """This agent's node id (from its event log), once it started."""
        return next((e["node"] for e in self.events() if e["event"] == "agent_started"), None)

    def worker_pids(self) -> list[int]:
        """The pids of the ranks this agent started in its last generation."""
        started = [e for e in self.events() if e["event"] == "workers_started" and not e.get("spare_node")]
        return [s["pid"] for s in started[-1]["slots"] if s["rank"] is not None and s["rank"] >= 0] if started else []

    @classmethod
    def torchrun(cls, out: str, *, nproc: int = 4, steps: int = 40, step_sleep: float = 0.02,
                 extra: list[str] | None = None, script_args: list[str] | None = None,
                 env: dict[str, str] | None = None) -> "Job":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                *(extra or []), EXAMPLE, "--steps", str(steps), "--step-sleep", str(step_sleep), "--out", out,
                "--quiet", *(script_args or [])]
        return cls(argv=argv, out=out, env=env or {})

    def start(self) -> "Job":
        assert UNMARKED_TEST is None, f"{UNMARKED_TEST} starts a real job: mark it @pytest.mark.e2e"
        os.makedirs(self.out, exist_ok=True)
        self.log_path = os.path.join(self.out, "launcher.log")
        env = {**os.environ, **self.env}
        self.started = time.monotonic()
        # cwd outside the source tree: only the installed package is importable, as for a user's job. The
        # launcher dies with the pytest that started it (its workers follow it), as the test etcd does: a pytest
        # stopped by hand left whole jobs training against an etcd that was gone.
        # A path given relative to where the bench or test was started (a script's --config, as the benches'
        # docstrings show it) is made absolute: the job runs elsewhere.
        self.argv = [os.path.abspath(a) if os.sep in a and not os.path.isabs(a) and os.path.exists(a) else a
                     for a in self.argv]
        self.proc = subprocess.Popen(self.argv, env=env, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=self.out,
                                     preexec_fn=dies_with_this_thread())
        return self

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not finish in {timeout}s; log:\n{self.log()[-3000:]}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    # --- what the job left behind ---
    def losses(self, rank: int) -> list[dict[str, Any]]:
        path = os.path.join(self.out, f"loss_rank{rank}.jsonl")
        try:
            with open(path) as fh:
                text = fh.read()
        except FileNotFoundError:
            return []
        # a line without its newline is being written right now (a running job): it counts once complete
        return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]

    def step_reached(self, rank: int = 0) -> int:
        rows = self.losses(rank)
        return rows[-1]["step"] if rows else -1

    def wait_step(self, step: int, timeout: float, rank: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while self.step_reached(rank) < step:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"job exited early ({self.proc.returncode}):\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"step {step} not reached in {timeout}s:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for root, _dirs, files in os.walk(os.path.join(self.out, "logs")):
            if "events.jsonl" in files:
                with open(os.path.join(root, "events.jsonl")) as fh:
                    # a line without its newline is being written right now: read it on the next poll
                    out += [json.loads(line) for line in fh.read().split("\n")[:-1] if line.strip()]
        return sorted(out, key=lambda e: e["time"])

    def assert_running(self, what: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"job exited ({self.proc.returncode}) before {what}:\n{self.log()[-3000:]}")

    def wait_event(self, name: str, count: int = 1, timeout: float = 240, *, distinct: str | None = None,
                   match: Any = None) -> list[dict[str, Any]]:
        """Until ``count`` ``name`` events are logged (``distinct``: count distinct values of that field, e.g.
        ``swap_id``, since a phase can be logged again by each node and on a retry; ``match``: a predicate).
        Returns them. The deadline only catches a hang; the job exiting first fails at once."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events() if e["event"] == name and (match is None or match(e))]
            n = len({e.get(distinct) for e in found}) if distinct else len(found)
            if n >= count:
                return found
            self.assert_running(f"{count} {name} event(s)")
            if time.monotonic() > deadline:
                raise AssertionError(f"{n} of {count} {name} event(s) in {timeout}s:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def final(self, rank: int) -> dict[str, Any]:
        import torch

        return torch.load(os.path.join(self.out, f"final_rank{rank}.pt"), weights_only=False)


def taint(endpoint: str, run_id: str, *, rank: int | None = None, node: str | None = None,
          local_rank: int | None = None, reason: str = "test", wait: bool = False) -> int:
    """``tpassctl taint`` as a user would run it; returns its exit code (``wait``: until the swap resumed)."""
    argv = [sys.executable, "-m", "tpassrun.ops.ctl", "taint", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--reason", reason, *([] if wait else ["--no-wait"])]
    if rank is not None:
        argv += ["--rank", str(rank)]
    if node is not None:
        argv += ["--node", node]
    if local_rank is not None:
        argv += ["--local-rank", str(local_rank)]
    return subprocess.run(argv, capture_output=True, timeout=60).returncode


def _without_relogged(rows: list[dict[str, Any]], pids: Any) -> list[dict[str, Any]]:
    """``rows`` without the ones a process of ``pids`` (a lost node's, or a survivor rolled back by a mixed commit)
    logged for a step that it or its successor then logged again, identically: the step was re-executed after the
    failure (see :func:`assert_bit_exact`)."""
    out = []
    for i, row in enumerate(rows):
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        if (row["pid"] in pids and nxt is not None and nxt["step"] == row["step"]
                and nxt["loss"] == row["loss"]):
            continue
        out.append(row)
    return out


def unlogged_steps(rows: list[dict[str, Any]], pids: Any) -> set[int]:
    """Steps a process of ``pids`` (a lost node's) died in after its part of the step's all-reduce had reached
    the survivors, before it logged the step: its successor resumed at the next step (the log jumps a step where
    the process changes). The step happened; nobody was left to log it for that rank."""
    return {row["step"] + 1 for row, nxt in zip(rows, rows[1:])
            if row["pid"] in pids and nxt["pid"] != row["pid"] and nxt["step"] == row["step"] + 2}


def never_logged(rows: list[dict[str, Any]], steps: int, pids: Any) -> tuple[set[int], set[int]]:
    """A rank's log ``rows`` against steps ``0 .. steps - 1``: (steps never done, steps done but never logged by a
    process of ``pids`` killed in them, :func:`unlogged_steps`)."""
    missing = set(range(steps)) - {row["step"] for row in rows}
    done = unlogged_steps(_without_relogged(rows, pids), pids)
    return missing - done, missing & done


def assert_bit_exact(a: Job, b: Job, world: int, *, relogged_by: Any = (), caught_up: Any = ()) -> None:
    """Parameters and optimizer state ``torch.equal`` on every rank, and identical per-step loss logs.

    ``relogged_by``: the pids of a lost node's ranks. Two ranks that die together may disagree: one finished its
    part of a step's all-reduce and logged the step, the other died before the survivors could complete it; every
    rank then re-executes that step, and the first one's replacement logs it again. That row (same step, same loss,
    another process) is a side effect of the re-execution, not a difference: it is dropped before comparing (so is
    the row of a survivor that had completed a step a mixed commit rolls back: it logs the step again itself). And a
    lost rank whose part of a step reached the survivors, but which died before it logged the step, leaves that
    step unlogged (its successor starts at the next one): the reference's row for it is not asked for (the state
    after it still is, on every rank). ``caught_up``: (rank, step) pairs of survivors that caught up to ``step``
    after a mixed commit rolled forward (``rank_caught_up`` events): such a rank failed inside ``step - 1`` after
    its collectives and skipped the rest of it, so it may not have logged that step (the state is compared)."""
    import torch

    for r in range(world):
        fa, fb = a.final(r), b.final(r)
        if "model" not in fa:      # another script than examples/train_ddp.py: whatever it saved, all of it
            from realjobs import assert_trees_equal

            assert_trees_equal(fa, fb, f"rank {r}")
            fa = fb = {"model": {}, "optimizer": {"state": {}}, "scheduler": None, "sampler": None}
        for k, v in fa["model"].items():
            assert torch.equal(v, fb["model"][k]), f"rank {r}: parameter {k} differs"
        sa, sb = fa["optimizer"]["state"], fb["optimizer"]["state"]
        assert sa.keys() == sb.keys()
        for pid in sa:
            for k, v in sa[pid].items():
                assert torch.equal(v, sb[pid][k]), f"rank {r}: optimizer state {pid}/{k} differs"
        assert fa["scheduler"] == fb["scheduler"] and fa["sampler"] == fb["sampler"]
        rows = _without_relogged(a.losses(r), set(relogged_by))
        skipped = unlogged_steps(rows, set(relogged_by))
        logged = {x["step"] for x in rows}
        skipped |= {step - 1 for rank, step in caught_up if rank == r and step - 1 not in logged}
        la = [(x["step"], x["loss"]) for x in rows]
        lb = [(x["step"], x["loss"]) for x in b.losses(r) if x["step"] not in skipped]
        assert la == lb, f"rank {r}: per-step losses differ (or a step was lost or repeated)"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not count: it has died, nobody has reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_by_rank(job: Job, world: int) -> dict[int, set[int]]:
    return {r: {x["pid"] for x in job.losses(r)} for r in range(world)}


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)


class EtcdProxy:
    """A TCP forwarder in front of etcd for one client: ``cut()`` partitions that client from etcd as a dead
    link does (nothing is refused or reset: bytes just stop arriving, on open and new connections alike),
    ``heal()`` ends it (the connections open during the cut are then dropped). ``endpoint`` is what the
    client is given instead of etcd's. ``close()`` always cleans up."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self._lsock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.endpoint = f"127.0.0.1:{self._lsock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.is_cut = False
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="etcd-proxy").start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._lsock.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    c.close()
                    return
                self._socks.append(c)
                if self.is_cut:
                    continue      # a black hole: the client waits for an answer that never comes
            try:
                u = socket.create_connection(self.target, timeout=5)
                u.settimeout(None)
            except OSError:
                continue
            with self._lock:
                self._socks.append(u)
            for src, dst in ((c, u), (u, c)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.is_cut:
                    dst.sendall(data)
        except OSError:
            pass
        for x in (src, dst):
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)

    def _drop_all(self, *, cut: bool) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
            self.is_cut = cut
        for x in socks:
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)
            x.close()

    def cut(self) -> None:
        self.is_cut = True

    def heal(self) -> None:
        # what was open across the cut is dead, as TCP connections over a long cut are
        self._drop_all(cut=False)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._drop_all(cut=True)
        self._lsock.close()


def kill_etcd(server: Any) -> None:
    """SIGKILL a test etcd (``conftest.EtcdServer``)."""
    server.proc.kill()
    server.proc.wait()


def start_etcd_again(server: Any, timeout: float = 60.0) -> None:
    """Start a SIGKILLed test etcd again with the same argv (same ports and data: revisions and leases survive,
    as after a real etcd restart); returns once it answers /health."""
    import urllib.request

    server.proc = subprocess.Popen(server.proc.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True, preexec_fn=dies_with_this_thread())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{server.endpoint}/health", timeout=1) as resp:
                if b"true" in resp.read():
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("etcd did not come back")


def dies_with_this_thread():  # type: ignore[no-untyped-def]
    """A preexec_fn making a test's server die with the test process (a pytest killed by a timeout or by hand
    left its etcd servers running), or None off the main thread: PDEATHSIG fires when the forking *thread*
    exits, and a thread pool's thread may go before the test ends."""
    import threading

    from tpassrun.launch.procs import die_with_parent

    return die_with_parent(os.getpid()) if threading.current_thread() is threading.main_thread() else None


def restart_etcd(server: Any, down_s: float) -> None:
    """SIGKILL a test etcd, keep it down ``down_s``, start it again on the same data."""
    kill_etcd(server)
    time.sleep(down_s)
    start_etcd_again(server)


class FaultSwitches:
    """In-process faults (``TPASSRUN_FAULTS``) that a harness arms at a moment of its choosing.

    Every fault is listed at launch with a marker file that already exists, so none fires (a fault fires once,
    by creating its marker). ``arm`` deletes a marker: the next time a process reaches that fault point, it
    fires. ``disarm`` re-creates what did not fire. Points: ``receive`` (a joiner that starts listening for its
    state: kill), ``send`` (a leaver or donor about to stream its state: kill, or corrupt a byte on the wire)."""

    POINTS = (("receive", "kill"), ("send", "kill"), ("send", "corrupt"))

    def __init__(self, directory: str, ranks: int) -> None:
        self.dir = directory
        os.makedirs(directory, exist_ok=True)
        self.faults: list[dict[str, Any]] = []
        for rank in range(ranks):
            for where, action in self.POINTS:
                marker = os.path.join(directory, f"{where}-{action}-r{rank}")
                self.faults.append({"rank": rank, "where": where, "action": action, "marker": marker,
                                    "any_step": True, "step": 0})
        self.disarm()

    def env(self) -> dict[str, str]:
        return faults_env(*self.faults)

    def _marker(self, where: str, action: str, rank: int) -> str:
        return os.path.join(self.dir, f"{where}-{action}-r{rank}")

    def arm(self, where: str, action: str, ranks: list[int]) -> None:
        for rank in ranks:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._marker(where, action, rank))

    def fired(self, where: str, action: str) -> list[int]:
        """Ranks whose armed fault fired (its marker now holds the pid that claimed it)."""
        out = []
        for f in self.faults:
            if f["where"] == where and f["action"] == action:
                with contextlib.suppress(OSError):
                    if os.path.getsize(f["marker"]) > 0:
                        out.append(f["rank"])
        return out

    def disarm(self) -> None:
        """Every fault disarmed again; the markers of those that fired are emptied (so ``fired`` starts over)."""
        for f in self.faults:
            with open(f["marker"], "w"):
                pass


class NetLab:
    """Hosts with their own addresses on one machine (root only): a bridge in the root namespace holding
    ``10.77.<k>.1/24`` and one network namespace per host with a veth on the bridge (``10.77.<k>.<10+i>``), as in
    /work/shared/reference/testing.md. ``k`` is the first subnet no interface uses yet (from 1: the partition
    test uses 10.77.0), so two labs (two benches at once) do not route each other's packets. ``partition`` takes
    a host's link down (packets vanish, nothing is refused), ``heal`` brings it back. Names carry a per-run
    prefix; ``close`` removes everything."""

    def __init__(self, tag: str) -> None:
        self.tag = tag[:6]
        self.bridge = f"tp{self.tag}br"
        self.hosts: dict[int, tuple[str, str, str, str]] = {}   # i -> (netns, host-side veth, ns-side veth, addr)
        self._ip("link", "add", self.bridge, "type", "bridge")
        for k in range(1, 250):
            self.subnet = f"10.77.{k}"
            if f" {self.subnet}." in subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout:
                continue
            try:
                self._ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
                break
            except RuntimeError:   # taken by a lab starting at the same time
                continue
        self._ip("link", "set", self.bridge, "up")

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0 and subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0

    @staticmethod
    def _ip(*args: str, ns: str | None = None) -> None:
        argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")

    def add_host(self, i: int) -> str:
        """Create host ``i``; returns its address."""
        ns, outer, inner, addr = f"tp{self.tag}-h{i}", f"tp{self.tag}o{i}", f"tp{self.tag}i{i}", f"{self.subnet}.{10 + i}"
        self._ip("netns", "add", ns)
        self.hosts[i] = (ns, outer, inner, addr)
        self._ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        self._ip("link", "set", inner, "netns", ns)
        self._ip("link", "set", outer, "master", self.bridge)
        self._ip("link", "set", outer, "up")
        self._ip("addr", "add", f"{addr}/24", "dev", inner, ns=ns)
        self._ip("link", "set", inner, "up", ns=ns)
        self._ip("link", "set", "lo", "up", ns=ns)
        return addr

    def argv(self, i: int) -> list[str]:
        """The command prefix that runs a program on host ``i``."""
        return ["ip", "netns", "exec", self.hosts[i][0]]

    def env(self, i: int) -> dict[str, str]:
        """What a torch.distributed process on host ``i`` needs to pick its interface (gloo)."""
        return {"GLOO_SOCKET_IFNAME": self.hosts[i][2]}

    def addr(self, i: int) -> str:
        return self.hosts[i][3]

    def partition(self, i: int) -> None:
        self._ip("link", "set", self.hosts[i][1], "down")

    def heal(self, i: int) -> None:
        self._ip("link", "set", self.hosts[i][1], "up")

    def close(self) -> None:
        for ns, outer, _inner, _addr in self.hosts.values():
            subprocess.run(["ip", "link", "del", outer], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class SmallDisk:
    """A small tmpfs (root only) for logs, which ``fill`` fills up to the last byte and ``free`` empties again:
    a disk full for logs, at a moment of the harness's choosing. ``close`` unmounts it."""

    def __init__(self, path: str, size_mb: int = 64) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tpassrun-chaos", path],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"mount tmpfs on {path}: {r.stderr.strip()}")
        self._filler = os.path.join(path, ".filler")

    @staticmethod
    def available() -> bool:
        return os.geteuid() == 0

    def fill(self) -> None:
        try:
            fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError:     # full already (the logs did it)
            return
        try:    # unbuffered: nothing is left to flush (and fail) at close
            for size in (1 << 20, 4096, 1):     # the last partial megabyte and page too
                chunk = b"\0" * size
                try:
                    while os.write(fd, chunk) > 0:
                        pass
                except OSError:
                    pass
        finally:
            os.close(fd)

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._filler)

    def close(self) -> None:
        self.free()
        subprocess.run(["umount", "-l", self.path], capture_output=True)


# --- strangers on a port (issue 27: no stranger stalls a swap) ------------------------------------------


class Strangers:
    """From outside, against one port: ``silent`` connections held open without a word, and ``drippers`` that
    send a would-be proof one byte every ``every`` seconds and connect again whenever they are dropped (a
    patient attacker). :meth:`stop` ends them all; ``dropped`` counts how often the drippers were cut off."""

    def __init__(self, port: int, *, silent: int, drippers: int, every: float = 1.0) -> None:
        self.port, self.every = port, every
        self.dropped = self.dripped = 0
        self._stop = threading.Event()
        self._silent = []
        for _ in range(silent):
            try:
                self._silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                pass
        self._threads = [threading.Thread(target=self._drip, daemon=True) for _ in range(drippers)]
        for t in self._threads:
            t.start()

    def _drip(self) -> None:
        proof = b"TPAU" + bytes(64)
        while not self._stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                    for i in range(len(proof)):
                        sock.sendall(proof[i:i + 1])
                        self.dripped += 1
                        if self._stop.wait(self.every):
                            return
                        readable, _, _ = select.select([sock], [], [], 0)
                        if readable and sock.recv(4096) == b"":
                            break
            except OSError:
                pass
            self.dropped += 1
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)
        for s in self._silent:
            s.close()


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (its sockets' inodes in /proc/net/tcp{,6}, state LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ports.append(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc), parents first."""
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


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def storeserver_pids(agent_pid: int) -> list[int]:
    """The agent's workers' store (``tpassrun/launch/storeserver.py``), a child process of the agent."""
    out = []
    for child in _children(agent_pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                if b"storeserver" in fh.read():
                    out.append(child)
        except OSError:
            pass
    return out
