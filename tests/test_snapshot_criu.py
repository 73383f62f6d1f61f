"""tpassrun/snapshot's effects with the real CRIU on two plain processes (no torch): a TCP ping-pong between them is
stopped, dumped while left running, then both are killed and restored from the images as children of this process
(their stdout pipes replaced by new ones), continued, and finish the count exactly: no message lost or doubled.
Skipped, saying why, without root or a usable CRIU (bash scripts/criu.sh)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

from tpassrun.launch.procs import StdioSpec, adopt_worker, spawn_worker
from tpassrun.snapshot import (
    NetworkLock,
    continue_groups,
    dump,
    probe,
    restore,
    signal_groups,
    stdio_pipes,
    stop_groups,
    tcp_ports,
    wait_gone,
    wait_stopped,
)

pytestmark = pytest.mark.timeout(120)

PEER = r"""
import os, socket, sys, time
role, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if role == "server":
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port)); srv.listen(1); s, _ = srv.accept(); srv.close()
else:
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port)); break
        except OSError:
            time.sleep(0.05)
    s.sendall(b"%08d" % 0)
os.close(0)
while True:
    got = b""
    while len(got) < 8:
        chunk = s.recv(8 - len(got))
        if not chunk:
            sys.exit(3)
        got += chunk
    k = int(got)
    print(role, k, flush=True)
    if k >= n:
        if role == "server":
            s.sendall(b"%08d" % (k + 1))
        sys.exit(0 if k in (n, n + 1) else 4)
    time.sleep(0.02)
    s.sendall(b"%08d" % (k + 1))
"""


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "CRIU needs root"
    got = asyncio.run(probe(os.environ))
    return None if got.usable else f"no usable CRIU ({got.reason}); bash scripts/criu.sh installs one"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])     # the agent runs on uvloop: its pipes must be pipes too
def test_two_processes_and_their_connection_survive_a_snapshot_kill_and_restore(tmp_path, loop) -> None:
    why = _usable()
    if why is not None:
        pytest.skip(why)
    criu = asyncio.run(probe(os.environ)).criu
    if loop == "uvloop":
        import uvloop

        uvloop.run(_scenario(criu, str(tmp_path)))
    else:
        asyncio.run(_scenario(criu, str(tmp_path)))


async def _scenario(criu: str, tmp: str) -> None:
    port, n = _free_port(), 150
    specs = {role: StdioSpec(stdout_path=os.path.join(tmp, f"{role}.out"), stderr_path=os.path.join(tmp, f"{role}.err"),
                             show_stdout=False, show_stderr=False) for role in ("server", "client")}
    procs = {}
    for i, role in enumerate(("server", "client")):
        procs[role] = await spawn_worker([sys.executable, "-c", PEER, role, str(port), str(n)], os.environ,
                                         specs[role], local_rank=i, role="t", piped=True)
        await asyncio.sleep(0.3 if role == "server" else 0)
    try:
        await asyncio.sleep(1.0)
        pids = {role: p.pid for role, p in procs.items()}
        stop_groups(pids.values())
        await wait_stopped(pids.values())
        pipes = {role: stdio_pipes(pid) for role, pid in pids.items()}
        assert all(1 in p and p[1].startswith("pipe:[") for p in pipes.values()), pipes
        ports = tcp_ports(pids.values())
        assert len(ports) == 2, ports                           # the connection's two ends
        async with NetworkLock(ports):
            await asyncio.gather(*(dump(criu, pid, os.path.join(tmp, role), leave_running=True)
                                   for role, pid in pids.items()))
        continue_groups(pids.values())
        await asyncio.sleep(0.5)                                # they go on past the snapshot ...
        signal_groups(pids.values(), signal.SIGKILL)            # ... and die: back to the snapshot
        assert [await p.wait() for p in procs.values()] == [-9, -9]
        for p in procs.values():
            await p.aclose()
        assert await wait_gone(pids.values())
        restored = {}
        async with NetworkLock(ports):      # one after the other, on purpose: the lock is what keeps the first one's
            for i, role in enumerate(("server", "client")):      # connection from being reset by the missing peer
                (r1, w1), (r2, w2) = os.pipe(), os.pipe()
                pid = await restore(criu, os.path.join(tmp, role), {pipes[role][1]: w1, pipes[role][2]: w2})
                os.close(w1)
                os.close(w2)
                assert pid == pids[role]                            # the same PID, a child of this process again
                restored[role] = await adopt_worker(pid, specs[role], r1, r2, local_rank=i, role="t", argv=[])
        continue_groups(pids.values())
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in restored.values())), 60)
        for p in restored.values():
            await p.aclose()
        assert codes == [0, 0], [open(os.path.join(tmp, f"{r}.err")).read()[-2000:] for r in ("server", "client")]
        for role in ("server", "client"):
            with open(specs[role].stdout_path or "") as fh:
                text = fh.read()
            assert all(len(line.split()) == 2 for line in text.splitlines()), (role, text)
            counts = [int(line.split()[1]) for line in text.splitlines()]
            # the log holds the first run up to its death, then the restored run from the snapshot on (one step back):
            # after it, each count the peer sent arrives exactly once and in order, to the end
            drops = [i for i in range(1, len(counts)) if counts[i] <= counts[i - 1]]
            assert len(drops) == 1, (role, counts)
            after = counts[drops[0]:]
            assert after[-1] in (n, n + 1) and all(b == a + 2 for a, b in zip(after, after[1:])), (role, after)
    finally:                # a failed assertion leaves no process behind (the next test's fixture counts them)
        signal_groups([p.pid for p in procs.values()], signal.SIGKILL)
