"""A rank blocked in a collective that nothing will ever fail (its peer stopped: no reset, as across a partition)
is broken out at once by its agent's ``Break`` on the watch connection (tpassrun/worker/watch.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tpassrun.channel import ChannelFile, Field, WorkerPhase
from tpassrun.channel.protocol import Break, Watch, decode_reply, encode

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import torch, torch.distributed as dist
    from datetime import timedelta
    from tpassrun.channel import ChannelFile, Field, WorkerPhase
    from tpassrun.worker.world import init_world
    from tpassrun.worker.watch import Watcher
    rank = int(sys.argv[1])
    store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), 2, rank == 0, timeout=timedelta(seconds=60))
    init_world("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=600))
    dist.all_reduce(torch.ones(4))                      # the world works
    if rank == 1:
        print("ready", flush=True)
        os.kill(os.getpid(), {sigstop})                 # a peer that never answers again, never resets
    ch = ChannelFile.open(sys.argv[3])
    Watcher(sys.argv[4], 0, ch).start()
    ch.set(0, Field.PHASE, WorkerPhase.RUNNING)
    print("ready", flush=True)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1 << 16))            # blocks on the stopped peer: gloo's timeout is 10 min
        print("completed?!", flush=True)
    except Exception as exc:
        print(f"failed after {{time.monotonic() - t0:.2f}} s: {{type(exc).__name__}}", flush=True)
    from tpassrun.worker.world import abort_process_groups
    abort_process_groups()          # what a failed step does next (worker_commands._after_failure)
    os._exit(0)                     # (the stopped peer's sockets are never closed: skip gloo's teardown)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_a_break_fails_a_collective_blocked_on_a_silent_peer(tmp_path):
    ch = ChannelFile.create(str(tmp_path / "chan"), 1)
    path = str(tmp_path / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    port = _free_port()
    code = RANK.format(repo=REPO, sigstop=int(signal.SIGSTOP))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port), ch.path, path], stdout=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        listener.settimeout(30)
        conn, _ = listener.accept()
        line = conn.makefile("rb").readline()
        msg, slot = decode_reply(line)
        assert isinstance(msg, Watch) and slot == 0 and msg.pid == procs[0].pid
        time.sleep(1.0)                                   # rank 0 is blocked in the all-reduce by now
        assert procs[0].poll() is None
        conn.sendall(encode(Break(reason="node n2 was declared lost")))
        out = procs[0].stdout.readline()
        assert out.startswith("failed after"), out
        assert float(out.split()[2]) < 30, out          # at once, not at gloo's timeout
        assert procs[0].wait(30) == 0
        conn.close()
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
        listener.close()
        ch.close()


def test_a_break_leaves_a_rank_alone_that_is_not_inside_a_step(tmp_path, monkeypatch):
    from tpassrun.worker import world
    from tpassrun.worker.watch import Watcher

    ch = ChannelFile.create(str(tmp_path / "chan"), 2)
    calls: list[int] = []
    monkeypatch.setattr(world.GROUP_SOCKETS, "shutdown", lambda: calls.append(1) or 3)
    w = Watcher("", 1, ch)
    for phase in (WorkerPhase.PAUSED, WorkerPhase.FAILED, WorkerPhase.SPARE):
        ch.set(1, Field.PHASE, phase)
        assert w.obey(Break()) == 0
    ch.set(1, Field.PHASE, WorkerPhase.RUNNING)
    assert w.obey(Break()) == 3 and calls == [1] and w.breaks == 1
    ch.close()
