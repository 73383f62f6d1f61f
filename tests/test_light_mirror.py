"""A worker pushes its light snapshots into its buddy's mirror itself (tpassrun/worker/light_mirror.py, PushStream):
one-way, never blocking, delivered even when the pushing process is SIGKILLed right after the push returned."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from test_mirror import KEY, _frame, _Served

from tpassrun import mirror as M
from tpassrun.channel import ChannelFile, Field
from tpassrun.mirror import client as N
from tpassrun.transfer.auth import AuthError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served():
    s = _Served()
    yield s
    s.close()


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_push_stream_is_one_way_and_lands_in_the_store(served):
    stream = N.PushStream("127.0.0.1", served.server.port, KEY, run_id="run-1").connect()
    try:
        for step in range(5):
            assert stream.push(3, "light", step, 4, _frame(bytes([65 + step]))) is None
        _wait(lambda: served.store.versions(3, "light") == (3, 4))
        assert served.store.get(3, "light").data == _frame(b"E") and served.store.get(3, "light").epoch == 4
        # nothing ever comes back on the socket: a writer killed with unread data would be reset instead
        assert stream._sock is not None
        with pytest.raises(BlockingIOError):
            stream._sock.recv(1)
        assert served.call(lambda: served.server.pushes_refused) == 0
        assert stream.push(3, "light", 1, 4, _frame(b"z")) is None      # older than both held: dropped, counted
        _wait(lambda: served.call(lambda: served.server.pushes_refused) == 1)
        assert served.store.versions(3, "light") == (3, 4)
    finally:
        stream.close()


def test_a_push_stream_with_another_key_is_refused(served):
    with pytest.raises(AuthError):
        N.PushStream("127.0.0.1", served.server.port, b"x" * 32, run_id="run-1").connect()
    assert served.store.usage() == []


def test_a_tampered_push_is_not_kept_and_ends_the_connection(served):
    stream = N.PushStream("127.0.0.1", served.server.port, KEY, run_id="run-1").connect()
    try:
        head_meta, payload, tag = stream.frame(1, "light", 9, 0, _frame(b"q"))
        payload = payload[:20] + bytes([payload[20] ^ 1]) + payload[21:]
        stream._sock.sendall(head_meta + payload + tag)
        _wait(lambda: stream._sock.recv(1, socket.MSG_DONTWAIT) == b"" if _readable(stream._sock) else False)
        assert served.store.get(1, "light") is None
    finally:
        stream.close()


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def test_a_frame_pushed_right_before_a_sigkill_is_delivered(served):
    """The point of pushing from the worker: once push() returned, the process may die at once."""
    code = textwrap.dedent(f"""
        import os, signal, sys, zlib
        sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
        from tpassrun.mirror.client import PushStream
        s = PushStream("127.0.0.1", {served.server.port}, {KEY!r}, run_id="run-1").connect()
        body = b"TPL1" + os.urandom(12000)
        frame = body + b"TPLE" + zlib.crc32(body).to_bytes(4, "little")
        for step in range(40):
            assert s.push(7, "light", step, 2, frame) is None
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -signal.SIGKILL
    _wait(lambda: served.store.versions(7, "light") == (38, 39))
    assert len(served.store.get(7, "light").data) == 12012


class _Link:
    """The worker's AgentLink reduced to its channel slot and the nudge."""

    def __init__(self, ch: ChannelFile, slot: int) -> None:
        self.ch, self.slot, self.nudges = ch, slot, 0

    def set(self, field: Field, value: int) -> None:
        self.ch.set(self.slot, field, value)

    def nudge(self) -> None:
        self.nudges += 1


def test_the_worker_side_pushes_when_up_and_says_so_in_its_slot(tmp_path, served):
    from tpassrun.worker.light_mirror import LightMirror

    ch = ChannelFile.create(str(tmp_path / "chan"), 2)
    link = _Link(ch, 1)
    retries: list[int] = []
    lm = LightMirror(5, link, on_retry=lambda: retries.append(1))
    target = M.MirrorTarget("b", "127.0.0.1", served.server.port, KEY, "run-1", 3)
    try:
        assert not lm.push(0, _frame(b"a"))                  # not connected yet: the caller nudges the agent
        lm.retarget(target, 5)
        assert lm.wait_up(10) and ch.get(1, Field.LIGHT_MIRRORED) == 1
        assert lm.push(1, _frame(b"b")) and lm.push(2, _frame(b"c"))
        _wait(lambda: served.store.versions(5, "light") == (1, 2))
        assert served.store.get(5, "light").epoch == 3
        lm.retarget(target, 5)                               # the same target: the connection is kept
        assert lm.up
        # the buddy goes away: the next push fails, the slot says the agent must copy, a retry is asked for
        served.call(lambda: [t.cancel() for t in list(served.server._conns)])
        _wait(lambda: not lm.push(3, _frame(b"d")))
        assert ch.get(1, Field.LIGHT_MIRRORED) == 0
        _wait(lambda: retries, timeout=5)
        lm.retarget(target, 5)                               # asked again: reconnects
        assert lm.wait_up(10) and lm.push(4, _frame(b"e"))
        _wait(lambda: served.store.versions(5, "light") == (2, 4))
    finally:
        lm.close()
        assert ch.get(1, Field.LIGHT_MIRRORED) == 0
        ch.close()


def test_the_agent_leaves_a_slot_alone_while_its_worker_pushes_itself(tmp_path):
    from types import SimpleNamespace

    from tpassrun.swapper.mirrorplane import MirrorPlane

    served = _Served()
    ch = ChannelFile.create(str(tmp_path / "chan"), 2)
    slots = [SimpleNamespace(index=i, rank=i, state="running", managed=True) for i in range(2)]
    port = SimpleNamespace(node_id="a", addr="127.0.0.1", spawned_generation=lambda: 1, epoch=lambda: 1,
                           slots=SimpleNamespace(channel=ch, slots=slots),
                           events=SimpleNamespace(write=lambda e, **f: None))
    plane = MirrorPlane(port, "run-1")       # type: ignore[arg-type]
    plane.key = KEY
    plane.buddy = M.MirrorTarget("b", "127.0.0.1", served.server.port, KEY, "run-1", 1)

    async def tick() -> None:
        batch = plane._changed_frames()
        if batch:
            await plane._push(batch)

    try:
        ch.set(0, Field.LIGHT_MIRRORED, 1)
        ch.write_light(0, _frame(b"a"), 10)
        ch.write_light(1, _frame(b"b"), 10)
        asyncio.run(tick())
        assert plane.pushes == 1 and served.store.versions(0, "light") == ()   # slot 0 pushes itself
        ch.set(0, Field.LIGHT_MIRRORED, 0)                                     # its stream went down
        asyncio.run(tick())
        assert plane.pushes == 2 and served.store.versions(0, "light") == (10,)
    finally:
        plane._close_client()
        ch.close()
        served.close()
