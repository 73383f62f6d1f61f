"""The worker's end of the agent channel: its shared-memory slot and the unix socket (JSON lines)."""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Any

from .channel import ChannelFile, Field, decode_msg, encode_msg


class AgentLink:
    """The worker's end of the channel: the shared-memory slot and the unix socket."""

    def __init__(self, channel_path: str, slot: int, sock_path: str) -> None:
        self.slot = slot
        self.ch = ChannelFile.open(channel_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock_path)
        self._buf = bytearray()  # our own line buffer, so that waiting() can tell what is already here
        self._held: list[dict[str, Any]] = []   # commands read while waiting for an answer (request())

    def send(self, kind: str, **fields: Any) -> None:
        self.sock.sendall(encode_msg(kind, slot=self.slot, **fields))

    def request(self, kind: str, timeout: float = 10.0) -> dict[str, Any] | None:
        """Ask the agent something and wait for its answer (a message of the same kind); a command that
        arrives meanwhile is kept for :meth:`recv`. None if no answer came within ``timeout``."""
        self.send(kind)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable(remaining):
                return None
            msg = self._read_one()
            if msg["kind"] == kind:
                return msg
            self._held.append(msg)

    def _readable(self, timeout: float) -> bool:
        if b"\n" in self._buf:
            return True
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(readable)

    def recv(self) -> dict[str, Any]:
        if self._held:
            return self._held.pop(0)
        return self._read_one()

    def _read_one(self) -> dict[str, Any]:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end + 1])
                del self._buf[:end + 1]
                return decode_msg(line)
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                # The agent is gone: a worker must never outlive it (PDEATHSIG normally gets here first).
                os._exit(1)
            self._buf += chunk

    def waiting(self, timeout: float = 0.0) -> bool:
        """True once a message (or the agent's end of the socket) is there to be read by :meth:`recv`."""
        if self._held or b"\n" in self._buf:
            return True
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(readable)

    def set(self, field: Field, value: int) -> None:
        self.ch.set(self.slot, field, value)

    def get(self, field: Field) -> int:
        return self.ch.get(self.slot, field)
