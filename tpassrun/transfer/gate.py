"""Accepting authenticated connections so that no stranger can stall the one that matters.

A listener that serves one connection at a time, with a timeout per ``recv``, is held by anyone who connects
first and drips a byte now and then. Here, instead:

* every connection's handshake runs concurrently with every other's (:class:`HandshakeGate`: one thread, one
  selector, :mod:`tpassrun.transfer.auth`'s sans-I/O handshake), so a stranger occupies a table entry, never the
  listener, and the first connection that proves the key wins;
* each handshake has one overall deadline, :data:`HANDSHAKE_DEADLINE_S` from its accept (not per byte);
* the handshakes still pending are bounded per source address and in all (:class:`PendingTable`, a pure
  planner shared with the asyncio mirror server): a newcomer is always let in, the oldest pending handshake
  of its source (else the oldest of all) is dropped to make room, so a flood cannot exhaust the listener
  and cannot keep a legitimate peer out for longer than its own retry.

Torch-free: the agent's mirror server uses the table, the workers' state transfer the gate.
"""

from __future__ import annotations

import collections
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Generic, Hashable, Sequence, TypeVar

from tpassrun.transfer.auth import PROOF, AuthError, FrameMac, ListenerHandshake, TransferAuth

HANDSHAKE_DEADLINE_S = 5.0         # from accept to proof: a connection that has not proved the key by then is dropped
MAX_PENDING_PER_SOURCE = 32        # handshakes in progress from one address
MAX_PENDING = 256                  # handshakes in progress in all (file descriptors)
_ACCEPTS_PER_POLL = 8              # fewer than MAX_PENDING_PER_SOURCE: a pending proof is read before a flood evicts it

K = TypeVar("K", bound=Hashable)


