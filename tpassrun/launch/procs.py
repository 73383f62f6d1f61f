"""Local worker processes on asyncio (works under uvloop): logs layout, spawn, teardown.

* :class:`RunLogs` is torchrun's ``DefaultLogsSpecs``: the same directory layout
  ``<log_dir>/<run_id>_<rand>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}``, the same
  ``-r``/``-t``/``--local-ranks-filter``/duplicate-filter rules, ``os.devnull`` disables files.
* :func:`spawn_worker` starts one worker in its own session (so a terminal Ctrl-C reaches only the
  agent, which forwards it, as torchrun does) **and** with ``PR_SET_PDEATHSIG=SIGKILL`` (which
  torchrun does not do), so a SIGKILLed agent never leaves orphan workers behind.
* :func:`stop_workers` is the teardown ladder: signal each process group, grace period, SIGKILL,
  bounded wait. It never hangs.

Tee is done through a pipe: the agent copies every chunk to the log file and every complete line to
its console with torchrun's ``[<role><local_rank>]:`` prefix (torchrun writes the file, then tails it
every 0.1 s from a thread; the file content and the console lines are the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from string import Template
from typing import IO, BinaryIO

from tpassrun.settings import LaunchConfig, Std, StdSpec, std_for

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PUMP_CHUNK = 65536
RETRY_BROKEN_COPY_S = 5.0   # a worker output copy that failed (a full disk) is tried again this often


# --------------------------------------------------------------------------------------------
# log layout
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StdioSpec:
    """Where one worker's output goes.

    ``*_path``: the log file of that stream (redirected or tee'd), ``None`` if not to a file.
    ``tee_*``: also copy to the console, each line with ``prefix``.
    ``show_*``: for a stream with no file, whether it reaches the console (``False`` = devnull,
    the ``--local-ranks-filter`` rule).
    """

    stdout_path: str | None = None
    stderr_path: str | None = None
    tee_stdout: bool = False
    tee_stderr: bool = False
    show_stdout: bool = True
    show_stderr: bool = True
    prefix: str = ""
    error_file: str = ""
    filtered_stdout_path: str | None = None
    filtered_stderr_path: str | None = None
    stdout_filters: tuple[str, ...] = ()
    stderr_filters: tuple[str, ...] = ()


CONSOLE = StdioSpec()  # inherit the agent's stdout/stderr, no files


def line_prefix(role: str, local_rank: int, rank: int, template: str | None) -> str:
    """torchrun's tee header: ``[trainer0]:`` or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` expanded."""
    if template:
        return Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
    return f"[{role}{local_rank}]:"


class RunLogs:
    """One run's log directory, created on first use (the constructor does no I/O).

    Args:
        log_dir: base directory (``None``: a fresh ``mkdtemp(prefix="torchelastic_")``;
            ``os.devnull``: no files, everything to the console).
        run_id: the rendezvous run id; the run directory is ``mkdtemp(prefix=f"{run_id}_")``.
    """

    def __init__(
        self,
        log_dir: str | None,
        run_id: str,
        *,
        redirects: StdSpec = Std.NONE,
        tee: StdSpec = Std.NONE,
        local_ranks_filter: frozenset[int] | None = None,
        role: str = "default",
        prefix_template: str | None = None,
        stdout_filters: tuple[str, ...] = (),
        stderr_filters: tuple[str, ...] = (),
    ) -> None:
        self.log_dir = log_dir
        self.run_id = run_id
        self.redirects = redirects
        self.tee = tee
        self.local_ranks_filter = local_ranks_filter
        self.role = role
        self.prefix_template = prefix_template
        self.stdout_filters = stdout_filters
        self.stderr_filters = stderr_filters
        self._run_dir: str | None = None

    @classmethod
    def from_config(cls, cfg: LaunchConfig) -> "RunLogs":
        return cls(
            cfg.log_dir, cfg.rdzv_id, redirects=cfg.redirects, tee=cfg.tee,
            local_ranks_filter=cfg.local_ranks_filter, role=cfg.role,
            prefix_template=cfg.log_line_prefix_template,
            stdout_filters=cfg.duplicate_stdout_filters, stderr_filters=cfg.duplicate_stderr_filters,
        )

    @property
    def disabled(self) -> bool:
        return self.log_dir == os.devnull

    @property
    def run_dir(self) -> str | None:
        """``<log_dir>/<run_id>_<rand>`` (created on first call); ``None`` when disabled."""
        if self.disabled:
            return None
        if self._run_dir is None:
            base = self.log_dir or tempfile.mkdtemp(prefix="torchelastic_")
            os.makedirs(base, exist_ok=True)
            self._run_dir = tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=base)
            log.info("log directory set to: %s", self._run_dir)
        return self._run_dir

    def attempt_dir(self, attempt: int) -> str | None:
        run_dir = self.run_dir
        return None if run_dir is None else os.path.join(run_dir, f"attempt_{attempt}")

    def start_attempt(self, attempt: int) -> None:
        """Make a fresh ``attempt_<n>`` directory (torchrun wipes a previous one of the same number)."""
        path = self.attempt_dir(attempt)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)

    def stdio(self, attempt: int, local_rank: int, *, rank: int | None = None, dir_name: str | None = None) -> StdioSpec:
        """The spec for one worker of an attempt; creates its directory.

        ``dir_name`` defaults to the local rank; the agent may use another name (e.g. for a spare).
        Call :meth:`start_attempt` first for each attempt.
        """
        prefix = line_prefix(self.role, local_rank, local_rank if rank is None else rank, self.prefix_template)
        attempt_dir = self.attempt_dir(attempt)
        if attempt_dir is None:
            # torchrun with os.devnull: no files at all, both streams straight to the console.
            return StdioSpec(prefix=prefix, error_file="")
        wdir = os.path.join(attempt_dir, dir_name if dir_name is not None else str(local_rank))
        os.makedirs(wdir, exist_ok=True)
        tee = std_for(self.tee, local_rank)
        files = std_for(self.redirects, local_rank) | tee  # tee = redirect + copy to console
        shown = not self.local_ranks_filter or local_rank in self.local_ranks_filter
        tee_out = bool(tee & Std.OUT) and shown
        tee_err = bool(tee & Std.ERR) and shown
        return StdioSpec(
            stdout_path=os.path.join(wdir, "stdout.log") if files & Std.OUT else None,
            stderr_path=os.path.join(wdir, "stderr.log") if files & Std.ERR else None,
            tee_stdout=tee_out,
            tee_stderr=tee_err,
            show_stdout=shown,
            show_stderr=shown,
            prefix=prefix,
            error_file=os.path.join(wdir, "error.json"),
            filtered_stdout_path=os.path.join(attempt_dir, "filtered_stdout.log") if self.stdout_filters and tee_out else None,
            filtered_stderr_path=os.path.join(attempt_dir, "filtered_stderr.log") if self.stderr_filters and tee_err else None,
            stdout_filters=self.stdout_filters,
            stderr_filters=self.stderr_filters,
        )


