"""Shared fixtures: one real etcd server per test session, unique run ids per test."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _etcd_binary() -> str:
    for cand in (os.environ.get("TPASSRUN_ETCD_BIN"), "/usr/bin/etcd", shutil.which("etcd")):
        if cand and os.path.exists(cand):
            return cand
    pytest.skip("no etcd binary")


class EtcdServer:
    """A throw-away etcd on free ports. ``endpoint`` is ``<host>:<port>`` (``host``: loopback unless given, e.g. a
    bridge address that network namespaces reach)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.dir = tempfile.mkdtemp(prefix="tpassrun-test-etcd-")
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.host = host

    def start(self) -> "EtcdServer":
        from faults import dies_with_this_thread

        for _ in range(5):
            self.port, peer = _free_port(), _free_port()
            data = os.path.join(self.dir, "data")
            shutil.rmtree(data, ignore_errors=True)
            self.proc = subprocess.Popen(
                [_etcd_binary(), "--name", "t", "--data-dir", data,
                 "--listen-client-urls", f"http://{self.host}:{self.port}",
                 "--advertise-client-urls", f"http://{self.host}:{self.port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"t=http://127.0.0.1:{peer}",
                 "--logger", "zap", "--log-level", "error"],
                stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, "log"), "w"),
                start_new_session=True, preexec_fn=dies_with_this_thread())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=1) as r:
                        if b"true" in r.read():
                            return self
                except OSError:
                    time.sleep(0.02)
            self.stop()
        raise RuntimeError("etcd did not start")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class EtcdCluster:
    """Three etcd members on loopback forming one cluster (raft between them): ``endpoints`` is the comma-separated
    list a job is given. A member can be SIGKILLed (``kill``), stopped and resumed (``pause``/``resume``: SIGSTOP,
    SIGCONT); ``leader()`` is the member the live ones agree leads."""

    SIZE = 3

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="tpassrun-test-etcd3-")
        self.procs: list[subprocess.Popen | None] = [None] * self.SIZE
        self.ports: list[int] = []
        self.paused: set[int] = set()

    def start(self) -> "EtcdCluster":
        from faults import dies_with_this_thread

        for _ in range(3):
            self.ports, peers = [_free_port() for _ in range(self.SIZE)], [_free_port() for _ in range(self.SIZE)]
            cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(peers))
            token = "t-" + uuid.uuid4().hex[:8]
            for i in range(self.SIZE):
                data = os.path.join(self.dir, f"m{i}")
                shutil.rmtree(data, ignore_errors=True)
                self.procs[i] = subprocess.Popen(
                    [_etcd_binary(), "--name", f"m{i}", "--data-dir", data,
                     "--listen-client-urls", f"http://127.0.0.1:{self.ports[i]}",
                     "--advertise-client-urls", f"http://127.0.0.1:{self.ports[i]}",
                     "--listen-peer-urls", f"http://127.0.0.1:{peers[i]}",
                     "--initial-advertise-peer-urls", f"http://127.0.0.1:{peers[i]}",
                     "--initial-cluster", cluster, "--initial-cluster-token", token,
                     "--initial-cluster-state", "new", "--logger", "zap", "--log-level", "error"],
                    stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.dir, f"m{i}.log"), "w"),
                    start_new_session=True, preexec_fn=dies_with_this_thread())
            if self.wait_healthy(range(self.SIZE), 30):
                return self
            self.stop()
        raise RuntimeError("the etcd cluster did not start")

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def live(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None and i not in self.paused]

    def _status(self, i: int) -> dict | None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.ports[i]}/v3/maintenance/status", data=b"{}",
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=1) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def leader(self) -> int | None:
        """The member every live member names as leader (None while they do not agree or have none)."""
        ids, leaders = {}, set()
        for i in self.live():
            st = self._status(i)
            if st is None:
                return None
            ids[st["header"]["member_id"]] = i
            leaders.add(st.get("leader"))
        (leader,) = leaders if len(leaders) == 1 else (None,)
        return ids.get(leader)

    def wait_healthy(self, members, timeout: float) -> bool:
        """Every member in ``members`` answers /health true (it has a leader)."""
        deadline = time.monotonic() + timeout
        pending = set(members)
        while pending and time.monotonic() < deadline:
            for i in sorted(pending):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[i]}/health", timeout=1) as r:
                        if b"true" in r.read():
                            pending.discard(i)
                except OSError:
                    time.sleep(0.05)
        return not pending

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        assert proc is not None
        proc.kill()
        proc.wait()

    def pause(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGSTOP)
        self.paused.add(i)

    def resume(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGCONT)
        self.paused.discard(i)

    def stop(self) -> None:
        for i in list(self.paused):
            self.resume(i)
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def etcd_cluster():
    """A private 3-member etcd cluster (tests kill, stop and resume its members)."""
    cluster = EtcdCluster().start()
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="session")
def etcd_server():
    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def fresh_etcd():
    """A private etcd for tests that kill or restart the server."""
    server = EtcdServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def run_id() -> str:
    return "t-" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``reference_run(nproc, steps)``: the uninterrupted reference of ``examples/train_ddp.py`` that bit-exactness
    is judged against, as a torchrun user runs it (plain ``torchrun``, a hand-built ``DistributedDataParallel``, no
    fault), made once per (nproc, steps) for the whole session and shared by every module that compares with it
    (a reference run is a whole job's start-up, most of what a run costs here). The step sleep is left out: it
    changes no numerics."""
    from faults import Job

    made: dict[tuple[int, int], Job] = {}

    def get(nproc: int, steps: int) -> Job:
        if (nproc, steps) not in made:
            job = Job.torchrun(str(tmp_path_factory.mktemp(f"ref{nproc}x{steps}")), nproc=nproc, steps=steps,
                               step_sleep=0.0, script_args=["--ddp", "torch"]).start()
            try:
                assert job.wait(300) == 0, job.log()[-3000:]
            finally:
                job.kill()
            made[(nproc, steps)] = job
        return made[(nproc, steps)]

    return get


# --- nothing left behind -------------------------------------------------------------------------------------
# Every process a test starts inherits this marker (and pytest's PYTEST_CURRENT_TEST, naming the test and its
# phase). After each test, a process still alive that was started by that test's body is a leak: an orphaned
# worker, spare or agent would otherwise outlive the test, hold ports and CPU, and disturb the tests after it.
SESSION_MARK = "TPASSRUN_TEST_SESSION"
os.environ[SESSION_MARK] = str(os.getpid())


def _started_by(nodeid: str) -> list[tuple[int, str]]:
    mine = f"{SESSION_MARK}={os.getpid()}".encode()
    call = f"PYTEST_CURRENT_TEST={nodeid} (call)".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            if mine in env and call in env and state != b"Z":
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found.append((int(entry), f.read().replace(b"\0", b" ").decode(errors="replace")[:160]))
        except OSError:
            continue
    return found


# Every test also runs with a $TMPDIR of its own, which every process it starts inherits (short, under /tmp: a
# unix socket path below it must fit in 108 bytes). What is left there once the test's processes are gone is
# looked at, then the directory is removed, so nothing a test makes in the temp dir outlives it: multiprocessing's
# pymp-* directories (the resource sharer's listeners of DataLoader workers killed by a signal, or of a script
# leaving with os._exit without multiprocessing's exit handler) are a leak, and fail the test; torch's and
# torchrun's own (torchelastic_*, as torchrun leaves them; torchinductor_*) and tpassrun's run registry go with the
# directory. A test that kills workers with DataLoader workers on purpose points its job's TMPDIR at its tmp_path.
LEAKED_IN_TMPDIR = ("pymp-",)


@contextlib.contextmanager
def _tmpdir_of_own(prefix: str):
    """$TMPDIR (and ``tempfile``'s) pointed at a new private directory for the block; yields its path. The
    directory is left for the caller to look at and remove."""
    private = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = private
    try:
        yield private
    finally:
        if saved[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved[0]
        tempfile.tempdir = saved[1]


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir(tmp_path_factory):
    """Session- and module-scoped fixtures (the torchrun reference runs) start processes outside any test: they
    get a $TMPDIR of the session's, removed at its end (torchrun leaves its torchelastic_* dirs behind)."""
    tmp_path_factory.getbasetemp()               # pytest's own temp root stays where it is
    with _tmpdir_of_own("tps-") as private:
        try:
            yield
        finally:
            shutil.rmtree(private, ignore_errors=True)


@pytest.fixture(autouse=True)
def _nothing_left_behind(request, tmp_path_factory, _session_tmpdir):
    tmp_path_factory.getbasetemp()               # pytest's own temp root stays where it is
    with _tmpdir_of_own("tpt-") as private:
        yield
    try:
        deadline = time.monotonic() + 15.0           # a killed job's processes may take a moment to be reaped
        left = _started_by(request.node.nodeid)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _started_by(request.node.nodeid)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        assert not left, "processes left behind by the test:\n" + "\n".join(f"{p}: {c}" for p, c in left)
        leaked = sorted(n for n in os.listdir(private) if n.startswith(LEAKED_IN_TMPDIR))
        assert not leaked, f"left behind in $TMPDIR by the test: {leaked}"
    finally:
        shutil.rmtree(private, ignore_errors=True)


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    """``@pytest.mark.acceptance`` runs only with ``TPASSRUN_ACCEPTANCE=1``: an issue's acceptance run that does
    not fit CI's time budget (the README's test command skips it and says so)."""
    if os.environ.get("TPASSRUN_ACCEPTANCE") == "1":
        return
    skip = pytest.mark.skip(reason="an acceptance run outside CI's budget: TPASSRUN_ACCEPTANCE=1 runs it")
    for item in items:
        if "acceptance" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):  # type: ignore[no-untyped-def]
    """A test that starts a real job (faults.Job) must be marked ``e2e`` (the fast tier, ``-m "not e2e"``, leaves
    those out): faults.Job.start refuses to start one for a test that is not (set before its fixtures run, so a
    shared reference run made for it counts too)."""
    import faults

    faults.UNMARKED_TEST = None if item.get_closest_marker("e2e") else item.nodeid


def pytest_runtest_teardown(item, nextitem):  # type: ignore[no-untyped-def]
    import faults

    faults.UNMARKED_TEST = None
