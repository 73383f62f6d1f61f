"""A worker inherits only its stdio, on either event loop. uvloop's ``subprocess_exec`` ignores ``close_fds`` (a
TODO in uvloop), so a descriptor of the agent's left inheritable by a C library (a socket opened without
``SOCK_CLOEXEC``) went on into every worker: a CI run of tests/test_snapshot_criu.py under uvloop found 9 TCP ports
in the process groups of a 2-socket ping-pong, sockets the pytest process had opened in earlier tests."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import pytest

from tpassrun.launch.procs import StdioSpec, spawn_worker

pytestmark = pytest.mark.timeout(60)

LIST_FDS = """
import os
for fd in os.listdir('/proc/self/fd'):
    try:
        print(os.readlink('/proc/self/fd/' + fd))
    except OSError:
        pass
"""


async def _fds_of_a_worker(tmp: str) -> tuple[list[str], list[str]]:
    leaked = socket.socket()                # as a C library would leave it: inheritable
    leaked.set_inheritable(True)
    r, w = os.pipe()
    os.set_inheritable(r, True)
    try:
        out = os.path.join(tmp, "fds.out")
        proc = await spawn_worker([sys.executable, "-c", LIST_FDS], os.environ,
                                  StdioSpec(stdout_path=out, show_stdout=False, show_stderr=False),
                                  local_rank=0, role="t")
        assert await proc.wait() == 0
        await proc.aclose()
        with open(out) as fh:
            return fh.read().split(), [os.readlink(f"/proc/self/fd/{fd}") for fd in (leaked.fileno(), r)]
    finally:
        leaked.close()
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_inherits_none_of_the_agents_descriptors(tmp_path, loop) -> None:
    if loop == "uvloop":
        import uvloop

        fds, ours = uvloop.run(_fds_of_a_worker(str(tmp_path)))
    else:
        fds, ours = asyncio.run(_fds_of_a_worker(str(tmp_path)))
    # what the worker holds: its stdio (libuv leaves copies of it above 2), never the agent's socket or pipe
    assert not set(ours) & set(fds), (fds, ours)
