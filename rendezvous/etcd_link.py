"""The etcd connection: one ``aetcd.Client`` and the policy that replaces it when etcd goes away.

aetcd gives us a plain asyncio gRPC client and nothing else: no reconnect, and calls that hang or fail when etcd
is unreachable. ``EtcdConnection`` owns one client. When a call fails with a connection error, one background
task replaces the client (next endpoint, fresh gRPC channel so we don't sit in gRPC's own reconnect backoff)
for as long as the connection is open: an etcd restart or a partition of any length is survived. What waits
for it depends on the caller: the lease keepalive and the watches (:mod:`.etcd_io`) wait as long as it takes
(they are what makes the job go on afterwards); a request someone is waiting on (a join, a restart, a CAS)
fails with ``RendezvousConnectionError`` once the outage has lasted ``reconnect_timeout``, and works again as
soon as etcd is back. Listeners hear each outage and each recovery once. Many stores may share one connection
(the scale bench simulates 1,024 agents in one process).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from enum import Enum
from typing import Any, Callable

import aetcd
import aetcd.exceptions as aetcd_errors
from aetcd import rpc

from .config import EtcdConfig
from .errors import RendezvousConnectionError, RendezvousError

log = logging.getLogger(__name__)

# Errors that mean "etcd is not answering", as opposed to "we sent something wrong".
CONNECTION_ERRORS = (
    aetcd_errors.ConnectionFailedError,
    aetcd_errors.ConnectionTimeoutError,
    aetcd_errors.WatchTimeoutError,
    asyncio.TimeoutError,
)
# etcd forgets its auth tokens when it restarts: the old client's token is refused, a new client logs in again.
RECONNECT_ERRORS = (*CONNECTION_ERRORS, aetcd_errors.UnauthenticatedError)


def transport_failed(exc: BaseException) -> bool:
    """gRPC's own transport broke under a call (status INTERNAL, "Internal error from Core": a request sent on a
    stream that the connection's loss had just closed, e.g. a watch created as etcd went away), as opposed to an
    INTERNAL status etcd answered with. It is an outage: reconnect, as for :data:`RECONNECT_ERRORS`."""
    return isinstance(exc, aetcd_errors.InternalError) and "from Core" in str(exc)
_PROBE_TIMEOUT_S = 5.0   # one reconnect probe's patience (a loaded etcd, TLS and a login take a while)
# While probes go unanswered (a partition drops packets: nothing fails, each TCP SYN is retried after 1, 3, 7 s)
# a new one starts this often, so a healed link is found within about this long, not at the next retry of the
# one probe in flight: the lease's budget (rendezvous.lease) is what an outage may cost, not a bit more.
_PROBE_EVERY_S = 0.5
_PROBES_IN_FLIGHT = 8
_BACKOFF_MAX_S = 0.5     # between probes that failed at once (etcd down: connection refused)
# Every client gets a gRPC subchannel of its own, so a fresh probe makes a fresh connect. By default gRPC shares one
# per target across channels, with its connection attempt and backoff: every probe would wait on the one connect
# that began in the partition, whose SYN retransmits 1, 3, 7, 15 s apart, and find a healed link seconds late.
_CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


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


def patient_now() -> bool:
    """Whether the running task asked (through :func:`patient_context`) to wait out outages of any length."""
    return _PATIENT.get()


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that an await swallowed.

    Python 3.11's ``asyncio.wait_for`` returns the inner result, dropping the caller's cancel, when the two
    coincide (aetcd's ``watch()`` uses it); a watch loop that then carried on would make a cancelled task run
    forever (and the agent wait for it on exit). ``Task.cancelling()`` still counts that request, so loops check
    it after such awaits.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class _TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd has no types: its Client is Any here
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
        host = f"[{host}]" if ":" in host else host   # aetcd's gRPC target is f"{host}:{port}"
        timeout = self.config.read_timeout
        if not self.config.tls:
            return aetcd.Client(host, port, username=self.config.user, password=self.config.password,
                                timeout=timeout, options=dict(_CHANNEL_OPTIONS))
        import grpc  # aetcd depends on grpcio; only TLS needs it directly

        def _read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        creds = grpc.ssl_channel_credentials(_read(self.config.cacert), _read(self.config.key),
                                             _read(self.config.cert))
        return _TlsClient(host, port, username=self.config.user, password=self.config.password,
                          timeout=timeout, credentials=creds, options=dict(_CHANNEL_OPTIONS))

    async def _probe(self, client: aetcd.Client, timeout: float) -> None:
        """One cheap round-trip, because aetcd's connect() does not actually touch the network."""
        await asyncio.wait_for(client.get(b"\0tpassrun-probe"), timeout)

    async def open(self) -> None:
        """Connect, trying every endpoint with backoff, bounded by ``read_timeout``. With several members, one
        attempt waits at most ``_PROBE_TIMEOUT_S``: a member that hangs (stopped, cut off) must not eat the
        whole budget while the others answer."""
        deadline = self._clock() + self.config.read_timeout
        delay = 0.05
        last: BaseException | None = None
        while True:
            client = self._new_client()
            remaining = max(0.1, deadline - self._clock())
            try:
                await self._probe(client, remaining if len(self.config.endpoints) == 1 else
                                  min(remaining, _PROBE_TIMEOUT_S))
                self._client = client
                return
            except (*CONNECTION_ERRORS, aetcd_errors.ClientError) as exc:
                last = exc
                await close_quietly(client)
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
        """Replace the client until one answers or the connection is closed: a probe on a fresh client, and
        another every ``_PROBE_EVERY_S`` while none has answered (the first to answer wins); probes that fail at
        once (etcd down) are retried with a short backoff."""
        await close_quietly(old)  # also ends its watches, which then resume on the new client
        delay, overdue = 0.05, False
        timeout = min(self.config.read_timeout, _PROBE_TIMEOUT_S)
        probes: dict[asyncio.Task[None], aetcd.Client] = {}
        try:
            while not self._closed:
                if len(probes) < _PROBES_IN_FLIGHT:
                    self._endpoint_index += 1
                    client = self._new_client()
                    probes[asyncio.create_task(self._probe(client, timeout), name="etcd-probe")] = client
                done, _ = await asyncio.wait(probes, timeout=_PROBE_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
                winner: aetcd.Client | None = None
                for task in done:
                    client = probes.pop(task)
                    exc = task.exception()
                    if exc is None and winner is None and not self._closed:
                        winner = client
                        continue
                    await close_quietly(client)
                    if exc is not None:
                        self._last_error = exc
                if winner is not None:
                    self._install(winner)
                    return
                if not overdue and self.failure is not None:
                    overdue = True
                    log.info("etcd at %s still unreachable after %g s; still trying", self.config.display,
                             self.config.reconnect_timeout)
                    self._notify(Link.OVERDUE, self._last_error)
                if done:   # refused at once: etcd is down, not cut off; don't spin
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _BACKOFF_MAX_S)
        finally:
            for task in probes:
                task.cancel()
            for task, client in probes.items():
                with contextlib.suppress(BaseException):
                    await task
                await close_quietly(client)

    def _install(self, client: aetcd.Client) -> None:
        lasted = self._clock() - (self._outage_since or self._clock())
        self._client, self._epoch, self._outage_since = client, self._epoch + 1, None
        self._restored.set()
        log.info("etcd at %s is back after %.1f s", self.config.display, lasted)
        self._notify(Link.RESTORED, lasted)

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
            await close_quietly(client)


async def close_quietly(client: aetcd.Client) -> None:
    with contextlib.suppress(Exception):
        await client.close()


def cancelled_by_reconnect(epoch: int, connection: "EtcdConnection") -> bool:
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

