"""``EtcdRendezvous``: one agent's side of the rendezvous (the effects around ``machine.decide``).

Who watches what (so that a join costs a constant number of etcd requests whatever the run's size):

* every agent registers ``nodes/<node_id>`` under its lease, watches the single keys ``generation`` and
  ``leader``, and campaigns for ``leader`` (a txn create under its lease) when that key is vacant;
* only the leader watches ``nodes/``: it feeds registrations into ``decide`` and writes the outcome to
  ``generation`` by compare-and-set on its mod_revision. A lease expiry deletes the dead node's
  registration; the leader writes it into the generation's ``lost`` list, which every agent sees as a
  ``node_lost`` event. If the leader dies, its ``leader`` key goes with its lease and another agent
  takes over from a fresh read of ``nodes/``.

Nothing polls: every wait is on a watch (or on the last-call deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable

from .config import EtcdConfig, RendezvousSettings
from .errors import RendezvousClosedError, RendezvousError, RendezvousTimeoutError
from .etcd_io import EtcdStore, WatchEvent, decode
from .etcd_link import EtcdConnection, Link, one_line, patient_context, raise_if_cancelling
from .machine import Action, NodeEntry, RdzvView, closed_generation, decide, events_between, restart_generation
from .state import EventKind, GenState, Generation, NodeInfo, RdzvEvent

log = logging.getLogger(__name__)

_CAS_ATTEMPTS = 16  # a generation record rewritten more often than this during one call is a bug, not load


class EtcdRendezvous:
    """The per-node rendezvous handle. The constructor does no I/O; ``async with`` connects.

    Args:
        etcd: where etcd is.
        settings: the run's rendezvous settings.
        node: this agent's registration.
        clock: monotonic seconds (injected so tests can drive time).
        connection: share an ``EtcdConnection`` with other handles (the scale bench does; agents don't).
    """

    def __init__(self, etcd: EtcdConfig, settings: RendezvousSettings, node: NodeInfo, *,
                 clock: Callable[[], float] = time.monotonic, connection: EtcdConnection | None = None) -> None:
        self.settings = settings
        self.node = node
        self._clock = clock
        self._store = EtcdStore(etcd, lease_ttl=settings.lease_seconds, connection=connection, clock=clock)
        self._gen: Generation | None = None
        self._stored_rev = 0       # mod revision of whatever the generation key holds (a malformed value too)
        self._bad_rev = 0          # the malformed generation value last logged
        self._changed = asyncio.Event()  # replaced after every set: waiters grab the current one
        self._leader: str | None = None
        self._leader_vacant = asyncio.Event()
        self._leadership_lost = asyncio.Event()
        self._is_leader = False
        self._registered = False
        self._last_joined: Generation | None = None
        self._subscribers: list[asyncio.Queue[RdzvEvent | None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._fatal: BaseException | None = None
        self._last_reason = ""

    # --- small public surface --------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    @property
    def leader(self) -> str | None:
        """Node id of the current leader as last seen (None while vacant)."""
        return self._leader

    @property
    def store(self) -> EtcdStore:
        return self._store

    @property
    def generation(self) -> Generation | None:
        """The latest generation record this agent has seen (no I/O)."""
        return self._gen

    def key(self, *parts: str) -> str:
        return self.settings.run_prefix + "/".join(parts)

    # --- lifecycle -------------------------------------------------------------------------------------

    async def __aenter__(self) -> "EtcdRendezvous":
        await self._store.open()
        try:
            self._store.connection.listeners.append(self._on_connection)
            gen_doc, gen_rev, gen_header = await self._store.read_json(self.key("generation"))
            self._gen = self._readable(gen_doc, gen_rev)
            self._stored_rev = gen_rev
            leader_doc, _, leader_header = await self._store.read_json(self.key("leader"))
            self._leader = leader_doc.get("node_id") if leader_doc else None
            if self._leader is None:
                self._leader_vacant.set()
            watching = [asyncio.Event(), asyncio.Event()]
            self._spawn(self._follow_generation(gen_header + 1, watching[0]), "rdzv-generation")
            self._spawn(self._follow_leader(leader_header + 1, watching[1]), "rdzv-leader")
            # Live once etcd confirmed both watches (so a failing etcd shows up here, not later).
            await self._until_ready(watching)
            self._spawn(self._leadership(), "rdzv-leadership")
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a task stuck in a library's cleanup must not hang the agent's exit
            await asyncio.wait(tasks, timeout=5)
        with contextlib.suppress(ValueError):
            self._store.connection.listeners.remove(self._on_connection)
        self._is_leader = False
        await self._store.close()  # revokes the lease: our registration and leader key vanish at once
        for q in self._subscribers:
            q.put_nowait(None)

    async def _until_ready(self, events: list[asyncio.Event]) -> None:
        waits = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            while not all(e.is_set() for e in events):
                self._check_fatal()
                # Bounded: the watches wait out an outage, but a start does not (it fails after reconnect_timeout).
                await asyncio.wait(waits + list(self._tasks), timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            self._check_fatal()
        finally:
            for w in waits:
                w.cancel()

    def _spawn(self, coro: Any, name: str) -> None:
        # The rendezvous's own tasks wait out etcd outages of any length (their requests never give up): they
        # are what carries the run on once etcd is back.
        task = asyncio.create_task(coro, name=f"{name}:{self.node.node_id}", context=patient_context())
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._fatal is None:
            self._fatal = exc if isinstance(exc, RendezvousError) else RendezvousError(
                f"rendezvous task {task.get_name()} failed: {exc!r}")
            log.error("%s", self._fatal)
            self._wake()
            for q in self._subscribers:
                q.put_nowait(None)

    def _check_fatal(self) -> None:
        """Raise if a rendezvous task died, or if etcd has been gone for ``reconnect_timeout`` (a join or a
        start cannot go on without it; the event stream, the lease and the watches wait it out)."""
        if self._fatal is not None:
            raise self._fatal
        failure = self._store.failure
        if failure is not None:
            raise failure

    async def lease_lost(self) -> str:
        """Return (with a reason) once this node's lease may have expired: from then on the leader may have
        declared us lost and given our ranks to others, so the agent must stop its workers (fencing)."""
        return await self._store.lease_lost()

    async def lease_held(self) -> None:
        """Return once this node's lease is surely alive again (after an outage, re-granted if it expired)."""
        await self._store.lease_held()

    # --- joining ---------------------------------------------------------------------------------------

    async def join(self) -> Generation:
        """Register and wait for an active generation that lists this node (member or spare node)."""
        deadline = self._clock() + self.settings.join_timeout
        self._check_fatal()
        if self._gen is not None and self._gen.state is GenState.CLOSED:
            raise RendezvousClosedError(f"run {self.settings.run_id!r} is closed: {self._gen.reason}")
        if not self._registered:
            closed, _ = await self._store.get_json(self.key("closed"))
            if closed is not None:
                raise RendezvousClosedError(
                    f"run {self.settings.run_id!r} is closed: {closed.get('reason', 'no reason given')}")
            await self._store.put_json(self.key("nodes", self.node.node_id), self.node.to_json(), lease=True)
            self._registered = True
        while True:
            self._check_fatal()
            gen = self._gen
            if gen is not None and gen.state is GenState.CLOSED:
                raise RendezvousClosedError(f"run {self.settings.run_id!r} is closed: {gen.reason}")
            if gen is not None and gen.state is GenState.ACTIVE and gen.includes(self.node.node_id):
                self._last_joined = gen
                return gen
            remaining = deadline - self._clock()
            if remaining <= 0:
                have = f"generation {gen.number} is {gen.state.value}" if gen else "no generation formed yet"
                raise RendezvousTimeoutError(
                    f"node {self.node.node_id} did not join run {self.settings.run_id!r} within "
                    f"{self.settings.join_timeout:g} s ({have}; min_nodes={self.settings.min_nodes})")
            await self._wait_change(remaining)

    async def _wait_change(self, timeout: float) -> None:
        changed = self._changed
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)
        raise_if_cancelling()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- generation record -----------------------------------------------------------------------------

    async def _follow_generation(self, start_revision: int, ready: asyncio.Event) -> None:
        async for ev in self._store.watch_key(self.key("generation"), start_revision, raw=True, ready=ready):
            if ev.kind == "reset":
                doc, rev = await self._store.get_json(self.key("generation"))
                self._stored_rev = rev
                self._apply_generation(self._readable(doc, rev), force=True)
            elif ev.kind == "put":
                try:
                    gen = _decode_generation_bytes(ev.raw, ev.mod_revision)
                except _Unreadable as exc:
                    gen = self._malformed(ev.mod_revision, exc)
                    if gen is None:
                        continue    # nothing good was ever read: nothing to tell anyone
                self._apply_generation(gen)
            else:
                self._stored_rev = 0
                self._apply_generation(None, revision=ev.mod_revision)

    def _apply_generation(self, new: Generation | None, *, revision: int = 0, force: bool = False) -> None:
        old = self._gen
        new_rev = new.revision if new is not None else revision
        if not force and old is not None and 0 < new_rev <= old.revision:
            return  # already applied (our own CAS), or older than what we have
        self._gen = new
        if new is not None:
            self._stored_rev = new.revision
        for kind, node_id, reason in events_between(old, new):
            self._publish(RdzvEvent(kind, new, node_id, reason))
        self._wake()

    def _readable(self, doc: dict[str, Any] | None, revision: int) -> Generation | None:
        """The generation read at ``revision`` (0: absent), a malformed value read as :meth:`_malformed`."""
        if revision == 0:
            return None
        try:
            return _decode_generation(doc, revision)
        except _Unreadable as exc:
            return self._malformed(revision, exc)

    def _malformed(self, revision: int, exc: Exception) -> Generation | None:
        """A malformed generation value (torn, foreign, forged) is logged once and read as the last good
        record at the malformed value's revision: the next compare-and-set replaces it, nothing dies, and no
        CAS loop spins against a revision it can never match."""
        if revision != self._bad_rev:
            self._bad_rev = revision
            log.warning("ignoring malformed generation record in etcd (revision %d): %s", revision, exc)
        self._stored_rev = max(self._stored_rev, revision)
        return self._gen.with_revision(revision) if self._gen is not None else None

    def _publish(self, event: RdzvEvent) -> None:
        for q in self._subscribers:
            q.put_nowait(event)

    async def current(self) -> Generation | None:
        """Read the generation record from etcd (and refresh this handle's copy)."""
        doc, rev = await self._store.get_json(self.key("generation"))
        gen = self._readable(doc, rev)
        if gen is not None:
            self._apply_generation(gen)
        return gen

    async def commit(self, old: Generation, new: Generation) -> bool:
        """Replace ``old`` by ``new`` if nobody changed the record since ``old`` was read (CAS)."""
        expected = old.revision
        if expected == 0:  # built by hand, not read: compare by value against what is stored now
            cur = await self.current()
            if cur != old:
                return False
            expected = cur.revision if cur is not None else 0
        rev = await self._store.cas_json_rev(self.key("generation"), new.to_json(), expected)
        if rev is None:
            return False
        self._apply_generation(new.with_revision(rev))
        return True

    async def request_restart(self, gen: Generation, reason: str) -> None:
        """Move the run to a forming generation ``gen.number + 1``; a no-op if someone already did."""
        for _ in range(_CAS_ATTEMPTS):
            cur = await self.current()
            if cur is None:
                return
            if cur.state is GenState.CLOSED:
                raise RendezvousClosedError(f"run {self.settings.run_id!r} is closed: {cur.reason}")
            if cur.number > gen.number or cur.state is GenState.FORMING:
                return
            new = restart_generation(cur, reason)
            rev = await self._store.cas_json_rev(self.key("generation"), new.to_json(), cur.revision)
            if rev is not None:
                log.info("restart requested by %s: %s", self.node.node_id, reason)
                self._apply_generation(new.with_revision(rev))
                return
        raise RendezvousError("could not request a restart: the generation record kept changing")

    async def close(self, reason: str) -> None:
        """Mark the run closed; every agent sees ``closed`` and late joiners get RendezvousClosedError."""
        await self._store.put_json(self.key("closed"),
                                   {"v": 1, "reason": reason, "node_id": self.node.node_id, "time": time.time()})
        deadline = self._clock() + self.settings.close_timeout
        while True:
            cur = await self.current()
            if cur is not None and cur.state is GenState.CLOSED:
                return
            expected = cur.revision if cur is not None else self._stored_rev
            new = closed_generation(cur, reason)
            rev = await self._store.cas_json_rev(self.key("generation"), new.to_json(), expected)
            if rev is not None:
                self._apply_generation(new.with_revision(rev))
                return
            if self._clock() > deadline:
                raise RendezvousTimeoutError(f"could not close run {self.settings.run_id!r} within "
                                             f"{self.settings.close_timeout:g} s")

    # --- workers' bootstrap store ----------------------------------------------------------------------

    async def publish_bootstrap(self, gen: Generation, addr: str, port: int) -> None:
        """Group rank 0's agent says where this generation's workers meet (a fresh store per generation)."""
        await self._store.put_json(self.key("bootstrap", str(gen.number)),
                                   {"v": 1, "number": gen.number, "addr": addr, "port": int(port)})

    async def wait_bootstrap(self, gen: Generation, timeout: float) -> tuple[str, int]:
        if gen.bootstrap is not None:
            return gen.bootstrap
        key = self.key("bootstrap", str(gen.number))
        try:
            return await asyncio.wait_for(self._wait_bootstrap(key), timeout)
        except asyncio.TimeoutError:
            raise RendezvousTimeoutError(
                f"no bootstrap address for generation {gen.number} of run {self.settings.run_id!r} "
                f"within {timeout:g} s (group rank 0's agent publishes it)") from None

    async def _wait_bootstrap(self, key: str) -> tuple[str, int]:
        doc, _, header = await self._store.read_json(key)
        if doc is not None:
            return str(doc["addr"]), int(doc["port"])
        async with contextlib.aclosing(self._store.watch_key(key, header + 1)) as events:
            async for ev in events:
                if ev.kind == "put" and ev.value is not None:
                    return str(ev.value["addr"]), int(ev.value["port"])
        raise RendezvousError("bootstrap watch ended")  # pragma: no cover (watches do not end)

    # --- events ----------------------------------------------------------------------------------------

    def events(self) -> "EventStream":
        """What the agent reacts to while its workers run; raises RendezvousConnectionError if etcd is gone.

        Subscribes at call time (not at the first ``__anext__``), so nothing that happens between the call
        and the first iteration is missed; changes since ``join()`` returned are replayed first.
        """
        stream = EventStream(self)
        if self._last_joined is not None:
            for kind, node_id, reason in events_between(self._last_joined, self._gen):
                stream.queue.put_nowait(RdzvEvent(kind, self._gen, node_id, reason))
        return stream

    def _on_connection(self, link: Link, detail: Any) -> None:
        """Each outage and each recovery reaches the subscribers once; a join waiting on an outage that has
        lasted reconnect_timeout wakes up to fail."""
        if link is Link.RESTORED:
            self._publish(RdzvEvent(EventKind.CONNECTION_RESTORED, self._gen,
                                    reason=f"etcd is reachable again after {float(detail):.1f} s"))
        elif link is Link.LOST:
            self._publish(RdzvEvent(EventKind.CONNECTION_LOST, self._gen,
                                    reason=f"etcd connection lost ({one_line(detail)}); reconnecting"))
        self._wake()

    # --- leadership ------------------------------------------------------------------------------------

    async def _follow_leader(self, start_revision: int, ready: asyncio.Event) -> None:
        async for ev in self._store.watch_key(self.key("leader"), start_revision, ready=ready):
            if ev.kind == "put" and ev.value is not None:
                new = str(ev.value.get("node_id"))
            elif ev.kind == "reset":
                doc, _ = await self._store.get_json(self.key("leader"))
                new = doc.get("node_id") if doc else None
            else:
                new = None
            if new is None:
                self._leader_vacant.set()
            if self._is_leader and new != self.node.node_id:
                # gone, or someone else's: ours died with our lease while we could not see it (a partition
                # longer than the lease); that node leads now, and this one must stop deciding at once
                self._leadership_lost.set()
            if new != self._leader:
                self._leader = new
                if new is not None:
                    self._publish(RdzvEvent(EventKind.LEADER_CHANGED, self._gen, new, f"{new} leads the run"))

    async def _leadership(self) -> None:
        me = {"v": 1, "node_id": self.node.node_id, "addr": self.node.addr, "pid": self.node.pid}
        while True:
            await self._leader_vacant.wait()
            self._leader_vacant.clear()
            if not await self._store.create_json(self.key("leader"), me, lease=True):
                continue  # someone else won; wait for the key to go again
            self._is_leader = True
            self._leadership_lost.clear()
            if self._leader != self.node.node_id:
                self._leader = self.node.node_id
                self._publish(RdzvEvent(EventKind.LEADER_CHANGED, self._gen, self.node.node_id,
                                        f"{self.node.node_id} leads the run"))
            log.info("%s leads run %s", self.node.node_id, self.settings.run_id)
            try:
                await self._lead()
            finally:
                self._is_leader = False

    async def _lead(self) -> None:
        """Form and annotate generations until our leader key disappears."""
        prefix = self.key("nodes/")
        items, header = await self._store.read_prefix_json(prefix)
        nodes: dict[str, NodeEntry] = {}
        for key, doc, _mod, create in items:
            _add_node(nodes, key[len(prefix):], doc, create)
        wake = asyncio.Event()
        watcher = asyncio.create_task(self._follow_nodes(prefix, header + 1, nodes, wake))
        quorum_since: float | None = None
        epoch = self._store.lease_epoch
        try:
            while not self._leadership_lost.is_set():
                if watcher.done():
                    watcher.result()  # re-raise a fatal watch error
                if self._store.lease_epoch != epoch or not self._store.lease_sure():
                    # Our leader key lives under our lease. Past the lease's sure life (an etcd outage) another
                    # node may lead already, while our watches still show what we saw before the cut: decide
                    # nothing until the lease is confirmed (still ours: we still lead) or found re-granted (the
                    # key died with the old one).
                    await self._store.lease_held()
                    if self._store.lease_epoch != epoch:
                        return
                    continue
                wake.clear()
                seen = self._changed
                view = RdzvView(self._gen, dict(nodes), quorum_since=quorum_since)
                decision = decide(view, self._clock(), self.settings)
                if decision.reason != self._last_reason:
                    log.info("leader %s: %s", self.node.node_id, decision.reason)
                    self._last_reason = decision.reason
                quorum_since = decision.quorum_since
                if decision.action in (Action.FORM, Action.UPDATE) and decision.generation is not None:
                    expected = self._gen.revision if self._gen is not None else self._stored_rev
                    rev = await self._store.cas_json_rev(self.key("generation"),
                                                         decision.generation.to_json(), expected)
                    if rev is not None:
                        self._apply_generation(decision.generation.with_revision(rev))
                    else:  # someone else wrote first: decide again on what they wrote
                        await self.current()
                    continue
                if self._gen is not None and self._gen.revision == self._bad_rev:
                    await self._restore_generation()
                    continue
                timeout = None if decision.wake_at is None else max(0.0, decision.wake_at - self._clock())
                await _first_of([wake.wait(), seen.wait(), self._leadership_lost.wait()], timeout)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher

    async def _restore_generation(self) -> None:
        """The key holds garbage (torn, foreign, forged) and everyone runs on the last good record: the leader puts
        that record back, so whoever reads etcd (tpassctl, a node starting now) sees the job's generation again."""
        assert self._gen is not None
        rev = await self._store.cas_json_rev(self.key("generation"), self._gen.to_json(), self._gen.revision)
        if rev is None:       # written meanwhile: read what is there now (garbage again: restored again)
            await self.current()
            return
        log.warning("restored generation %d over the malformed record (revision %d)", self._gen.number, self._bad_rev)
        self._apply_generation(self._gen.with_revision(rev))

    async def _follow_nodes(self, prefix: str, start_revision: int, nodes: dict[str, NodeEntry],
                            wake: asyncio.Event) -> None:
        async for ev in self._store.watch_prefix(prefix, start_revision):
            _apply_node_event(nodes, prefix, ev)
            if ev.kind == "reset":
                items, _ = await self._store.read_prefix_json(prefix)
                nodes.clear()
                for key, doc, _mod, create in items:
                    _add_node(nodes, key[len(prefix):], doc, create)
            wake.set()