# --------------------------------------------------------------------------------------------
# spawning
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def inherit_only(keep: Iterable[int] = ()) -> None:
    """Called in this process just before it starts a child: what ``subprocess``'s ``close_fds=True`` does, which
    uvloop's ``subprocess_exec`` silently ignores (its close_fds is a TODO). Every descriptor but 0-2 and ``keep``
    is made close-on-exec, so a worker under the agent's uvloop does not inherit the agent's sockets (an etcd
    connection, the store's listening socket, a peer link) that a C library opened without ``SOCK_CLOEXEC``: a
    worker that outlived its agent would hold the port, and a process snapshot would carry another process's
    connections (a CI run of tests/test_snapshot_criu.py counted 9 TCP ports in a 2-socket ping-pong).
    Done in the parent, not in a preexec_fn: Python code between fork and exec in a process with threads (gRPC's,
    the executor's) can deadlock the child on a lock another thread held at the fork (the pool node's spare
    node hung that way before exec). Harmless to this process: close-on-exec changes nothing until an exec."""
    kept = set(keep)
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd > 2 and fd not in kept:
                with contextlib.suppress(OSError):       # the listing's own descriptor is gone by now
                    os.set_inheritable(fd, False)


def die_with_parent(parent_pid: int):  # type: ignore[no-untyped-def]
    """A preexec_fn: SIGKILL this child when the agent dies; close the race with an early death."""
    libc = _libc()  # resolved before fork: the child only calls into it

    def preexec() -> None:
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # If the agent died between fork and prctl, no signal will ever come: die now.
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class _StreamCopier:
    """Copies a worker pipe to its log file, and complete lines (prefixed) to the console."""

    def __init__(self, file: IO[bytes] | None, console: BinaryIO | None, prefix: bytes,
                 filtered: IO[bytes] | None, filters: tuple[bytes, ...],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.file, self.console, self.prefix = file, console, prefix
        self.filtered, self.filters = filtered, filters
        self._partial = b""
        self._clock = clock
        self._broken: dict[str, list[float]] = {}   # copy -> [since, last try, bytes dropped] while it fails

    def _write(self, name: str, stream: IO[bytes] | BinaryIO, data: bytes) -> None:
        """A write that fails (disk full, a closed console) is reported once; that copy then drops what comes
        and tries again every RETRY_BROKEN_COPY_S, and says once when it writes again (a full disk freed). The
        pipe is always drained, so the worker never blocks on its own output and the job goes on."""
        down = self._broken.get(name)
        now = self._clock()
        if down is not None and now - down[1] < RETRY_BROKEN_COPY_S:
            down[2] += len(data)
            return
        try:
            stream.write(data)
            stream.flush()
        except (OSError, ValueError) as exc:
            if down is None:
                self._broken[name] = [now, now, len(data)]
                log.warning("cannot write the worker's output to %s (%s): dropping it (trying again every %g s), "
                            "the job goes on", getattr(stream, "name", name),
                            getattr(exc, "strerror", None) or exc, RETRY_BROKEN_COPY_S)
            else:
                down[1], down[2] = now, down[2] + len(data)
            return
        if down is not None:
            del self._broken[name]
            log.warning("writing the worker's output to %s again (%d bytes dropped over %.0f s)",
                        getattr(stream, "name", name), down[2], now - down[0])

    def feed(self, chunk: bytes) -> None:
        if self.file is not None:
            self._write("log file", self.file, chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        self._emit([line + b"\n" for line in lines])

    def finish(self) -> None:
        if self._partial:
            self._emit([self._partial])
            self._partial = b""

    def _emit(self, lines: list[bytes]) -> None:
        if not lines:
            return
        if self.console is not None:
            self._write("console", self.console, b"".join(self.prefix + line for line in lines))
        if self.filtered is not None:
            hits = [self.prefix + line for line in lines if any(f in line for f in self.filters)]
            if hits:
                self._write("filtered log", self.filtered, b"".join(hits))


async def _pump(reader: asyncio.StreamReader, copier: _StreamCopier) -> None:
    try:
        while chunk := await reader.read(_PUMP_CHUNK):
            copier.feed(chunk)
    finally:
        copier.finish()


class WorkerProcess:
    """One running worker. Built by :func:`spawn_worker`; ``await wait()`` returns its exit code
    (negative = killed by that signal) the moment it exits."""

    def __init__(self, proc: asyncio.subprocess.Process, *, local_rank: int, role: str,
                 argv: list[str], stdio: StdioSpec, pumps: list[asyncio.Task[None]],
                 files: list[IO[bytes]]) -> None:
        self._proc = proc
        self.local_rank = local_rank
        self.role = role
        self.argv = argv
        self.stdio = stdio
        self._pumps = pumps
        self._files = files

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    @property
    def error_file(self) -> str:
        return self.stdio.error_file

    async def wait(self) -> int:
        return await self._proc.wait()

    def signal_group(self, sig: int) -> bool:
        """Signal the worker's whole process group (its own session). False if already gone."""
        if self._proc.returncode is not None:
            return False
        try:
            os.killpg(self._proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def kill_leftovers(self) -> bool:
        """SIGKILL what is left of a dead worker's process group (its own session): children it forked, e.g.
        DataLoader workers, inherit its sockets (gloo's among them), so its peers would not see its connections
        close until those children noticed and exited on their own (seconds). False if nothing was left."""
        if self._proc.returncode is None:
            return False
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    async def aclose(self, timeout: float = 2.0) -> None:
        """Drain the tee pipes (bounded: a grandchild may hold them open) and close log files."""
        if self._pumps:
            _, pending = await asyncio.wait(self._pumps, timeout=timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self._pumps, return_exceptions=True)
            self._pumps = []
        for f in self._files:
            f.close()
        self._files = []

    def __repr__(self) -> str:
        return f"WorkerProcess(role={self.role!r}, local_rank={self.local_rank}, pid={self.pid}, returncode={self.returncode})"


async def spawn_worker(
    argv: list[str],
    env: Mapping[str, str],
    stdio_spec: StdioSpec,
    *,
    local_rank: int,
    role: str,
    console: tuple[BinaryIO, BinaryIO] | None = None,
    cwd: str | None = None,
    piped: bool = False,
) -> WorkerProcess:
    """Start one worker.

    Args:
        argv: from :func:`tpassrun.launch.workerenv.worker_argv`.
        env: the complete environment, from :func:`tpassrun.launch.workerenv.worker_env`.
        stdio_spec: from :meth:`RunLogs.stdio` (or :data:`CONSOLE`).
        console: where tee'd lines go (default: this process's stdout/stderr).
        piped: every stream the worker may write goes through a pipe this process copies (to its file, to the
            console, or both: what torchrun would have written), never a descriptor the worker shares with the
            agent (the transparent mode: a process snapshot restores a pipe in its place, tpassrun/snapshot).

    Raises:
        OSError: the executable cannot be started (e.g. ``FileNotFoundError``).
    """
    out_console, err_console = console or (sys.stdout.buffer, sys.stderr.buffer)
    files: list[IO[bytes]] = []
    # piped: real pipes of our own (uvloop's PIPE is a unix socketpair, which CRIU refuses as an external socket)
    own_pipes: dict[int, int] = {}      # write end -> read end

    def target(path: str | None, tee: bool, shown: bool) -> int | IO[bytes] | None:
        if piped and (path is not None or shown):
            r, w = os.pipe()
            own_pipes[w] = r
            return w
        if path is not None and tee:
            return asyncio.subprocess.PIPE
        if path is not None:
            # appended: a slot started again in the same attempt (a spare after a swap, a membership change) keeps
            # what the previous worker there said (a joiner that died, a re-form that hung) for the post-mortem
            f = open(path, "ab")  # owned by the WorkerProcess
            files.append(f)
            return f
        return None if shown else asyncio.subprocess.DEVNULL

    s = stdio_spec
    try:
        stdout = target(s.stdout_path, s.tee_stdout, s.show_stdout)
        stderr = target(s.stderr_path, s.tee_stderr, s.show_stderr)
        inherit_only()
        proc = await asyncio.create_subprocess_exec(
            *argv, env=dict(env), cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            start_new_session=True, preexec_fn=die_with_parent(os.getpid()),
        )
    except BaseException:
        for f in files:
            f.close()
        for w, r in own_pipes.items():
            os.close(w)
            os.close(r)
        raise
    for f in files:  # the child has its own copy of the descriptor now
        f.close()
    files.clear()
    log.debug("spawned worker %s%d: pid %d", role, local_rank, proc.pid)
    readers: list[asyncio.StreamReader | None] = [proc.stdout, proc.stderr]
    for i, fd in enumerate((stdout, stderr)):
        if isinstance(fd, int) and fd in own_pipes:
            os.close(fd)
            readers[i] = await _pipe_reader(own_pipes[fd])
    pumps = _start_pumps(s, readers[0], readers[1], (out_console, err_console), files, f"{role}{local_rank}")
    return WorkerProcess(proc, local_rank=local_rank, role=role, argv=list(argv), stdio=s, pumps=pumps, files=files)


def _start_pumps(s: StdioSpec, out: asyncio.StreamReader | None, err: asyncio.StreamReader | None,
                 consoles: tuple[BinaryIO, BinaryIO], files: list[IO[bytes]], name: str) -> list[asyncio.Task[None]]:
    """A copier per piped stream: to its log file (if any), its complete lines to the console when tee'd (with the
    prefix) or when the stream has no file but is shown (as torchrun's worker would have written it itself)."""
    pumps: list[asyncio.Task[None]] = []
    prefix = s.prefix.encode()
    for reader, path, tee, shown, con, fpath, filters in (
        (out, s.stdout_path, s.tee_stdout, s.show_stdout, consoles[0], s.filtered_stdout_path, s.stdout_filters),
        (err, s.stderr_path, s.tee_stderr, s.show_stderr, consoles[1], s.filtered_stderr_path, s.stderr_filters),
    ):
        if reader is None:
            continue
        logf = open(path, "ab") if path is not None else None  # appended, as above
        if logf is not None:
            files.append(logf)
        filtered = open(fpath, "ab") if fpath else None  # shared by the attempt's workers
        if filtered is not None:
            files.append(filtered)
        if path is None:      # piped only so no descriptor is shared: the console gets it unprefixed, as is
            copier = _StreamCopier(None, con if shown else None, b"", None, ())
        else:
            copier = _StreamCopier(logf, con if tee else None, prefix, filtered, tuple(f.encode() for f in filters))
        pumps.append(asyncio.create_task(_pump(reader, copier), name=f"tee-{name}"))
    return pumps


class _Adopted:
    """A worker this process did not start but is the parent of (restored by criu with ``--restore-sibling``): its
    exit is seen through a pidfd and reaped with waitpid, like asyncio's own children."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pidfd = os.pidfd_open(pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:      # not ours to reap (should not happen): it is gone all the same
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = os.waitstatus_to_exitcode(status)
        if not self._done.done():
            self._done.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    """A StreamReader over the read end ``fd`` of a pipe (owned from now on)."""
    reader = asyncio.StreamReader(limit=_PUMP_CHUNK)
    await asyncio.get_running_loop().connect_read_pipe(functools.partial(asyncio.StreamReaderProtocol, reader),
                                                       os.fdopen(fd, "rb", 0))
    return reader


async def adopt_worker(pid: int, stdio_spec: StdioSpec, out_fd: int | None, err_fd: int | None, *, local_rank: int,
                       role: str, argv: list[str], console: tuple[BinaryIO, BinaryIO] | None = None) -> WorkerProcess:
    """A :class:`WorkerProcess` for a restored worker (a child of this process it did not spawn): ``out_fd`` and
    ``err_fd`` are the read ends of the pipes put in place of its stdout/stderr (owned from now on)."""
    readers = [None if fd is None else await _pipe_reader(fd) for fd in (out_fd, err_fd)]
    files: list[IO[bytes]] = []
    pumps = _start_pumps(stdio_spec, readers[0], readers[1], console or (sys.stdout.buffer, sys.stderr.buffer),
                         files, f"{role}{local_rank}")
    return WorkerProcess(_Adopted(pid), local_rank=local_rank, role=role, argv=argv,  # type: ignore[arg-type]
                         stdio=stdio_spec, pumps=pumps, files=files)


# --------------------------------------------------------------------------------------------
# teardown
# --------------------------------------------------------------------------------------------


async def stop_workers(
    procs: Iterable[WorkerProcess],
    sig: int = signal.SIGTERM,
    grace: float = 30.0,
    *,
    kill_wait: float = 5.0,
    signalled: bool = False,
) -> list[int | None]:
    """Signal every live worker's process group with ``sig``, wait up to ``grace`` seconds, SIGKILL
    the rest, wait at most ``kill_wait`` more. Returns the exit codes in order (``None``: a worker that
    survived even SIGKILL, which means it is stuck in the kernel, e.g. D-state on a dead device).
    ``signalled``: ``sig`` was already sent (forwarded at once): it is not sent twice (a second SIGINT would
    interrupt the script's own cleanup of the first).
    """
    procs = list(procs)
    waits = {p: asyncio.ensure_future(p.wait()) for p in procs}
    try:
        if not signalled:
            for p in procs:
                p.signal_group(sig)
        live = [waits[p] for p in procs if not waits[p].done()]
        if live:
            await asyncio.wait(live, timeout=grace)
        stubborn = [p for p in procs if not waits[p].done()]
        for p in stubborn:
            log.warning("worker %s (pid %d) ignored %s for %.1fs; sending SIGKILL",
                        p.local_rank, p.pid, signal.Signals(sig).name, grace)
            p.signal_group(signal.SIGKILL)
        if stubborn:
            await asyncio.wait([waits[p] for p in stubborn], timeout=kill_wait)
        for p in procs:
            if not waits[p].done():
                # Why not wait longer: a process in uninterruptible sleep cannot be reaped until the
                # kernel lets go; hanging the agent here would block the whole job's recovery.
                log.error("worker %s (pid %d) survived SIGKILL for %.1fs (D-state?); giving up on it",
                          p.local_rank, p.pid, kill_wait)
    finally:
        for w in waits.values():
            if not w.done():
                w.cancel()
        await asyncio.gather(*waits.values(), return_exceptions=True)
        await asyncio.gather(*(p.aclose() for p in procs), return_exceptions=True)
    return [p.returncode for p in procs]
