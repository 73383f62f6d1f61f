"""One agent's view of etcd: JSON get/put/CAS/watch, the lease and its keepalive.

``EtcdStore`` runs every request through an :class:`~.etcd_link.EtcdConnection` (which replaces the client
when etcd goes away). It keeps a lease alive, the lease-bound keys it wrote (re-written under a fresh lease if
the old one expired during an outage), JSON values, and watches that resume from the last revision they
delivered after a reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Awaitable, Callable, TypeVar

import aetcd
import aetcd.exceptions as aetcd_errors

from .config import EtcdConfig
from .errors import RendezvousError
from .etcd_link import (
    RECONNECT_ERRORS,
    EtcdConnection,
    Link,
    cancelled_by_reconnect,
    one_line,
    patient_now,
    raise_if_cancelling,
    transport_failed,
)
from .lease import LeaseClock

log = logging.getLogger(__name__)
T = TypeVar("T")


def encode(value: dict[str, Any]) -> bytes:
    # sort_keys: the same value always has the same bytes, which keeps value comparisons meaningful.
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


encode_value = encode   # the door's name for it (tpassrun.rendezvous.encode_value): a value's bytes, as the store writes them


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


class LeaseIs(aetcd.transactions.BaseCompare):  # type: ignore[misc]  # aetcd has no types
    """A transaction's compare on the lease a key is bound to (etcd >= 3.3; aetcd has no such compare)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = aetcd.rpc.Compare.LEASE
        compare.lease = int(self.value)


def _range_end(key: bytes) -> bytes:
    end: bytes = aetcd.utils.prefix_range_end(key)
    return end


