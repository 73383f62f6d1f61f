"""The worker's watcher: a thread blocked on a second connection to its agent, waiting for a :class:`Break`.

A rank blocked in a collective with a node that is partitioned away gets no connection reset: gloo waits for its
timeout (30 minutes by default), and the rank's main thread cannot read its agent's commands meanwhile. When the
job's coordinator declares that node lost, this rank's agent sends ``Break`` on the watch connection; the watcher
shuts this process's process-group sockets down (:data:`tpassrun.worker.world.GROUP_SOCKETS`, the same teardown a failed
step does), so the collective fails at once, the step is handled as any failed step, and the node-loss recovery
goes on. The thread sleeps in ``recv`` (no GIL held): a healthy rank pays nothing for it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from tpassrun.channel import Break, Field, ProtocolError, Watch, WorkerPhase, decode_command, encode

log = logging.getLogger("tpassrun.worker")


class Watcher:
    """Construct with the agent socket's path, this worker's slot and its channel; :meth:`start` connects
    (once) and starts the daemon thread. ``breaks`` counts the breaks obeyed (tests)."""

    def __init__(self, sock_path: str, slot: int, channel: Any) -> None:
        self.sock_path, self.slot, self.ch = sock_path, slot, channel
        self.breaks = 0
        self._sock: socket.socket | None = None

    def start(self) -> "Watcher":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.sock_path)
            sock.sendall(encode(Watch(pid=os.getpid()), slot=self.slot))
        except OSError as exc:
            sock.close()
            log.warning("no watch connection to the agent (%s): a collective blocked on a lost node will wait for "
                        "its timeout", exc)
            return self
        self._sock = sock
        threading.Thread(target=self._run, name="tpassrun-watch", daemon=True).start()
        return self

    def _run(self) -> None:
        assert self._sock is not None
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(4096)
            except OSError:
                return
            if not chunk:
                return                    # the agent is gone: the main link handles that
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = decode_command(line)
                except ProtocolError as exc:
                    log.warning("watch connection: ignoring %s", exc)
                    continue
                if isinstance(msg, Break):
                    self.obey(msg)

    def obey(self, msg: Break) -> int:
        """Shut the process-group sockets down if this rank is inside a step (a paused or failed one is not
        blocked in anything; its agent re-forms its world anyway). Returns how many sockets were shut."""
        phase = self.ch.get(self.slot, Field.PHASE)
        if phase != WorkerPhase.RUNNING:
            return 0
        from tpassrun.worker.world import GROUP_SOCKETS

        n = GROUP_SOCKETS.shutdown()
        self.breaks += 1
        log.warning("tpassrun: %s; broke out of this rank's collectives (%d sockets shut)",
                    msg.reason or "a node was lost", n)
        return n


__all__ = ["Watcher"]
