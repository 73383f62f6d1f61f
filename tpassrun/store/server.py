"""The workers' store server: one port on the advertised address, two doors behind it.

* **The authenticated door** (:data:`~tpassrun.store.wire.MAGIC` first, then the run's store key proved): a
  key-value store kept in this process's memory (:class:`KeyValue`, TCPStore's semantics), reachable by no other
  path, so a client without the key can neither read nor write it. tpassrun's workers form every world through
  it (:class:`~tpassrun.store.client.AuthStore`): the first one of ``tpassrun.init()`` and every re-formed one.
* **The plain door** (any other first bytes), for torchrun's contract: a script that calls
  ``init_process_group()`` itself (env://) or ``tcp://MASTER_ADDR:MASTER_PORT`` speaks the C++ TCPStore protocol,
  which cannot prove a key; its connection is relayed to a plain TCPStore listening on loopback only. Its keys
  are a separate store: nothing written there reaches a world tpassrun forms. ``plain=False`` closes it.

The port is bound to the advertised address only (loopback for a single node), never to every interface.
Every connection must say which door it wants, and prove the key, within one overall deadline
(:data:`~tpassrun.transfer.gate.HANDSHAKE_DEADLINE_S`), and the connections still in that state are bounded per
source and in all (:class:`~tpassrun.transfer.gate.PendingTable`): a stranger holds a thread, never the store.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any, Callable

from tpassrun.store import wire
from tpassrun.store.wire import (
    ADD,
    APPEND,
    CHECK,
    COMPARE_SET,
    DELETE,
    ERROR,
    GET,
    MULTI_GET,
    MULTI_SET,
    NUM_KEYS,
    OK,
    PING,
    SET,
    TIMEOUT,
    WAIT,
)
from tpassrun.transfer import HANDSHAKE_DEADLINE_S, AuthError, PendingTable, source_of

log = logging.getLogger("tpassrun.store")

PLAIN_HELLO = 5     # torch's TCPStore validation: a query-type byte and a 32-bit magic
PLAIN_START_S = 120.0   # how long a plain client waits for the plain door's TCPStore (torch's import) to be up


class StoreTimeout(Exception):
    pass


class KeyValue:
    """TCPStore's semantics in memory: ``get`` and ``wait`` block until the keys exist (or the timeout),
    ``add`` counts in decimal text, ``compare_set`` sets only over the expected value (or over nothing when the
    expected value is empty) and returns what the key holds after it."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._changed = threading.Condition()

    def _wait_for(self, keys: list[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k.decode(errors="replace") for k in keys if k not in self._data]
                raise StoreTimeout(f"wait timeout after {int(timeout_s * 1000)}ms, keys: {missing[:4]}")
            self._changed.wait(left)

    def apply(self, op: int, fields: list[bytes], timeout_s: float) -> list[bytes]:
        with self._changed:
            if op == SET:
                self._data[fields[0]] = fields[1]
            elif op == MULTI_SET:
                half = len(fields) // 2
                self._data.update(zip(fields[:half], fields[half:]))
            elif op == APPEND:
                self._data[fields[0]] = self._data.get(fields[0], b"") + fields[1]
            elif op == ADD:
                value = int(self._data.get(fields[0], b"0")) + int(fields[1])
                self._data[fields[0]] = str(value).encode()
                self._changed.notify_all()
                return [str(value).encode()]
            elif op == COMPARE_SET:
                key, expected, desired = fields
                current = self._data.get(key)
                if (current is None and expected == b"") or (current is not None and current == expected):
                    self._data[key] = desired
                    self._changed.notify_all()
                    return [desired]
                return [expected if current is None else current]
            elif op == GET:
                self._wait_for(fields[:1], timeout_s)
                return [self._data[fields[0]]]
            elif op == MULTI_GET:
                self._wait_for(fields, timeout_s)
                return [self._data[k] for k in fields]
            elif op == WAIT:
                self._wait_for(fields, timeout_s)
                return []
            elif op == CHECK:
                return [b"1" if all(k in self._data for k in fields) else b"0"]
            elif op == DELETE:
                return [b"1" if self._data.pop(fields[0], None) is not None else b"0"]
            elif op == NUM_KEYS:
                return [str(len(self._data)).encode()]
            elif op == PING:
                return []
            else:
                raise ValueError(f"unknown store operation {op}")
            self._changed.notify_all()
            return []


class StoreServer:
    """Serves :class:`KeyValue` behind the authenticated door (and a plain TCPStore behind the other) on
    ``host:port`` (0: a free one). ``start`` binds and returns the port; ``close`` stops accepting."""

    def __init__(self, host: str, port: int, key: bytes, *, plain: bool = True,
                 plain_store: Callable[[], tuple[Any, int]] | None = None, plain_on_demand: bool = False) -> None:
        self.key, self.plain = key, plain
        self.kv = KeyValue()
        self._pending: PendingTable[socket.socket] = PendingTable(deadline_s=HANDSHAKE_DEADLINE_S)
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(512)
        self.port: int = self._listener.getsockname()[1]
        # The plain door's TCPStore needs torch, whose import takes 1-3 s of CPU: it is built on a thread of its
        # own (the authenticated door, stdlib only, listens at once), or, ``plain_on_demand``, only when the first
        # plain client arrives. A standby store (one that takes over when the node running the workers' store is
        # lost) is on the re-formed world's critical path, which only uses the authenticated door: it imports no
        # torch until a plain client needs it (and an import on another thread would slow its door by the GIL).
        self._plain_make = plain_store or loopback_tcpstore
        self._plain_store: Any = None
        self._plain_port = 0
        self._plain_opened = False
        self._plain_up = threading.Event()
        if plain and not plain_on_demand:
            self._open_plain()
        self._closed = False

    def _open_plain(self) -> None:
        with self._lock:
            if self._plain_opened:
                return
            self._plain_opened = True
        threading.Thread(target=self._start_plain, name="store-plain", daemon=True).start()

    def _start_plain(self) -> None:
        try:
            self._plain_store, self._plain_port = self._plain_make()
        except Exception as exc:  # noqa: BLE001 - the plain door stays shut; the authenticated one serves on
            log.warning("store: the plain door (torch's TCPStore) could not start: %s", exc)
        finally:
            self._plain_up.set()

    def plain_ready(self, timeout: float | None = None) -> bool:
        """Whether the plain door's TCPStore is up (waiting up to ``timeout``)."""
        return self._plain_up.wait(timeout) and bool(self._plain_port)

    def start(self) -> int:
        threading.Thread(target=self._accept_loop, name="store-accept", daemon=True).start()
        return self.port

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            with self._lock:
                for old in self._pending.admit(sock, source_of(peer), time.monotonic()):
                    _close(old)
            threading.Thread(target=self._serve, args=(sock, peer), name="store-conn", daemon=True).start()

    def _settled(self, sock: socket.socket) -> None:
        with self._lock:
            self._pending.remove(sock)

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        deadline = time.monotonic() + HANDSHAKE_DEADLINE_S
        try:
            first = wire.recv_exact(sock, len(wire.MAGIC), deadline)
            if first == wire.MAGIC:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                channel = wire.server_handshake(sock, self.key, deadline)
                self._settled(sock)
                self._serve_ops(channel)
            elif self.plain:
                # a TCPStore client's first message is its 5-byte validation, which torch's server must get
                # in one read (it closes a connection whose validation arrives split)
                first += wire.recv_exact(sock, PLAIN_HELLO - len(first), deadline)
                self._settled(sock)
                self._relay(sock, first)
            else:
                raise AuthError("a plain TCPStore client, and this store has no plain door")
        except (AuthError, OSError, ConnectionError) as exc:
            log.debug("store: connection from %s dropped: %s", source_of(peer), exc)
        finally:
            self._settled(sock)
            _close(sock)

    def _serve_ops(self, channel: wire.Channel) -> None:
        while not self._closed:
            try:
                body = channel.recv()
            except ConnectionError:
                return
            op, timeout_ms, fields = wire.decode_op(body)
            try:
                answer = wire.encode_answer(OK, self.kv.apply(op, fields, timeout_ms / 1000.0))
            except StoreTimeout as exc:
                answer = wire.encode_answer(TIMEOUT, [str(exc).encode()])
            except (ValueError, IndexError) as exc:
                answer = wire.encode_answer(ERROR, [f"{type(exc).__name__}: {exc}".encode()])
            channel.send(answer)

    def _relay(self, sock: socket.socket, first: bytes) -> None:
        self._open_plain()
        if not self.plain_ready(PLAIN_START_S):
            raise AuthError("the plain door's TCPStore is not up")
        sock.settimeout(None)
        inner = socket.create_connection(("127.0.0.1", self._plain_port))
        inner.sendall(first)
        back = threading.Thread(target=_pump, args=(inner, sock), name="store-relay", daemon=True)
        back.start()
        _pump(sock, inner)
        back.join()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


def loopback_tcpstore() -> tuple[Any, int]:
    """A plain TCPStore listening on 127.0.0.1 only (torch's own server binds every interface unless handed
    a listening socket): the plain door's relay target."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(512)
    port = sock.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=24),
                     master_listen_fd=sock.detach())
    return store, port
