"""The workers' end of the authenticated store: a ``torch.distributed.Store`` in Python over the store wire.

torch accepts a Python store in ``init_process_group(store=...)`` and wraps it like any other (PrefixStore,
gloo's rendezvous, ``new_group``): every call is one authenticated request and its answer, in order, on one
connection (a lock makes concurrent callers take turns, as the C++ TCPStore client's own mutex does).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tpassrun.store import wire
from tpassrun.store.wire import (
    ADD,
    APPEND,
    CHECK,
    COMPARE_SET,
    DELETE,
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

CONNECT_RETRY_S = 0.05


def _b(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class AuthStore(dist.Store):  # type: ignore[misc]  # torch is not followed (pyproject.toml): dist.Store is Any
    """A client of :class:`~tpassrun.store.server.StoreServer` that proves ``key`` before its first request.
    Connecting retries until ``timeout`` (a store process just started may not listen yet); a server that
    cannot prove the key is never sent a byte of the world's keys."""

    def __init__(self, host: str, port: int, key: bytes, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self.host, self.port, self._key = host, int(port), key
        self._timeout = timeout
        self._lock = threading.Lock()
        self._clones: list[AuthStore] = []
        self._channel = self._connect(time.monotonic() + timeout.total_seconds())

    def __repr__(self) -> str:
        return f"AuthStore({self.host}:{self.port})"

    def _connect(self, deadline: float) -> wire.Channel:
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"the workers' store at {self.host}:{self.port} could not be reached: "
                                          f"{type(last).__name__ if last else 'timeout'}: {last}")
            try:
                sock = socket.create_connection((self.host, self.port), timeout=min(left, 10.0))
            except OSError as exc:
                last = exc
                time.sleep(min(CONNECT_RETRY_S, max(0.0, left)))
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                return wire.client_handshake(sock, self._key, min(deadline, time.monotonic() + 30.0))
            except wire.AuthError as exc:
                sock.close()
                raise dist.DistStoreError(f"the workers' store at {self.host}:{self.port} refused the run's key, "
                                          f"or did not prove it: {exc}") from None
            except OSError as exc:
                sock.close()
                last = exc
                time.sleep(CONNECT_RETRY_S)

    def _call(self, op: int, fields: list[bytes], timeout: timedelta | None = None) -> list[bytes]:
        limit = self._timeout if timeout is None else timeout
        ms = int(limit.total_seconds() * 1000)
        with self._lock:
            try:
                self._channel.send(wire.encode_op(op, fields, ms))
                status, out = wire.decode_answer(self._channel.recv())
            except (OSError, ConnectionError, wire.AuthError) as exc:
                raise dist.DistNetworkError(f"the workers' store at {self.host}:{self.port}: "
                                            f"{type(exc).__name__}: {exc}") from None
        if status == TIMEOUT:
            raise dist.DistStoreError(out[0].decode(errors="replace") if out else "store timeout")
        if status != OK:
            raise dist.DistStoreError(out[0].decode(errors="replace") if out else "store error")
        return out

    # ---------------------------------------------------------------------- torch.distributed.Store
    def set(self, key: str, value: Any) -> None:
        self._call(SET, [_b(key), _b(value)])

    def get(self, key: str) -> bytes:
        return self._call(GET, [_b(key)])[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(ADD, [_b(key), str(int(value)).encode()])[0])

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._call(COMPARE_SET, [_b(key), _b(expected_value), _b(desired_value)])[0]

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [_b(k) for k in keys])[0] == b"1"

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, [_b(key)])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS, [])[0])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call(WAIT, [_b(k) for k in keys], timeout)

    def append(self, key: str, value: Any) -> None:
        self._call(APPEND, [_b(key), _b(value)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call(MULTI_GET, [_b(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._call(MULTI_SET, [_b(k) for k in keys] + [_b(v) for v in values])

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "AuthStore":
        """A second connection to the same store (gloo's background work uses its own). torch holds it through
        its C++ base only, so this store keeps the Python object alive (see tpassrun.worker.world's ``_HELD``)."""
        twin = AuthStore(self.host, self.port, self._key, self._timeout)
        self._clones.append(twin)
        return twin

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def ping(self) -> None:
        self._call(PING, [])

    def close(self) -> None:
        for twin in self._clones:
            twin.close()
        self._channel.close()
