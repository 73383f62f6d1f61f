"""The worker's end of the agent channel: its shared-memory slot and the unix socket (protocol messages, one
JSON line each; encoded and decoded by :mod:`tpassrun.channel.protocol` only)."""

from __future__ import annotations

import logging
import os
import select
import socket
import time

from tpassrun.channel import ChannelFile, Field, Message, ProtocolError, decode_command, encode

log = logging.getLogger("tpassrun.worker")


class AgentLink:
    """The worker's end of the channel: the shared-memory slot and the unix socket."""

    def __init__(self, channel_path: str, slot: int, sock_path: str) -> None:
        self.slot = slot
        self.ch = ChannelFile.open(channel_path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sock_path)
        self._buf = bytearray()  # our own line buffer, so that waiting() can tell what is already here
        self._held: list[Message] = []   # commands read while waiting for an answer (request())

    def send(self, msg: Message) -> None:
        self.sock.sendall(encode(msg, slot=self.slot))

    def nudge(self) -> None:
        """Tell the agent, without waiting for anything, that a light snapshot was just written: one byte on the
        local socket, so the agent copies it to its buddy's mirror now rather than at its next look. Dropped
        when the socket is full (the agent looks every few milliseconds anyway). Only while the agent has a buddy
        to copy to (it says so in shared memory): a job of one node pays no syscall for it."""
        if not self.ch.get(self.slot, Field.WANT_NUDGE):
            return
        try:
            self.sock.send(b"\n", socket.MSG_DONTWAIT)
        except OSError:
            pass

    def request(self, msg: Message, answer: type[Message], timeout: float = 10.0) -> Message | None:
        """Ask the agent something and wait for its ``answer``; a command that arrives meanwhile is kept for
        :meth:`recv`. None if no answer came within ``timeout``."""
        self.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._readable(remaining):
                return None
            got = self._read_one()
            if isinstance(got, answer):
                return got
            self._held.append(got)

    def poll(self, answer: type[Message], timeout: float = 0.0) -> Message | None:
        """An ``answer`` already sent (or arriving within ``timeout``), without blocking past that: for a
        question asked with :meth:`send` whose answer is picked up at a later step start. Commands read meanwhile
        are kept for :meth:`recv`."""
        deadline = time.monotonic() + timeout
        while self._readable(max(0.0, deadline - time.monotonic())):
            got = self._read_one()
            if isinstance(got, answer):
                return got
            self._held.append(got)
            if time.monotonic() >= deadline:
                break
        return None

    def _readable(self, timeout: float) -> bool:
        if b"\n" in self._buf:
            return True
        readable, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(readable)

    def recv(self) -> Message:
        """The next command from the agent (blocks)."""
        if self._held:
            return self._held.pop(0)
        return self._read_one()

    def _read_one(self) -> Message:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end + 1])
                del self._buf[:end + 1]
                try:
                    return decode_command(line)
                except ProtocolError as exc:
                    log.warning("ignoring a line from the agent that is no command: %s", exc)
                    continue
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