@dataclass(frozen=True)
class WatchEvent:
    """``kind`` is "put", "delete", or "reset" (history was compacted: re-read the state)."""

    kind: str
    key: str
    value: dict[str, Any] | None
    mod_revision: int
    create_revision: int = 0
    raw: bytes = field(default=b"", repr=False, compare=False)  # the stored bytes (only with raw=True)



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
        self.requests = 0  # every etcd round-trip this store made (watch creations included, keepalives not)
        self.keepalives = 0  # lease refreshes sent
        self._lease: Any = None
        self._leased_keys: dict[str, bytes] = {}  # re-written under a new lease after an expiry
        self._keepalive: asyncio.Task[None] | None = None
        self.lease_listeners: list[Callable[[], None]] = []  # called after the lease was re-granted
        # Fencing (the rule is rendezvous.lease): by our own clock the lease is surely alive until its deadline,
        # the send time of the last acknowledged grant/refresh + its TTL (etcd counts from when it received it,
        # which is later). Past it, the leader may already have declared us lost and handed our ranks away.
        self.lease_clock = LeaseClock(float(lease_ttl))
        self._lease_changed = asyncio.Event()   # set (and replaced) when a refresh found the lease expired
        self._lease_acked = asyncio.Event()     # set (and replaced) at every acknowledged grant/refresh
        self._refresh_now = asyncio.Event()     # etcd is back: refresh without waiting for the period

    @property
    def lease_epoch(self) -> int:
        """Bumped when the lease was found expired (and then re-granted)."""
        return self.lease_clock.epoch

    @property
    def lease_deadline(self) -> float:
        return self.lease_clock.deadline

    @property
    def lease_id(self) -> int | None:
        return self._lease.id if self._lease is not None else None

    @property
    def leased_keys(self) -> frozenset[str]:
        """The keys this store wrote under its lease and keeps (re-written under a new lease after an expiry)."""
        return frozenset(self._leased_keys)

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
            self.connection.listeners.append(self._on_link)
            self._keepalive = asyncio.create_task(self._keep_alive(), name="etcd-keepalive")

    async def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.connection.listeners.remove(self._on_link)
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

    async def call(self, op: Callable[[aetcd.Client], Awaitable[T]], *, forever: bool | None = None) -> T:
        """A transaction this store has no verb for (a spare pool's claim), run through reconnects as every verb is."""
        return await self._call(op, forever=forever)

    async def _call(self, op: Callable[[aetcd.Client], Awaitable[T]], *, forever: bool | None = None,
                    count: bool = True) -> T:
        """Run ``op`` on the current client, through reconnects. ``forever`` (default: in a task of :func:`patient_context`):
        wait out an outage of any length; otherwise raise RendezvousConnectionError once it has lasted
        reconnect_timeout."""
        if forever is None:
            forever = patient_now()
        while True:
            client, epoch = await self.connection.acquire(forever=forever)
            self.requests += count
            try:
                return await op(client)
            except RECONNECT_ERRORS as exc:
                await self.connection.recover(epoch, exc, forever=forever)
            except aetcd_errors.ClientError as exc:
                if not transport_failed(exc):
                    raise RendezvousError(f"etcd request failed: {one_line(exc)}") from exc
                await self.connection.recover(epoch, exc, forever=forever)
            except asyncio.CancelledError:
                if not cancelled_by_reconnect(epoch, self.connection):
                    raise
                # grpc.aio cancels the calls of a channel that is closed: a reconnect (another task's) closed
                # this one's client. Retry on the new client; this request was not what was cancelled, and its
                # caller (a status or health loop) must outlive the reconnect.

    async def _grant(self, *, confirm: bool = True) -> float:
        """Grant a lease; returns when the answered attempt was sent. ``confirm=False``: the lease is not taken as
        sure yet (a re-grant: our keys must be re-written under it first, see :meth:`_regrant`)."""
        sent = self._clock()

        async def grant(c: aetcd.Client) -> Any:
            nonlocal sent
            sent = self._clock()   # of the attempt etcd answered (a reconnect may retry it)
            return await c.lease(self.lease_ttl)

        self._lease = await self._call(grant, forever=True)
        if confirm:
            self.lease_clock.granted(sent, self.lease_ttl)
            self._acked()
        return sent

    async def _refresh(self) -> tuple[float, float]:
        """One refresh, through reconnects: ``(send time of the attempt etcd answered, the TTL it replied)``. A
        TTL of 0 is etcd saying the lease expired. An attempt unanswered for ``request_timeout`` counts as a
        connection error: the connection is replaced (a partition drops packets, nothing ever fails)."""
        sent = self._clock()
        lease_id, timeout = self._lease.id, self.lease_clock.request_timeout

        async def refresh(c: aetcd.Client) -> Any:
            nonlocal sent
            sent = self._clock()
            self.keepalives += 1
            return await asyncio.wait_for(c.refresh_lease(lease_id), timeout)

        reply = await self._call(refresh, forever=True, count=False)
        return sent, float(reply.TTL) if reply is not None else 0.0

    def _on_link(self, link: Link, _detail: Any) -> None:
        if link is Link.RESTORED:
            self._refresh_now.set()   # read the lease back from etcd at once: the outage ate into its budget

    def _acked(self) -> None:
        self._lease_acked.set()
        self._lease_acked = asyncio.Event()

    async def _keep_alive(self) -> None:
        """Refresh the lease every ``refresh_every`` for as long as the store is open, through outages of any
        length (the connection retries twice a second meanwhile), and at once when etcd is back. When a refresh
        finds the lease expired: re-grant it and re-write our lease-bound keys."""
        lease = self.lease_clock
        last, failed, said = self._clock(), False, ""
        while True:
            delay = lease.next_refresh(self._clock(), last, failed)
            if delay > 0 and not self._refresh_now.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._refresh_now.wait(), delay)
                raise_if_cancelling()
            self._refresh_now.clear()
            last = self._clock()
            try:
                sent, ttl_left = await self._refresh()
                failed, said = False, ""
                if lease.acknowledged(sent, ttl_left):
                    self._acked()
                    continue
                lease.expired()
                self._lease_changed.set()
                self._lease_changed = asyncio.Event()
                await self._regrant()
            except RendezvousError as exc:   # etcd refused something (not an outage): say it once, keep trying
                if self.connection.closed:
                    return
                failed = True
                if str(exc) != said:
                    said = str(exc)
                    log.warning("etcd lease refresh failed (retrying): %s", exc)

    async def lease_lost(self) -> str:
        """Return, with a reason, once our lease may expire (or has expired) since this call: no refresh was
        acknowledged until ``margin`` before its deadline (``rendezvous.lease``), or a refresh found it expired
        (and it is re-granted). Never returns without a lease."""
        if self.lease_ttl <= 0:
            await asyncio.Event().wait()
        lease = self.lease_clock
        epoch = lease.epoch
        while True:
            if lease.epoch != epoch:
                return "etcd lease expired (found on refresh)"
            remaining = lease.fence_at() - self._clock()
            if remaining <= 0:
                return (f"no etcd lease refresh acknowledged in time (lease ttl {self.lease_ttl} s: etcd may expire "
                        f"it within {max(0.0, lease.deadline - self._clock()):.1f} s)")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._lease_changed.wait(), remaining)
            raise_if_cancelling()

    def lease_sure(self) -> bool:
        """Whether, by our clock, the lease is surely alive now (the margin :meth:`lease_lost` keeps)."""
        return self.lease_ttl <= 0 or self.lease_clock.sure(self._clock())

    async def lease_held(self) -> None:
        """Return once the lease is surely alive again by our clock (a refresh or a re-grant was acknowledged
        since it looked lost): what :meth:`lease_lost` waits for next."""
        while not self.lease_sure():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._lease_acked.wait(), 0.5)
            raise_if_cancelling()

    async def _regrant(self) -> None:
        log.info("etcd lease expired (outage longer than %s s): re-registering", self.lease_ttl)
        sent = await self._grant(confirm=False)
        for key, raw in list(self._leased_keys.items()):
            async def put_again(c: aetcd.Client, k: str = key, r: bytes = raw) -> object:
                return await c.put(k.encode(), r, lease=self._lease)
            await self._call(put_again, forever=True)
        self.lease_clock.granted(sent, self.lease_ttl)   # held again once this node is registered again
        self._acked()
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
        revision: int = res.header.revision
        return revision

    async def create_json(self, key: str, value: dict[str, Any], *, lease: bool = False) -> bool:
        """Write only if the key does not exist (txn on version == 0). Not re-written after a lease expiry."""
        if lease:
            self._require_lease()
        ok, _ = await self._txn_put(key, encode(value), 0, lease)
        return ok

    async def cas_json(self, key: str, value: dict[str, Any], expected_mod_revision: int, *,
                       lease: bool = False) -> bool:
        """Write only if the key's mod_revision is still ``expected_mod_revision`` (0: must not exist). ``lease``:
        bound to our lease, as :meth:`create_json` (not re-written after a lease expiry)."""
        if lease:
            self._require_lease()
        ok, _ = await self._txn_put(key, encode(value), expected_mod_revision, lease)
        return ok

    async def cas_json_rev(self, key: str, value: dict[str, Any], expected_mod_revision: int) -> int | None:
        """Like ``cas_json`` but returns the new mod_revision, or None if the compare failed."""
        ok, rev = await self._txn_put(key, encode(value), expected_mod_revision, False)
        return rev if ok else None

    async def put_json_while_leased(self, key: str, value: dict[str, Any], *, guard: str, lease_id: int | None) -> bool:
        """Write ``key`` only while ``guard`` (a key of ours bound to our lease, e.g. our node's registration) is
        still bound to lease ``lease_id`` (what :attr:`lease_id` was when the write was decided). A write that
        waited out an outage in which that lease expired is dropped, not applied late: the others declared this
        node lost meanwhile, and what it says of its ranks is stale. False: dropped. No lease: a plain put."""
        if lease_id is None:
            await self.put_json(key, value)
            return True
        k, g, raw = key.encode(), guard.encode(), encode(value)

        async def op(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(compare=[LeaseIs(g) == lease_id], success=[c.transactions.put(k, raw)],
                                        failure=[])
            return bool(ok)

        return await self._call(op)

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
                     ready: asyncio.Event | None = None) -> AsyncGenerator[WatchEvent, None]:
        """Every change under ``prefix`` from ``start_revision`` on (default: from now), across reconnects.

        ``ready`` is set once etcd has confirmed the watch (the first time only).
        """
        return self._watch(prefix, start_revision, prefix=True, ready=ready)

    def watch_key(self, key: str, start_revision: int | None = None, *, raw: bool = False,
                  ready: asyncio.Event | None = None) -> AsyncGenerator[WatchEvent, None]:
        """Changes of one key. ``raw=True`` hands over the stored bytes undecoded (``WatchEvent.raw``)."""
        return self._watch(key, start_revision, prefix=False, raw=raw, ready=ready)

    async def _watch(self, key: str, start_revision: int | None, *, prefix: bool, raw: bool = False,
                     ready: asyncio.Event | None = None) -> AsyncGenerator[WatchEvent, None]:
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
                if not cancelled_by_reconnect(epoch, self.connection):
                    raise
                await self.connection.recover(epoch, None, forever=True)   # see _call
            except aetcd_errors.RevisionCompactedError as exc:
                next_rev = exc.compacted_revision
                yield WatchEvent("reset", key, None, exc.compacted_revision)
            except RECONNECT_ERRORS as exc:
                await self.connection.recover(epoch, exc, forever=True)
            except aetcd_errors.ClientError as exc:
                if not transport_failed(exc):
                    raise RendezvousError(f"etcd watch on {key} failed: {one_line(exc)}") from exc
                await self.connection.recover(epoch, exc, forever=True)
            finally:
                if watch is not None:
                    # Bounded: aetcd queues the cancel request on a size-10 queue that nobody drains once
                    # the stream is gone, and a finally block that hangs would hang every shutdown.
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(watch.cancel(), 1.0)
