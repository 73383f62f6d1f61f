"""``EtcdRendezvous``: one agent's side of the rendezvous (the effects around ``machine.decide``).

Who watches what (so that a join costs a constant number of etcd requests whatever the run's size):

* every agent registers ``nodes/<node_id>`` under its lease, watches the single keys ``generation`` and
  ``leader``, and campaigns for ``leader`` (a txn create under its lease) when that key is vacant;
* only the leader watches ``nodes/``: it feeds registrations into ``decide`` and writes the outcome to
  ``generation`` by compare-and-set on its mod_revision. A lease expiry deletes the dead node's
  registration; the leader writes it into the generation's ``lost`` list, which every agent sees as a
  ``node_lost`` event. If the leader dies, its ``leader`` key goes with its lease and another agent
  takes over from a fresh read of ``nodes/`` (:mod:`.leading`).

Every record this handle writes (``generation``, ``bootstrap/<n>``, ``nodes/<id>``, ``leader``, ``closed``) goes
through its :class:`~.guard.RecordGuard`'s seal, and every one it reads through its check: a generation without
the run's seal reads like a malformed one (the last good record; the leader puts that back), a bootstrap address
without it is waited past, a registration without it is no registration, a leader record without it is vacant,
a ``closed`` without it is ignored. A join that has not succeeded yet ends at once with a one-line error when the
job's own records (generation, leader) carry another key's seal: agents given different run keys fail fast.

Nothing polls: every wait is on a watch (or on the last-call deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Callable

from .config import EtcdConfig, RendezvousSettings
from .errors import RendezvousClosedError, RendezvousError, RendezvousKeyError, RendezvousTimeoutError
from .etcd_io import EtcdStore, decode
from .etcd_link import EtcdConnection, Link, one_line, patient_context, raise_if_cancelling
from .guard import SAME_KEY_HINT, RecordGuard, RefusalLog
from .leading import Leadership
from .machine import closed_generation, events_between, restart_generation
from .state import Bootstrap, Closed, EventKind, Generation, GenState, NodeInfo, RdzvEvent

log = logging.getLogger(__name__)

_CAS_ATTEMPTS = 16  # a generation record rewritten more often than this during one call is a bug, not load


class EtcdRendezvous(Leadership):
    """The per-node rendezvous handle. The constructor does no I/O; ``async with`` connects.

    Args:
        etcd: where etcd is.
        settings: the run's rendezvous settings.
        node: this agent's registration.
        clock: monotonic seconds (injected so tests can drive time).
        connection: share an ``EtcdConnection`` with other handles (the scale bench does; agents don't).
        guard: seals what this handle writes and checks what it reads (default: neither, a run without a key).
    """

    def __init__(self, etcd: EtcdConfig, settings: RendezvousSettings, node: NodeInfo, *,
                 clock: Callable[[], float] = time.monotonic, connection: EtcdConnection | None = None,
                 guard: RecordGuard | None = None) -> None:
        self.settings = settings
        self.node = node
        self._clock = clock
        self._guard = guard or RecordGuard()
        self._refusals = RefusalLog()
        self._foreign: str | None = None   # why this agent must leave before it joined (records of another key)
        self._store = EtcdStore(etcd, lease_ttl=settings.lease_seconds, connection=connection, clock=clock)
        self._gen: Generation | None = None
        self._stored_rev = 0       # mod revision of whatever the generation key holds (a malformed value too)
        self._bad_rev = 0          # the malformed generation value last logged
        self._changed = asyncio.Event()  # replaced after every set: waiters grab the current one
        self._leader: str | None = None
        self._leader_vacant = asyncio.Event()
        self._leadership_lost = asyncio.Event()
        self._is_leader = False
        # called (no arguments, on the handle's loop) whenever this agent starts or stops leading: the swap
        # coordinator watches the run's records only while it leads (one watcher of every status write, not N)
        self.leadership_listeners: list[Callable[[], None]] = []
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
            leader_doc, leader_rev, leader_header = await self._store.read_json(self.key("leader"))
            self._leader = self._leader_in(leader_doc, leader_rev)
            self._check_fatal()   # the job's records carry another key's seal: leave before campaigning
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
        self._set_leading(False)
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
        """Raise if a rendezvous task died, if etcd has been gone for ``reconnect_timeout`` (a join or a
        start cannot go on without it; the event stream, the lease and the watches wait it out), or if this agent
        has not joined yet and the job's records carry another key's seal than its own."""
        if self._fatal is not None:
            raise self._fatal
        if self._foreign is not None and self._last_joined is None:
            raise RendezvousKeyError(self._foreign)
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
            key = self.key("closed")
            closed, rev = await self._store.get_json(key)
            if closed is not None and not self._refused(key, closed, rev, "closed record"):
                raise RendezvousClosedError(
                    f"run {self.settings.run_id!r} is closed: {closed.get('reason', 'no reason given')}")
            await self._register()
            self._spawn(self._keep_registered(), "rdzv-registration")
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

    async def _register(self) -> int:
        """Write this node's registration under its lease; returns the revision."""
        key = self.key("nodes", self.node.node_id)
        rev = await self._store.put_json(key, self._sealed(key, self.node.to_json()), lease=True)
        self._registered = True
        return rev

    async def _keep_registered(self) -> None:
        """Write the registration again when it vanishes while the lease lives (someone deleted it: ``etcdctl
        del``, a cleanup). The leader takes the delete as this node gone, and nothing else would ever register it
        again: its join would wait for a generation that includes it, forever. A registration that went with an
        expired lease is re-written by the lease's re-grant instead (:meth:`EtcdStore._regrant`)."""
        key = self.key("nodes", self.node.node_id)
        while True:
            try:
                _, rev = await self._store.get_json(key)
                if rev == 0:
                    rev = await self._register()
                async for ev in self._store.watch_key(key, rev + 1):
                    if ev.kind != "delete" or key not in self._store.leased_keys or not self._store.lease_sure():
                        continue
                    log.warning("the registration of node %s (%s) was deleted while its lease lives: registering "
                                "it again", self.node.node_id, key)
                    await self._register()
            except RendezvousError as exc:   # not worth the run: the lease's re-grant re-writes it too
                log.warning("keeping the registration of node %s: %s; again in 1 s", self.node.node_id, exc)
                await asyncio.sleep(1.0)

    async def _wait_change(self, timeout: float) -> None:
        changed = self._changed
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)
        raise_if_cancelling()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- the run's seal --------------------------------------------------------------------------------

    def _sealed(self, key: str, doc: dict[str, Any]) -> dict[str, Any]:
        return self._guard.seal(key, doc)

    def _refused(self, key: str, doc: Any, revision: int, what: str, *, fatal: bool = False) -> bool:
        """Whether the record ``what`` read at ``key`` is to be ignored: it lacks this run's seal (logged once per
        key and revision). ``fatal``: a record of the job itself (generation, leader); one sealed with another key
        than this agent's ends a join that has not succeeded yet (:meth:`_check_fatal`), instead of waiting for its
        timeout. A joined agent only ignores it: the job it runs in is its own."""
        foreign = self._guard.foreign(key, doc)
        if foreign is not None and fatal and self._last_joined is None:
            if self._foreign is None:     # the join's one-line error says it: not a warning as well
                self._foreign = f"{what} {foreign} ({SAME_KEY_HINT})"
                self._wake()
            return self._guard.problem(key, doc) is not None
        why = self._guard.problem(key, doc)
        if why is None:
            return False
        if foreign is not None:
            self._refusals.say(key, revision, f"refusing {what} (revision {revision}): it {foreign}; ignored "
                                              f"({SAME_KEY_HINT})")
        else:
            self._refusals.say(key, revision, f"refusing {what} at {key} (revision {revision}): {why}; ignored")
        return True

    # --- generation record -----------------------------------------------------------------------------

    async def _follow_generation(self, start_revision: int, ready: asyncio.Event) -> None:
        async for ev in self._store.watch_key(self.key("generation"), start_revision, raw=True, ready=ready):
            if ev.kind == "reset":
                doc, rev = await self._store.get_json(self.key("generation"))
                self._stored_rev = rev
                self._apply_generation(self._readable(doc, rev), force=True)
            elif ev.kind == "put":
                gen = self._generation_at(*_decode_generation_bytes(ev.raw), ev.mod_revision)
                if gen is None:
                    continue    # unreadable or refused, and nothing good was ever read: nothing to tell anyone
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
        """The generation read at ``revision`` (0: absent); a malformed or refused value read as :meth:`_malformed`."""
        if revision == 0:
            return None
        return self._generation_at(doc, *_decode_generation(doc), revision)

    def _generation_at(self, doc: dict[str, Any] | None, gen: Generation | None, error: str | None,
                       revision: int) -> Generation | None:
        """What the value ``doc`` (decoded: ``gen``, or why not: ``error``) at ``revision`` reads as."""
        if self._refused(self.key("generation"), doc, revision, "the generation record", fatal=True):
            return self._malformed(revision, None)
        if gen is None:
            return self._malformed(revision, error or "not a generation record")
        return gen.with_revision(revision)

    def _malformed(self, revision: int, why: str | None) -> Generation | None:
        """A malformed generation value (torn, foreign, forged, without the run's seal) is logged once (``why``;
        None: the guard said it already) and read as the last good record at the malformed value's revision: the
        next compare-and-set replaces it (the leader's, at once), nothing dies, and no CAS loop spins against a
        revision it can never match."""
        if revision != self._bad_rev:
            self._bad_rev = revision
            if why is not None:
                log.warning("ignoring malformed generation record in etcd (revision %d): %s", revision, why)
        self._stored_rev = max(self._stored_rev, revision)
        return self._gen.with_revision(revision) if self._gen is not None else None

    async def _cas_generation(self, new: Generation, expected: int) -> bool:
        """Write ``new`` (sealed) if the record's mod revision is still ``expected``, and take it as this handle's."""
        key = self.key("generation")
        rev = await self._store.cas_json_rev(key, self._sealed(key, new.to_json()), expected)
        if rev is None:
            return False
        self._apply_generation(new.with_revision(rev))
        return True

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
        return await self._cas_generation(new, expected)

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
            if await self._cas_generation(restart_generation(cur, reason), cur.revision):
                log.info("restart requested by %s: %s", self.node.node_id, reason)
                return
        raise RendezvousError("could not request a restart: the generation record kept changing")

    async def close(self, reason: str) -> None:
        """Mark the run closed; every agent sees ``closed`` and late joiners get RendezvousClosedError."""
        key = self.key("closed")
        await self._store.put_json(key, self._sealed(key, Closed(reason, self.node.node_id, time.time()).to_json()))
        deadline = self._clock() + self.settings.close_timeout
        while True:
            cur = await self.current()
            if cur is not None and cur.state is GenState.CLOSED:
                return
            expected = cur.revision if cur is not None else self._stored_rev
            if await self._cas_generation(closed_generation(cur, reason), expected):
                return
            if self._clock() > deadline:
                raise RendezvousTimeoutError(f"could not close run {self.settings.run_id!r} within "
                                             f"{self.settings.close_timeout:g} s")

    # --- workers' bootstrap store ----------------------------------------------------------------------

    async def publish_bootstrap(self, gen: Generation, addr: str, port: int) -> None:
        """Group rank 0's agent says where this generation's workers meet (a fresh store per generation)."""
        key = self.key("bootstrap", str(gen.number))
        await self._store.put_json(key, self._sealed(key, Bootstrap(gen.number, addr, int(port)).to_json()))

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
        doc, rev, header = await self._store.read_json(key)
        found = self._bootstrap_in(key, doc, rev)
        if found is not None:
            return found
        async with contextlib.aclosing(self._store.watch_key(key, header + 1)) as events:
            async for ev in events:
                found = self._bootstrap_in(key, ev.value, ev.mod_revision) if ev.kind == "put" else None
                if found is not None:
                    return found
        raise RendezvousError("bootstrap watch ended")  # pragma: no cover (watches do not end)

    def _bootstrap_in(self, key: str, doc: dict[str, Any] | None, revision: int) -> tuple[str, int] | None:
        """The workers' store address in ``bootstrap/<n>`` at ``revision``; None for none, for one without the run's
        seal (an attacker's store would see the workers' peers and feed them its own data) or an unreadable one
        (logged once): the waiter keeps waiting for the genuine one."""
        if revision == 0 or doc is None:
            return None
        if self._refused(key, doc, revision, "bootstrap address"):
            return None
        try:
            found = Bootstrap.from_json(doc)
        except ValueError as exc:
            self._refusals.say(key, revision, f"ignoring unreadable bootstrap address {key} (revision {revision}): {exc}")
            return None
        return found.addr, found.port

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