class EventStream:
    """An async iterator of ``RdzvEvent`` for one subscriber. ``aclose()`` unsubscribes."""

    def __init__(self, rdzv: EtcdRendezvous) -> None:
        self._rdzv = rdzv
        self.queue: asyncio.Queue[RdzvEvent | None] = asyncio.Queue()
        rdzv._subscribers.append(self.queue)

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> RdzvEvent:
        # Only a dead rendezvous task ends the stream: an etcd outage of any length is survived (the
        # subscriber hears connection_lost / connection_restored).
        if self._rdzv._fatal is not None:
            raise self._rdzv._fatal
        event = await self.queue.get()
        if event is None:
            if self._rdzv._fatal is not None:
                raise self._rdzv._fatal
            await self.aclose()
            raise StopAsyncIteration
        return event

    async def aclose(self) -> None:
        with contextlib.suppress(ValueError):
            self._rdzv._subscribers.remove(self.queue)


def _add_node(nodes: dict[str, NodeEntry], node_id: str, doc: dict[str, Any] | None, create_rev: int) -> None:
    try:
        info = NodeInfo.from_json(doc or {})
    except (KeyError, ValueError, TypeError) as exc:
        log.warning("ignoring unreadable registration nodes/%s: %s", node_id, exc)
        return
    nodes[node_id] = NodeEntry(info, create_rev)


