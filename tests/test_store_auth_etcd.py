"""The private single-node etcd's raft peer port (issue 27 item 6).

Before, the embedded etcd listened for peers on 127.0.0.1:<port>, where any local user could ask it for
``/members`` and speak raft without authentication (the run's password guards the client port only). Now its
peer URL is a unix socket inside the run's 0700 directory: no TCP port is opened for raft, and another user
cannot even reach the socket's path.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys

import pytest
from faults import run_async

pytestmark = pytest.mark.timeout(120)


def _tcp_listeners(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (from ``ss``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return sorted(int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_the_embedded_etcds_raft_is_on_a_private_unix_socket_and_no_tcp_port():
    from tpassrun.rendezvous import EmbeddedEtcd
    from tpassrun.rendezvous.embedded import PEER_SOCKET

    async def scenario() -> None:
        async with EmbeddedEtcd(auth=True) as etcd:
            assert etcd.pid is not None and etcd.data_dir is not None
            assert _tcp_listeners(etcd.pid) == [etcd.port]          # the client port alone
            path = os.path.join(etcd.data_dir, PEER_SOCKET)
            assert stat.S_ISSOCK(os.stat(path).st_mode)
            assert os.stat(etcd.data_dir).st_mode & 0o777 == 0o700
            with socket.socket(socket.AF_UNIX) as s:                  # the owner reaches it (etcd's own use)
                s.connect(path)
            if os.geteuid() == 0 and shutil.which("setpriv"):
                stranger = subprocess.run(
                    ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                     "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])", path],
                    capture_output=True, text=True, timeout=60)
                assert stranger.returncode != 0 and "PermissionError" in stranger.stderr, stranger.stderr

    run_async(scenario())
