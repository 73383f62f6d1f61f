"""The only module that talks to etcd: JSON get/put/CAS/watch, the lease and its keepalive, reconnects.

aetcd gives us a plain asyncio gRPC client and nothing else: no background keepalive, no reconnect, and a
watch iterator that raises (or silently ends) when etcd goes away. This module adds exactly that:

* ``EtcdConnection`` owns one ``aetcd.Client``. When a call fails with a connection error it replaces the
  client (next endpoint, fresh gRPC channel so we don't sit in gRPC's own reconnect backoff) with
  backoff, and gives up with ``RendezvousConnectionError`` once an outage outlasts ``reconnect_timeout``.
  Many stores may share one connection (the scale bench simulates 1,024 agents in one process).
* ``EtcdStore`` is one agent's view: a lease kept alive every ttl/3, the lease-bound keys it wrote
  (re-written under a fresh lease if the old one expired during an outage), JSON values, and watches
  that resume from the last revision they delivered after a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import aetcd
import aetcd.exceptions as aetcd_errors
from aetcd import rpc

from .config import EtcdConfig
from .errors import RendezvousConnectionError, RendezvousError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors that mean "etcd is not answering", as opposed to "we sent something wrong".
_CONNECTION_ERRORS = (
    aetcd_errors.ConnectionFailedError,
    aetcd_errors.ConnectionTimeoutError,
    aetcd_errors.WatchTimeoutError,
    asyncio.TimeoutError,
)


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that an await swallowed.

    Python 3.11's ``asyncio.wait_for`` returns the inner result, dropping the caller's cancel, when the two
    coincide (aetcd's ``watch()`` uses it); a watch loop that then carried on made a cancelled task run
    forever, and the agent hung in ~1 of 10 launches waiting for it. ``Task.cancelling()`` still counts that
    request, so loops check it after such awaits.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def encode(value: dict[str, Any]) -> bytes:
    # sort_keys: the same value always has the same bytes, which keeps value comparisons meaningful.
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes | None) -> dict[str, Any] | None:
    """A stored JSON object, or None for an absent, empty or foreign (non-JSON-object) value."""
    if not raw:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        # Once per distinct value: readers re-read on every change, and one bad value must not flood the log.
        if raw not in _NON_JSON_SEEN:
            if len(_NON_JSON_SEEN) >= 256:
                _NON_JSON_SEEN.clear()
            _NON_JSON_SEEN.add(raw)
            log.warning("ignoring a non-JSON value in etcd (%d bytes)", len(raw))
        return None
    return doc if isinstance(doc, dict) else None


_NON_JSON_SEEN: set[bytes] = set()


def _range_end(key: bytes) -> bytes:
    return aetcd.utils.prefix_range_end(key)


@dataclass(frozen=True)
class WatchEvent:
    """``kind`` is "put", "delete", or "reset" (history was compacted: re-read the state)."""

    kind: str
    key: str
    value: dict[str, Any] | None
    mod_revision: int
    create_revision: int = 0
    raw: bytes = field(default=b"", repr=False, compare=False)  # the stored bytes (only with raw=True)


class _TlsClient(aetcd.Client):
    """aetcd.Client over a TLS channel (aetcd only builds insecure channels itself)."""

    def __init__(self, *args: Any, credentials: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:  # mirrors aetcd.Client.connect with secure_channel
        if self._connected.is_set():
            return
        self.channel = rpc.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                          options=self._options.items())
        if self._username is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            resp = await self.auth_stub.Authenticate(
                rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
            self.metadata = (("token", resp.token),)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                              metadata=self.metadata)
        self._connected.set()


class EtcdConnection:
    """One etcd client plus the reconnect policy. ``epoch`` counts client replacements."""

    def __init__(self, config: EtcdConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._client: aetcd.Client | None = None
        self._endpoint_index = 0
        self._epoch = 0
        self._lock = asyncio.Lock()  # no loop binding at construction since Python 3.10
        self._outage_since: float | None = None
        self._failure: RendezvousConnectionError | None = None
        self._closed = False
        self.listeners: list[Callable[[bool], None]] = []  # called with False on loss, True on restore

    @property
    def failure(self) -> RendezvousConnectionError | None:
        return self._failure

    def _new_client(self) -> aetcd.Client:
        host, port = self.config.endpoints[self._endpoint_index % len(self.config.endpoints)]
        timeout = self.config.read_timeout
        if not self.config.tls:
            return aetcd.Client(host, port, username=self.config.user, password=self.config.password,
                                timeout=timeout)
        import grpc  # aetcd depends on grpcio; only TLS needs it directly

        def _read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(_read(self.config.cacert), _read(self.config.key),
                                             _read(self.config.cert))
        return _TlsClient(host, port, username=self.config.user, password=self.config.password,
                          timeout=timeout, credentials=creds)

    async def _probe(self, client: aetcd.Client, timeout: float) -> None:
        """One cheap round-trip, because aetcd's connect() does not actually touch the network."""
        await asyncio.wait_for(client.get(b"\0tpassrun-probe"), timeout)

    async def open(self) -> None:
        """Connect, trying every endpoint with backoff, bounded by ``read_timeout``."""
        deadline = self._clock() + self.config.read_timeout
        delay = 0.05
        last: BaseException | None = None
        while True:
            client = self._new_client()
            try:
                await self._probe(client, max(0.1, deadline - self._clock()))
                self._client = client
                return
            except (*_CONNECTION_ERRORS, aetcd_errors.ClientError) as exc:
                last = exc
                await _close_quietly(client)
                if isinstance(exc, aetcd_errors.UnauthenticatedError):
                    raise RendezvousConnectionError(
                        f"etcd at {self.config.display} rejected our credentials: {exc}") from exc
            self._endpoint_index += 1
            if self._clock() + delay >= deadline:
                raise RendezvousConnectionError(
                    f"cannot reach etcd at {self.config.display} within {self.config.read_timeout:g} s: "
                    f"{_one_line(last)}") from last
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def acquire(self) -> tuple[aetcd.Client, int]:
        while True:
            if self._failure is not None:
                raise self._failure
            if self._client is not None:
                return self._client, self._epoch
            if self._closed or not self._lock.locked():
                raise RendezvousError("etcd connection is not open (use `async with`)")
            # A reconnect (``recover``, which holds the lock) is in progress with no client: wait for its
            # outcome. Failing here instead killed the lease keepalive one second into any outage.
            async with self._lock:
                pass

    async def recover(self, epoch: int, exc: BaseException | None) -> None:
        """Called by whoever saw ``exc`` on the client of ``epoch``: make a working client or raise."""
        async with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._closed:
                raise RendezvousError("etcd connection closed")
            if epoch != self._epoch:
                return  # someone else already replaced that client
            now = self._clock()
            if self._outage_since is None:
                self._outage_since = now
                log.warning("lost etcd at %s: %s", self.config.display, _one_line(exc))
                self._notify(False)
            delay = 0.05
            while True:
                old, self._client = self._client, None
                if old is not None:
                    await _close_quietly(old)  # also ends its watches, which then resume on the new client
                self._endpoint_index += 1
                client = self._new_client()
                remaining = self._outage_since + self.config.reconnect_timeout - self._clock()
                try:
                    await self._probe(client, max(0.1, min(self.config.read_timeout, remaining)))
                except (*_CONNECTION_ERRORS, aetcd_errors.ClientError) as probe_exc:
                    await _close_quietly(client)
                    exc = probe_exc
                    if self._clock() + delay >= self._outage_since + self.config.reconnect_timeout:
                        self._failure = RendezvousConnectionError(
                            f"lost etcd at {self.config.display} for more than "
                            f"{self.config.reconnect_timeout:g} s: {_one_line(exc)}")
                        self._notify(False)
                        raise self._failure from exc
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                self._client = client
                self._epoch += 1
                self._outage_since = None
                log.warning("etcd at %s is back", self.config.display)
                self._notify(True)
                return

    def _notify(self, up: bool) -> None:
        for listener in list(self.listeners):
            try:
                listener(up)
            except Exception:  # a listener bug must not break reconnects
                log.exception("etcd connection listener failed")

    async def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)


