"""The effects of the transparent mode, thin: run criu (probe, dump, restore), stop and continue process groups,
read a process's stdio pipes, wait for PIDs to be gone. Every decision is in :mod:`tpassrun.snapshot.plan`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from collections.abc import Iterable, Mapping, Sequence

from tpassrun.launch import inherit_only
from tpassrun.snapshot.plan import Availability, criu_candidates, dump_argv, first_usable, judge, lock_ruleset, restore_argv

PROBE_TIMEOUT_S = 20.0
CRIU_TIMEOUT_S = 120.0


class SnapshotError(RuntimeError):
    """A dump or a restore failed; the message ends with the last line of criu's log."""


async def _run(argv: Sequence[str], *, cwd: str | None = None, pass_fds: Sequence[int] = (),
               timeout: float = CRIU_TIMEOUT_S, stdin: bytes | None = None) -> tuple[int | None, str]:
    """(exit code, output); exit code None when it could not be started. Bounded: a criu that hangs is killed."""
    inherit_only(pass_fds)
    try:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, stdin=asyncio.subprocess.PIPE if stdin is not None
                                                    else asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                    pass_fds=tuple(pass_fds))
    except OSError as exc:
        return None, str(exc)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return -9, f"{argv[0]} {argv[1]} timed out after {timeout:g} s"
    return proc.returncode, out.decode(errors="replace")


async def probe(environ: Mapping[str, str]) -> Availability:
    """``criu --version`` and ``criu check`` of each candidate binary; the first usable one wins."""
    verdicts = []
    for criu in criu_candidates(environ, shutil.which("criu")):
        vrc, vout = await _run([criu, "--version"], timeout=PROBE_TIMEOUT_S)
        crc, cout = (await _run([criu, "check"], timeout=PROBE_TIMEOUT_S)) if vrc == 0 else (None, "")
        verdicts.append(judge(criu, vrc, vout, crc, cout, shutil.which("nft")))
        if verdicts[-1].usable:
            break
    return first_usable(verdicts)


def signal_groups(pids: Iterable[int], sig: int) -> None:
    """``sig`` to each worker's process group (a worker is its session's and group's leader)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


def stop_groups(pids: Iterable[int]) -> None:
    signal_groups(pids, signal.SIGSTOP)


def continue_groups(pids: Iterable[int]) -> None:
    signal_groups(pids, signal.SIGCONT)


async def wait_stopped(pids: Iterable[int], timeout: float = 5.0) -> None:
    """Until every process of every group is in the stopped state (``T``), so no rank runs while a peer is dumped."""
    deadline = time.monotonic() + timeout
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        pending = {p for p in pending if not _group_stopped(p)}
        if pending:
            await asyncio.sleep(0.005)


def _group_stopped(pgid: int) -> bool:
    for task in _tasks_of_group(pgid):
        state = _state(task)
        if state not in ("T", "t", "Z", "X", None):
            return False
    return True


def _tasks_of_group(pgid: int) -> list[str]:
    """Every thread of every process in group ``pgid`` ("PID/task/TID" paths under /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(int(name)) == pgid:
                out += [f"{name}/task/{t}" for t in os.listdir(f"/proc/{name}/task")]
    return out


def _state(task: str) -> str | None:
    try:
        with open(f"/proc/{task}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def stdio_pipes(pid: int) -> dict[int, str]:
    """fd -> "pipe:[ino]" for the process's stdout/stderr that are pipes (the agent's copies: replaced on restore)."""
    out = {}
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("pipe:["):
                out[fd] = link
    return out


def tcp_ports(pgids: Iterable[int]) -> list[int]:
    """The local ports of every TCP socket (listening or connected) held by any process of the groups ``pgids``."""
    inodes: set[str] = set()
    for pgid in pgids:
        for task in {t.split("/", 1)[0] for t in _tasks_of_group(pgid)}:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{task}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{task}/fd/{fd}")
                        if link.startswith("socket:["):
                            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as fh:
            for line in list(fh)[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[9] in inodes:
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


class NetworkLock:
    """The job's network lock (see :func:`tpassrun.snapshot.plan.lock_ruleset`): ``async with NetworkLock(ports)``."""

    def __init__(self, ports: Sequence[int]) -> None:
        self.ports = list(ports)
        self.table = f"tpassrun_lock_{os.getpid()}"

    async def __aenter__(self) -> "NetworkLock":
        if self.ports:
            rc, out = await _run(["nft", "-f", "-"], stdin=lock_ruleset(self.table, self.ports).encode())
            if rc != 0:
                raise SnapshotError(f"cannot lock the job's connections (nft): {out.strip()[:300]}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.ports:
            await _run(["nft", "delete", "table", "inet", self.table])


async def dump(criu: str, pid: int, images: str, *, leave_running: bool) -> float:
    """Dump ``pid``'s tree into ``images``; returns the seconds it took. Raises SnapshotError."""
    os.makedirs(images, exist_ok=True)
    t0 = time.monotonic()
    rc, out = await _run(dump_argv(criu, pid, images, leave_running=leave_running), cwd=images)
    if rc != 0:
        raise SnapshotError(f"criu dump of pid {pid} failed ({rc}): {_log_tail(images, 'dump.log', out)}")
    return time.monotonic() - t0


async def restore(criu: str, images: str, inherit: Mapping[str, int]) -> int:
    """Restore one rank's tree from ``images`` as a child of this process; ``inherit``: dumped "pipe:[ino]" -> the fd
    (of this process) to put in its place. Returns the restored root's pid. Raises SnapshotError."""
    pidfile = os.path.join(images, "restored.pid")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(pidfile)
    argv = restore_argv(criu, images, pidfile, [(fd, what) for what, fd in inherit.items()])
    rc, out = await _run(argv, cwd=images, pass_fds=list(inherit.values()))
    if rc != 0:
        raise SnapshotError(f"criu restore from {images} failed ({rc}): {_log_tail(images, 'restore.log', out)}")
    with open(pidfile) as fh:
        return int(fh.read().strip())


def _log_tail(images: str, name: str, out: str) -> str:
    """The first error criu logged (the cause; the last one is the generic "Dumping FAILED")."""
    try:
        with open(os.path.join(images, name), errors="replace") as fh:
            lines = [ln.strip() for ln in fh if "Error" in ln]
    except OSError:
        lines = []
    with contextlib.suppress(OSError):     # kept beside the images' directory for the post-mortem
        shutil.copy(os.path.join(images, name), os.path.dirname(os.path.dirname(images)) + f"/failed-{name}")
    return (lines[0] if lines else out.strip().splitlines()[-1] if out.strip() else "no output")[:300]


async def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> bool:
    """Until none of ``pids`` exists (a restore re-creates the same PIDs: ``Can't fork for PID: File exists``)."""
    deadline = time.monotonic() + timeout
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        pending = {p for p in pending if os.path.exists(f"/proc/{p}")}
        if pending:
            await asyncio.sleep(0.01)
    return not pending
