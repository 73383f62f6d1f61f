"""tpassctl says it is waiting for etcd from the first second (issue 28, item 6): an unreachable etcd gave seconds
of silence before the error."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys

from tpassrun.ops.ctl_wait import EVERY_OFF_TTY_S, EtcdWait, due


def test_said_from_the_first_second_every_second_on_a_terminal_every_few_off_it():
    assert not due(0.9, None, True) and due(1.0, None, True) and due(1.0, None, False)
    assert due(2.0, 1.0, True) and not due(1.9, 1.0, True)
    assert not due(1.0 + EVERY_OFF_TTY_S - 0.1, 1.0, False) and due(1.0 + EVERY_OFF_TTY_S, 1.0, False)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_rewritten_then_wiped_once_etcd_answers():
    now = [0.0]
    out = _Tty()

    async def scenario() -> None:
        async with EtcdWait("e:2379", stream=out, clock=lambda: now[0], tick=0.001) as w:
            for t in (0.5, 1.2, 2.3, 3.4):
                now[0] = t
                await asyncio.sleep(0.01)
            w.reached()

    asyncio.run(scenario())
    text = out.getvalue()
    assert "\n" not in text and text.endswith("\r\033[K"), repr(text)
    assert [p for p in text.split("\r\033[K") if p] == [f"tpassctl: waiting for etcd at e:2379 ({n} s)" for n in (1, 2, 3)]


def test_an_unreachable_etcd_is_waited_for_aloud_then_the_error():
    with socket.socket() as s:           # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "tpassrun.ops.ctl", "status", "--rdzv-endpoint", f"127.0.0.1:{port}",
                           "--rdzv-id", "nowhere", "--rdzv-conf", "read_timeout=3"],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "COLUMNS"})   # off a terminal: whole lines
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines[0] == f"tpassctl: waiting for etcd at 127.0.0.1:{port} (1 s)", lines
    assert all(ln.startswith("tpassctl: waiting for etcd") for ln in lines[:-1]) and len(lines) <= 3, lines
    assert lines[-1].startswith(f"tpassctl: error: cannot reach etcd at 127.0.0.1:{port} within 3 s"), lines
