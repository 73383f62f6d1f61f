"""The only module that talks to etcd: JSON get/put/CAS/watch, the lease and its keepalive, reconnects.

aetcd gives us a plain asyncio gRPC client and nothing else: no background keepalive, no reconnect, and a
watch iterator that raises (or silently ends) when etcd goes away. This module adds exactly that:

* ``EtcdConnection`` owns one ``aetcd.Client``. When a call fails with a connection error, one background
  task replaces the client (next endpoint, fresh gRPC channel so we don't sit in gRPC's own reconnect
  backoff) with backoff, for as long as the connection is open: an etcd restart or a partition of any
  length is survived. What waits for it depends on the caller: the lease keepalive and the watches wait
  as long as it takes (they are what makes the job go on afterwards); a request someone is waiting on
  (a join, a restart, a CAS) fails with ``RendezvousConnectionError`` once the outage has lasted
  ``reconnect_timeout``, and works again as soon as etcd is back. Listeners hear each outage and each
  recovery once. Many stores may share one connection (the scale bench simulates 1,024 agents in one
  process).
* ``EtcdStore`` is one agent's view: a lease kept alive every ttl/3, the lease-bound keys it wrote
  (re-written under a fresh lease if the old one expired during an outage), JSON values, and watches
  that resume from the last revision they delivered after a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
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
# etcd forgets its auth tokens when it restarts: the old client's token is refused, a new client logs in again.
_RECONNECT_ERRORS = (*_CONNECTION_ERRORS, aetcd_errors.UnauthenticatedError)
_PROBE_TIMEOUT_S = 5.0        # one reconnect attempt (a partition drops packets: nothing ever answers)
_BACKOFF_MAX_S = 1.0


class Link(str, Enum):
    """What an :class:`EtcdConnection` tells its listeners, once per outage each."""

    LOST = "lost"            # a request failed: reconnecting in the background
    OVERDUE = "overdue"      # the outage has lasted reconnect_timeout: requests now fail until etcd is back
    RESTORED = "restored"    # a new client answers again


# Set in the rendezvous's own long-lived tasks (watches, leadership): their requests wait out an outage of any
# length instead of failing after reconnect_timeout, so they simply carry on once etcd is back. Tasks they
# create inherit it (asyncio copies the context).
_PATIENT: contextvars.ContextVar[bool] = contextvars.ContextVar("tpassrun_etcd_patient", default=False)


def patient_context() -> contextvars.Context:
    """A context for ``asyncio.create_task(..., context=)``: every etcd request the task (and the tasks it
    creates) makes waits out an outage of any length."""
    ctx = contextvars.copy_context()
    ctx.run(_PATIENT.set, True)
    return ctx


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
    """One etcd client plus the reconnect policy. ``epoch`` counts client replacements.

    ``listeners`` are called with ``(Link, detail)``: LOST with the error, OVERDUE with the error once the outage
    has lasted ``reconnect_timeout``, RESTORED with the outage's length in seconds."""

    def __init__(self, config: EtcdConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._client: aetcd.Client | None = None
        self._endpoint_index = 0
        self._epoch = 0
        self._outage_since: float | None = None
        self._last_error: BaseException | None = None
        self._restored = asyncio.Event()   # replaced at the start of every outage
        self._reconnector: asyncio.Task[None] | None = None
        self._closed = False
        self.outages = 0
        self.listeners: list[Callable[[Link, Any], None]] = []

    @property
    def up(self) -> bool:
        return self._client is not None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def failure(self) -> RendezvousConnectionError | None:
        """The error a request gets now: set while an outage has lasted ``reconnect_timeout`` or longer."""
        since = self._outage_since
        if since is None or self._clock() - since < self.config.reconnect_timeout:
            return None
        return RendezvousConnectionError(f"lost etcd at {self.config.display} for more than "
                                         f"{self.config.reconnect_timeout:g} s: {one_line(self._last_error)}")

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
                    f"{one_line(last)}") from last
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

    async def acquire(self, *, forever: bool = False) -> tuple[aetcd.Client, int]:
        """The current client and its epoch; during an outage, wait for the next one (``forever``, or until the
        outage has lasted ``reconnect_timeout``: then RendezvousConnectionError)."""
        while True:
            if self._closed:
                raise RendezvousError("etcd connection closed")
            if self._client is not None:
                return self._client, self._epoch
            if self._outage_since is None:
                raise RendezvousError("etcd connection is not open (use `async with`)")
            await self._wait_restored(forever)

    async def recover(self, epoch: int, exc: BaseException | None, *, forever: bool = False) -> None:
        """Called by whoever saw ``exc`` on the client of ``epoch``: start replacing it (the first to notice does)
        and wait for a working client as :meth:`acquire` does."""
        if self._closed:
            raise RendezvousError("etcd connection closed")
        if epoch == self._epoch and self._client is not None:
            old, self._client = self._client, None
            self._outage_since, self._last_error = self._clock(), exc
            self._restored = asyncio.Event()
            self.outages += 1
            log.info("lost etcd at %s: %s; reconnecting", self.config.display, one_line(exc))
            self._notify(Link.LOST, exc)
            self._reconnector = asyncio.create_task(self._reconnect(old), name="etcd-reconnect")
        await self._wait_restored(forever)

    async def _wait_restored(self, forever: bool) -> None:
        restored, since = self._restored, self._outage_since
        if since is None:
            return
        if forever:
            await restored.wait()
            return
        remaining = since + self.config.reconnect_timeout - self._clock()
        if remaining > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(restored.wait(), remaining)
            raise_if_cancelling()
        if not restored.is_set():
            failure = self.failure
            if failure is not None:
                raise failure

    async def _reconnect(self, old: aetcd.Client) -> None:
        """Replace the client, with backoff, until one answers or the connection is closed."""
        await _close_quietly(old)  # also ends its watches, which then resume on the new client
        delay, overdue = 0.05, False
        while not self._closed:
            self._endpoint_index += 1
            client = self._new_client()
            try:
                await self._probe(client, min(self.config.read_timeout, _PROBE_TIMEOUT_S))
            except (*_CONNECTION_ERRORS, aetcd_errors.ClientError) as exc:
                await _close_quietly(client)
                self._last_error = exc
                if not overdue and self.failure is not None:
                    overdue = True
                    log.info("etcd at %s still unreachable after %g s; still trying", self.config.display,
                             self.config.reconnect_timeout)
                    self._notify(Link.OVERDUE, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            if self._closed:
                await _close_quietly(client)
                return
            lasted = self._clock() - (self._outage_since or self._clock())
            self._client, self._epoch, self._outage_since = client, self._epoch + 1, None
            self._restored.set()
            log.info("etcd at %s is back after %.1f s", self.config.display, lasted)
            self._notify(Link.RESTORED, lasted)
            return

    def _notify(self, link: Link, detail: Any) -> None:
        for listener in list(self.listeners):
            try:
                listener(link, detail)
            except Exception:  # a listener bug must not break reconnects
                log.exception("etcd connection listener failed")

    async def close(self) -> None:
        self._closed = True
        self._restored.set()   # wake every waiter: they see the connection closed
        task, self._reconnector = self._reconnector, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        client, self._client = self._client, None
        if client is not None:
            await _close_quietly(client)


async def _close_quietly(client: aetcd.Client) -> None:
    with contextlib.suppress(Exception):
        await client.close()


def _cancelled_by_reconnect(epoch: int, connection: "EtcdConnection") -> bool:
    """A CancelledError out of an etcd call: the call's client was closed under it by a reconnect (its epoch is
    over), not a cancel of the calling task (which Task.cancelling() counts)."""
    task = asyncio.current_task()
    return (task is None or not task.cancelling()) and (epoch != connection.epoch or not connection.up) \
        and not connection.closed


def one_line(exc: BaseException | None) -> str:
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
        if self._lease is not None and self.connection.up:
            # Revoking deletes our lease-bound keys at once, so peers see us leave without a TTL wait.
            with contextlib.suppress(Exception):
                client, _ = await self.connection.acquire()
                await asyncio.wait_for(client.revoke_lease(self._lease.id), 2.0)
        self._lease = None
        if self._owns_connection:
            await self.connection.close()

    # --- low level -------------------------------------------------------------------------------------

    async def _call(self, op: Callable[[aetcd.Client], Awaitable[T]], *, forever: bool | None = None) -> T:
        """Run ``op`` on the current client, through reconnects. ``forever`` (default: in a task of :func:`patient_context`):
        wait out an outage of any length; otherwise raise RendezvousConnectionError once it has lasted
        reconnect_timeout."""
        if forever is None:
            forever = _PATIENT.get()
        while True:
            client, epoch = await self.connection.acquire(forever=forever)
            self.requests += 1
            try:
                return await op(client)
            except _RECONNECT_ERRORS as exc:
                await self.connection.recover(epoch, exc, forever=forever)
            except aetcd_errors.ClientError as exc:
                raise RendezvousError(f"etcd request failed: {one_line(exc)}") from exc
            except asyncio.CancelledError:
                if not _cancelled_by_reconnect(epoch, self.connection):
                    raise
                # grpc.aio cancels the calls of a channel that is closed: a reconnect (another task's) closed
                # this one's client. Retry on the new client; this request was not what was cancelled. (It
                # used to kill the caller: after a 5 s partition the status and health loops were gone.)

    async def _grant(self) -> None:
        sent = self._clock()
        self._lease = await self._call(lambda c: c.lease(self.lease_ttl), forever=True)
        self.lease_deadline = sent + self.lease_ttl

    async def _keep_alive(self) -> None:
        """Refresh the lease every ttl/3 for as long as the store is open, through outages of any length: when
        etcd comes back after the lease expired, re-grant it and re-write our lease-bound keys."""
        interval = max(0.2, self.lease_ttl / 3)
        said = ""
        while True:
            await asyncio.sleep(interval)
            try:
                sent = self._clock()
                # Bounded by the refresh interval: over a partition nothing answers, and the sooner a request
                # fails the sooner the connection starts reconnecting.
                reply = await self._call(
                    lambda c: asyncio.wait_for(c.refresh_lease(self._lease.id), max(1.0, interval)), forever=True)
                if reply is None or reply.TTL <= 0:
                    self.lease_epoch += 1
                    self._lease_changed.set()
                    self._lease_changed = asyncio.Event()
                    await self._regrant()
                else:
                    self.lease_deadline = max(self.lease_deadline, sent + reply.TTL)
                said = ""
            except RendezvousError as exc:   # etcd refused something (not an outage): say it once, keep trying
                if self.connection.closed:
                    return
                if str(exc) != said:
                    said = str(exc)
                    log.warning("etcd lease refresh failed (retrying every %.1f s): %s", interval, exc)

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

    def lease_sure(self) -> bool:
        """Whether, by our clock, the lease is surely alive now (the margin :meth:`lease_lost` keeps)."""
        return self.lease_ttl <= 0 or self.lease_deadline - min(1.0, self.lease_ttl / 6) > self._clock()

    async def lease_held(self) -> None:
        """Return once the lease is surely alive again by our clock (a refresh or a re-grant was acknowledged
        since it looked lost): what :meth:`lease_lost` waits for next."""
        if self.lease_ttl <= 0:
            return
        margin = min(1.0, self.lease_ttl / 6)
        while self.lease_deadline - margin <= self._clock():
            await asyncio.sleep(min(0.5, self.lease_ttl / 6))

    async def _regrant(self) -> None:
        log.info("etcd lease expired (outage longer than %s s): re-registering", self.lease_ttl)
        await self._grant()
        for key, raw in list(self._leased_keys.items()):
            await self._call(lambda c, k=key, r=raw: c.put(k.encode(), r, lease=self._lease), forever=True)
        for listener in list(self.lease_listeners):
            try:
                listener()
            except Exception:  # a listener bug must not stop the keepalive
                log.exception("etcd lease listener failed")

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

    async def revoke_lease_of(self, key: str) -> bool:
        """Revoke the lease ``key`` is bound to: every key under it vanishes at once, as when it expires, without
        the wait (an agent known to be dead). False if the key is gone or has no lease."""
        k = key.encode()
        res = await self._call(lambda c: c.get_range(k, k + b"\0"))
        lease = next((kv.lease for kv in res if kv.lease), 0)
        if not lease:
            return False
        with contextlib.suppress(RendezvousError):   # already expired: as good
            await self._call(lambda c: c.revoke_lease(lease))
        return True

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
            client, epoch = await self.connection.acquire(forever=True)
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
                await self.connection.recover(epoch, None, forever=True)
            except asyncio.CancelledError:
                if not _cancelled_by_reconnect(epoch, self.connection):
                    raise
                await self.connection.recover(epoch, None, forever=True)   # see _call
            except aetcd_errors.RevisionCompactedError as exc:
                next_rev = exc.compacted_revision
                yield WatchEvent("reset", key, None, exc.compacted_revision)
            except _RECONNECT_ERRORS as exc:
                await self.connection.recover(epoch, exc, forever=True)
            except aetcd_errors.ClientError as exc:
                raise RendezvousError(f"etcd watch on {key} failed: {one_line(exc)}") from exc
            finally:
                if watch is not None:
                    # Bounded: aetcd queues the cancel request on a size-10 queue that nobody drains once
                    # the stream is gone, and a finally block that hangs would hang every shutdown.
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(watch.cancel(), 1.0)