@dataclass
class PendingTable(Generic[K]):
    """The handshakes in progress (by key: a socket, a task), each with its source address and start time.
    Pure: it decides which to drop; the caller closes them. Insertion order is age order."""

    deadline_s: float = HANDSHAKE_DEADLINE_S
    per_source: int = MAX_PENDING_PER_SOURCE
    total: int = MAX_PENDING
    _entries: "collections.OrderedDict[K, tuple[str, float]]" = field(default_factory=collections.OrderedDict)
    _by_source: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    def admit(self, key: K, source: str, now: float) -> list[K]:
        """Add ``key`` (just accepted from ``source``); returns the pending handshakes to drop to make room for
        it: the oldest of its source while that source is at its bound, then the oldest of all."""
        evicted: list[K] = []
        if self._by_source.get(source, 0) >= self.per_source:
            oldest = next(k for k, (src, _) in self._entries.items() if src == source)
            evicted.append(oldest)
            self.remove(oldest)
        while len(self._entries) >= self.total:
            oldest = next(iter(self._entries))
            evicted.append(oldest)
            self.remove(oldest)
        self._entries[key] = (source, now)
        self._by_source[source] = self._by_source.get(source, 0) + 1
        return evicted

    def remove(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        left = self._by_source[entry[0]] - 1
        if left:
            self._by_source[entry[0]] = left
        else:
            del self._by_source[entry[0]]

    def expired(self, now: float) -> list[K]:
        """The handshakes past their deadline (removed from the table)."""
        out = []
        for key, (_src, started) in self._entries.items():
            if now - started < self.deadline_s:
                break       # age order: the rest are younger
            out.append(key)
        for key in out:
            self.remove(key)
        return out

    def next_expiry(self) -> float | None:
        """When the oldest pending handshake runs out (None: none pending)."""
        for _src, started in self._entries.values():
            return started + self.deadline_s
        return None

    def keys(self) -> list[K]:
        return list(self._entries)


def source_of(peer: object) -> str:
    """The address part of a peer name (``(host, port[, flow, scope])``), what the per-source bound counts."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


@dataclass
class Proved:
    """A connection that proved the key: a blocking socket, positioned after the handshake, and its MAC."""

    sock: socket.socket
    mac: FrameMac
    peer: str


class _Shake:
    __slots__ = ("sock", "shake", "buf", "peer")

    def __init__(self, sock: socket.socket, shake: ListenerHandshake, peer: str) -> None:
        self.sock, self.shake, self.buf, self.peer = sock, shake, bytearray(), peer


class HandshakeGate:
    """The handshakes of one listening socket, served together in the calling thread: :meth:`poll` until it
    returns the first connection that proved ``auth`` (then the gate is spent: close it, which drops the rest).
    Strangers are dropped as they fail, time out or are evicted; :meth:`take_dropped` says whose and why
    (a connection that left without a byte is not counted: a port probe). ``watch``: sockets whose readiness
    ends a :meth:`poll` early (the worker's agent connection: a command must not wait for a stranger)."""

    def __init__(self, listener: socket.socket, auth: TransferAuth, flags: int = 0, *,
                 deadline_s: float = HANDSHAKE_DEADLINE_S, per_source: int = MAX_PENDING_PER_SOURCE,
                 total: int = MAX_PENDING, watch: Sequence[socket.socket] = ()) -> None:
        self._listener = listener
        self._auth, self._flags = auth, flags
        self._table: PendingTable[socket.socket] = PendingTable(deadline_s, per_source, total)
        self._shakes: dict[socket.socket, _Shake] = {}
        self._dropped: list[tuple[str, str]] = []
        self._sel = selectors.DefaultSelector()
        self._listener_timeout = listener.gettimeout()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, "listener")
        for w in watch:
            self._sel.register(w, selectors.EVENT_READ, "watch")

    def __enter__(self) -> "HandshakeGate":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pending(self) -> int:
        return len(self._table)

    def take_dropped(self) -> list[tuple[str, str]]:
        """(source address, why) of each stranger dropped since the last call."""
        out, self._dropped = self._dropped, []
        return out

    def poll(self, timeout: float) -> Proved | None:
        """Serve every pending handshake and the listener for up to ``timeout`` seconds: the first connection
        that proved the key, or None (the time passed, or a watched socket is readable)."""
        end = time.monotonic() + max(0.0, timeout)
        while True:
            now = time.monotonic()
            for sock in self._table.expired(now):
                self._drop(sock, f"did not prove the key within {self._table.deadline_s:g} s "
                                 f"({len(self._shakes[sock].buf)} of {PROOF.size} bytes)")
            expiry = self._table.next_expiry()
            wait = min(end, expiry) - now if expiry is not None else end - now
            events = self._sel.select(max(0.0, wait))
            accept = watched = False
            for key, _mask in events:
                if key.data == "listener":
                    accept = True
                elif key.data == "watch":
                    watched = True
                else:
                    won = self._read(key.fileobj)   # type: ignore[arg-type]
                    if won is not None:
                        return won
            if accept:      # after the proofs already here: a flood cannot evict one that has arrived
                self._accept()
            if watched or time.monotonic() >= end:
                return None

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_POLL):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:     # EMFILE, a reset before accept: the listener itself is fine
                return
            source = source_of(peer)
            sock.setblocking(False)
            shake = ListenerHandshake(self._auth, self._flags)
            hello = shake.hello()
            try:
                if sock.send(hello) != len(hello):
                    raise BlockingIOError
            except OSError:
                sock.close()
                continue
            for victim in self._table.admit(sock, source, time.monotonic()):
                self._drop(victim, f"evicted: {self._table.per_source} handshakes pending from {source}"
                           if self._shakes[victim].peer == source else "evicted: too many handshakes pending",
                           in_table=False)
            self._shakes[sock] = _Shake(sock, shake, source)
            self._sel.register(sock, selectors.EVENT_READ, "shake")

    def _read(self, sock: socket.socket) -> Proved | None:
        st = self._shakes[sock]
        try:
            chunk = sock.recv(PROOF.size - len(st.buf))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            self._drop(sock, f"connection lost mid-proof ({exc})" if st.buf else None)
            return None
        if not chunk:
            self._drop(sock, f"left mid-proof after {len(st.buf)} of {PROOF.size} bytes" if st.buf else None)
            return None
        st.buf += chunk
        if len(st.buf) < PROOF.size:
            return None
        try:
            answer = st.shake.accept(bytes(st.buf))
            sock.setblocking(True)
            sock.settimeout(self._table.deadline_s)
            sock.sendall(answer)
        except AuthError as exc:
            self._drop(sock, str(exc))
            return None
        except OSError as exc:
            self._drop(sock, f"left before our proof ({exc})")
            return None
        self._forget(sock)
        return Proved(sock, st.shake.frame_mac(), st.peer)

    def _drop(self, sock: socket.socket, why: str | None, in_table: bool = True) -> None:
        st = self._shakes.get(sock)
        if why is not None:
            self._dropped.append((st.peer if st else "?", why))
        self._forget(sock, in_table)
        sock.close()

    def _forget(self, sock: socket.socket, in_table: bool = True) -> None:
        if in_table:
            self._table.remove(sock)
        self._shakes.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass

    def close(self) -> None:
        """Drop every pending handshake (the listener stays open: its owner closes it)."""
        for sock in list(self._shakes):
            self._forget(sock)
            sock.close()
        self._sel.close()
        if self._listener.fileno() >= 0:
            self._listener.settimeout(self._listener_timeout)


__all__ = ["HANDSHAKE_DEADLINE_S", "HandshakeGate", "MAX_PENDING", "MAX_PENDING_PER_SOURCE", "PendingTable", "Proved",
           "source_of"]