def _decode_generation(doc: dict[str, Any] | None) -> tuple[Generation | None, str | None]:
    """``(generation, None)``, or ``(None, why it is not one)``."""
    if doc is None:
        return None, "not a JSON object"
    try:
        return Generation.from_json(doc), None
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        return None, str(exc) or type(exc).__name__


# Many agents in one process (tests, the scale bench) all receive the same record; decoding a 1,024-member
# record once instead of once per agent keeps that O(n) instead of O(n^2). Keyed by the bytes themselves, so
# distinct etcd servers or runs can never alias. Generations are frozen, so sharing one object is safe; the
# decoded document is shared too (each agent's guard checks it, never changes it).
_DECODED: dict[bytes, tuple[dict[str, Any] | None, Generation | None, str | None]] = {}
_DECODED_MAX = 16


def _decode_generation_bytes(raw: bytes) -> tuple[dict[str, Any] | None, Generation | None, str | None]:
    """``(document, generation, why it is not one)`` of a stored value."""
    found = _DECODED.get(raw)
    if found is None:
        doc = decode(raw)
        found = (doc, *_decode_generation(doc))
        if len(_DECODED) >= _DECODED_MAX:
            _DECODED.pop(next(iter(_DECODED)))
        _DECODED[raw] = found
    return found