def _apply_node_event(nodes: dict[str, NodeEntry], prefix: str, ev: WatchEvent) -> None:
    node_id = ev.key[len(prefix):]
    if ev.kind == "put":
        old = nodes.get(node_id)
        # A rewrite keeps the node's place in the join order; a new key (re-registration) gets a new one.
        _add_node(nodes, node_id, ev.value, ev.create_revision or (old.join_order if old else ev.mod_revision))
    elif ev.kind == "delete":
        nodes.pop(node_id, None)


class _Unreadable(ValueError):
    """The generation key holds a value that is not a generation record."""


def _decode_generation(doc: dict[str, Any] | None, revision: int) -> Generation:
    if doc is None:
        raise _Unreadable("not a JSON object")
    try:
        return Generation.from_json(doc, revision)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise _Unreadable(str(exc)) from exc


# Many agents in one process (tests, the scale bench) all receive the same record; decoding a 1,024-member
# record once instead of once per agent keeps that O(n) instead of O(n^2). Keyed by the bytes themselves, so
# distinct etcd servers or runs can never alias. Generations are frozen, so sharing one object is safe.
_DECODED: dict[bytes, Generation | None] = {}
_DECODED_MAX = 16


def _decode_generation_bytes(raw: bytes, revision: int) -> Generation | None:
    gen = _DECODED.get(raw)
    if gen is None and raw not in _DECODED:
        gen = _decode_generation(decode(raw), 0) if raw else None
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.pop(next(iter(_DECODED)))
        _DECODED[raw] = gen
    return gen.with_revision(revision) if gen is not None else None


async def _first_of(awaitables: list[Any], timeout: float | None) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