async def _close_quietly(client: aetcd.Client) -> None:
    with contextlib.suppress(Exception):
        await client.close()


def _one_line(exc: BaseException | None) -> str:
    if exc is None:
        return "connection closed"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class EtcdStore:
    """One agent's JSON key-value view of etcd with a kept-alive lease.

    Args:
        config: where etcd is.
        lease_ttl: seconds; 0 means no lease (tpassctl).
        connection: share another store's connection instead of opening one (not closed by this store).
    """

    def __init__(self, config: EtcdConfig, *, lease_ttl: int = 0, connection: EtcdConnection | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.lease_ttl = lease_ttl
        self._owns_connection = connection is None
        self.connection = connection or EtcdConnection(config, clock=clock)
        self._clock = clock
        self.requests = 0  # every etcd round-trip this store made (watch creations included)
        self._lease: Any = None
        self._leased_keys: dict[str, bytes] = {}  # re-written under a new lease after an expiry
        self._keepalive: asyncio.Task[None] | None = None
        self.lease_listeners: list[Callable[[], None]] = []  # called after the lease was re-granted
        self.failed = asyncio.Event()  # set when the keepalive gave up (connection lost for good)
        # Fencing: by our own clock the lease is surely alive until ``lease_deadline`` (send time of the last
        # acknowledged grant/refresh + ttl; etcd counts from when it received it, which is later). Past it,
        # the leader may already have declared us lost and handed our ranks to someone else.
        self.lease_deadline = float("inf")
        self.lease_epoch = 0  # bumped when the lease was found expired and re-granted
        self._lease_changed = asyncio.Event()

    @property
    def lease_id(self) -> int | None:
        return self._lease.id if self._lease is not None else None

    @property
    def failure(self) -> BaseException | None:
        return self.connection.failure

    async def __aenter__(self) -> "EtcdStore":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self._owns_connection:
            await self.connection.open()
        if self.lease_ttl > 0:
            await self._grant()
            self._keepalive = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._keepalive
            self._keepalive = None
        if self._lease is not None and self.connection.failure is None:
            # Revoking deletes our lease-bound keys at once, so peers see us leave without a TTL wait.
            with contextlib.suppress(Exception):
                client, _ = await self.connection.acquire()
                await asyncio.wait_for(client.revoke_lease(self._lease.id), 2.0)
            self._lease = None
        if self._owns_connection:
            await self.connection.close()

    # --- low level -------------------------------------------------------------------------------------

    async def _call(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        while True:
            client, epoch = await self.connection.acquire()
            self.requests += 1
            try:
                return await op(client)
            except _CONNECTION_ERRORS as exc:
                await self.connection.recover(epoch, exc)
            except aetcd_errors.ClientError as exc:
                raise RendezvousError(f"etcd request failed: {_one_line(exc)}") from exc

    async def _grant(self) -> None:
        sent = self._clock()
        self._lease = await self._call(lambda c: c.lease(self.lease_ttl))
        self.lease_deadline = sent + self.lease_ttl

    async def _keep_alive(self) -> None:
        interval = max(0.2, self.lease_ttl / 3)
        try:
            while True:
                await asyncio.sleep(interval)
                sent = self._clock()
                reply = await self._call(lambda c: c.refresh_lease(self._lease.id))
                if reply is None or reply.TTL <= 0:
                    self.lease_epoch += 1
                    self._lease_changed.set()
                    self._lease_changed = asyncio.Event()
                    await self._regrant()
                else:
                    self.lease_deadline = max(self.lease_deadline, sent + reply.TTL)
        except RendezvousError as exc:
            log.error("etcd lease keepalive stopped: %s", exc)
            self.failed.set()

    async def lease_lost(self) -> str:
        """Return, with a reason, once our lease may expire (or has expired) since this call: its local deadline
        is less than min(1 s, ttl/6) away without a refresh, or a refresh found it expired (and it was
        re-granted). Never returns without a lease."""
        if self.lease_ttl <= 0:
            await asyncio.Event().wait()
        epoch = self.lease_epoch
        while True:
            if self.lease_epoch != epoch:
                return "etcd lease expired (found on refresh)"
            # A margin before the deadline: killing the workers, and this event loop itself, take time, while
            # the others need only a watch event to learn that our lease is gone.
            remaining = self.lease_deadline - min(1.0, self.lease_ttl / 6) - self._clock()
            if remaining <= 0:
                return f"no etcd lease refresh acknowledged in time (lease ttl {self.lease_ttl} s)"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._lease_changed.wait(), remaining)
            raise_if_cancelling()

    async def _regrant(self) -> None:
        log.warning("etcd lease expired (outage longer than %s s): re-registering", self.lease_ttl)
        await self._grant()
        for key, raw in list(self._leased_keys.items()):
            await self._call(lambda c, k=key, r=raw: c.put(k.encode(), r, lease=self._lease))
        for listener in list(self.lease_listeners):
            listener()

    # --- JSON API --------------------------------------------------------------------------------------

    async def get_json(self, key: str) -> tuple[dict[str, Any] | None, int]:
        """``(value, mod_revision)``; ``(None, 0)`` if absent."""
        value, mod_rev, _ = await self.read_json(key)
        return value, mod_rev

    async def read_json(self, key: str) -> tuple[dict[str, Any] | None, int, int]:
        """``(value, mod_revision, header_revision)``: watch from ``header_revision + 1`` to miss nothing."""
        k = key.encode()
        res = await self._call(lambda c: c.get_range(k, k + b"\0"))
        for kv in res:
            return decode(kv.value), kv.mod_revision, res.header.revision
        return None, 0, res.header.revision

    async def get_prefix_json(self, prefix: str) -> list[tuple[str, dict[str, Any], int]]:
        items, _ = await self.read_prefix_json(prefix)
        return [(k, v, mod) for k, v, mod, _create in items]

    async def read_prefix_json(self, prefix: str) -> tuple[list[tuple[str, dict[str, Any], int, int]], int]:
        """``([(key, value, mod_revision, create_revision)], header_revision)``, keys in order."""
        p = prefix.encode()
        res = await self._call(lambda c: c.get_prefix(p))
        items = []
        for kv in res:
            doc = decode(kv.value)
            if doc is not None:
                items.append((kv.key.decode(), doc, kv.mod_revision, kv.create_revision))
        return items, res.header.revision

    async def put_json(self, key: str, value: dict[str, Any], *, lease: bool = False) -> int:
        """Write unconditionally; returns the new revision. ``lease=True`` ties the key to our liveness."""
        raw = encode(value)
        if lease:
            self._require_lease()
            self._leased_keys[key] = raw
        res = await self._call(lambda c: c.put(key.encode(), raw, lease=self._lease if lease else None))
        return res.header.revision

    async def create_json(self, key: str, value: dict[str, Any], *, lease: bool = False) -> bool:
        """Write only if the key does not exist (txn on version == 0). Not re-written after a lease expiry."""
        if lease:
            self._require_lease()
        ok, _ = await self._txn_put(key, encode(value), 0, lease)
        return ok

    async def cas_json(self, key: str, value: dict[str, Any], expected_mod_revision: int) -> bool:
        """Write only if the key's mod_revision is still ``expected_mod_revision`` (0: must not exist)."""
        ok, _ = await self._txn_put(key, encode(value), expected_mod_revision, False)
        return ok

    async def cas_json_rev(self, key: str, value: dict[str, Any], expected_mod_revision: int) -> int | None:
        """Like ``cas_json`` but returns the new mod_revision, or None if the compare failed."""
        ok, rev = await self._txn_put(key, encode(value), expected_mod_revision, False)
        return rev if ok else None

    async def _txn_put(self, key: str, raw: bytes, expected_mod_revision: int, lease: bool) -> tuple[bool, int]:
        k = key.encode()

        async def op(c: aetcd.Client) -> tuple[bool, int]:
            compare = [c.transactions.mod(k) == expected_mod_revision]
            put = c.transactions.put(k, raw, lease=self._lease if lease else None)
            ok, responses = await c.transaction(compare=compare, success=[put], failure=[])
            rev = responses[0].response_put.header.revision if ok and responses else 0
            return ok, rev

        return await self._call(op)

    async def delete(self, key: str) -> None:
        self._leased_keys.pop(key, None)
        await self._call(lambda c: c.delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        for k in [k for k in self._leased_keys if k.startswith(prefix)]:
            del self._leased_keys[k]
        await self._call(lambda c: c.delete_prefix(prefix.encode()))

    def _require_lease(self) -> None:
        if self._lease is None:
            raise RendezvousError("this EtcdStore has no lease (lease_ttl=0)")

    # --- watches ---------------------------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int | None = None, *,
                     ready: asyncio.Event | None = None) -> AsyncIterator[WatchEvent]:
        """Every change under ``prefix`` from ``start_revision`` on (default: from now), across reconnects.

        ``ready`` is set once etcd has confirmed the watch (the first time only).
        """
        return self._watch(prefix, start_revision, prefix=True, ready=ready)

    def watch_key(self, key: str, start_revision: int | None = None, *, raw: bool = False,
                  ready: asyncio.Event | None = None) -> AsyncIterator[WatchEvent]:
        """Changes of one key. ``raw=True`` hands over the stored bytes undecoded (``WatchEvent.raw``)."""
        return self._watch(key, start_revision, prefix=False, raw=raw, ready=ready)

    async def _watch(self, key: str, start_revision: int | None, *, prefix: bool, raw: bool = False,
                     ready: asyncio.Event | None = None) -> AsyncIterator[WatchEvent]:
        k = key.encode()
        next_rev = start_revision
        if next_rev is None:
            _, _, header = await self.read_json(key)
            next_rev = header + 1
        while True:
            client, epoch = await self.connection.acquire()
            self.requests += 1
            watch = None
            try:
                watch = await client.watch(k, range_end=_range_end(k) if prefix else None,
                                           start_revision=next_rev)
                raise_if_cancelling()
                if ready is not None:
                    ready.set()
                async for ev in watch:
                    kv = ev.kv
                    next_rev = kv.mod_revision + 1
                    kind = "put" if ev.kind == "PUT" else "delete"
                    if raw:
                        yield WatchEvent(kind, kv.key.decode(), None, kv.mod_revision, kv.create_revision, kv.value)
                        continue
                    value = decode(kv.value) if kind == "put" else None
                    yield WatchEvent(kind, kv.key.decode(), value, kv.mod_revision, kv.create_revision)
                # The iterator ended without us cancelling it: a reconnect closed this client. Resume.
                raise_if_cancelling()
                await self.connection.recover(epoch, None)
            except aetcd_errors.RevisionCompactedError as exc:
                next_rev = exc.compacted_revision
                yield WatchEvent("reset", key, None, exc.compacted_revision)
            except _CONNECTION_ERRORS as exc:
                await self.connection.recover(epoch, exc)
            except aetcd_errors.ClientError as exc:
                raise RendezvousError(f"etcd watch on {key} failed: {_one_line(exc)}") from exc
            finally:
                if watch is not None:
                    # Bounded: aetcd queues the cancel request on a size-10 queue that nobody drains once
                    # the stream is gone, and a finally block that hangs would hang every shutdown.
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(watch.cancel(), 1.0)
