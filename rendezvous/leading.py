"""``Leadership`` (mixin of :class:`~.handler.EtcdRendezvous`): the campaign for ``leader``, and what the leader
does: it watches ``nodes/``, feeds the registrations it accepts into ``machine.decide`` and writes the outcome to
``generation`` by compare-and-set.

Every record read here goes through the handle's :class:`~.guard.RecordGuard`: a registration without the run's
seal is no registration (never taken into a generation), and a ``leader`` value without it is vacant, replaced by
compare-and-set like any squatter, so it can neither stop an election nor let two agents lead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable

from .config import RendezvousSettings
from .etcd_io import EtcdStore, WatchEvent
from .guard import RefusalLog, named
from .machine import Action, NodeEntry, RdzvView, decide
from .state import EventKind, Generation, Leader, NodeInfo, RdzvEvent

log = logging.getLogger("tpassrun.rendezvous.handler")


class Leadership:
    """The leader's half of :class:`~.handler.EtcdRendezvous` (every agent campaigns; one leads at a time).

    It uses the handle's state and methods: the attributes and the methods declared below (for the type checker
    only: :class:`~.handler.EtcdRendezvous` defines them)."""

    settings: RendezvousSettings
    node: NodeInfo
    _store: EtcdStore
    _clock: Callable[[], float]
    _refusals: RefusalLog
    _gen: Generation | None
    _stored_rev: int
    _bad_rev: int
    _changed: asyncio.Event
    _leader: str | None
    _leader_vacant: asyncio.Event
    _leadership_lost: asyncio.Event
    _is_leader: bool
    leadership_listeners: list[Callable[[], None]]
    _foreign: str | None
    _last_reason: str

    if TYPE_CHECKING:
        def key(self, *parts: str) -> str: ...
        async def current(self) -> Generation | None: ...
        def _refused(self, key: str, doc: Any, revision: int, what: str, *, fatal: bool = False) -> bool: ...
        def _sealed(self, key: str, doc: dict[str, Any]) -> dict[str, Any]: ...
        def _publish(self, event: RdzvEvent) -> None: ...
        async def _cas_generation(self, new: Generation, expected: int) -> bool: ...

    # --- the leader key --------------------------------------------------------------------------------

    def _leader_in(self, doc: dict[str, Any] | None, revision: int) -> str | None:
        """The node that leads according to ``leader`` at ``revision`` (0: absent); None for a value that is not a
        leader record of this run (malformed, or without the run's seal), logged once: it reads as vacant."""
        if revision == 0:
            return None
        key = self.key("leader")
        node_id = doc.get("node_id") if doc is not None else None
        if self._refused(key, doc, revision, named(node_id, "leader record"), fatal=True):
            return None
        if not isinstance(node_id, str) or not node_id:
            self._refusals.say(key, revision, f"ignoring malformed leader record (revision {revision}): no node_id")
            return None
        return node_id

    async def _follow_leader(self, start_revision: int, ready: asyncio.Event) -> None:
        async for ev in self._store.watch_key(self.key("leader"), start_revision, ready=ready):
            if ev.kind == "put":
                new = self._leader_in(ev.value, ev.mod_revision)
            elif ev.kind == "reset":
                doc, rev = await self._store.get_json(self.key("leader"))
                new = self._leader_in(doc, rev)
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

    async def _campaign(self) -> bool:
        """Take ``leader`` under our lease: create it, or replace (compare-and-set on its revision) a value there
        that is not a leader record of this run (a squatter: it reads as vacant, and it has no lease to expire).
        Of several agents replacing the same squatter, the compare-and-set lets exactly one win."""
        key = self.key("leader")
        me = self._sealed(key, Leader(self.node.node_id, self.node.addr, self.node.pid).to_json())
        if await self._store.create_json(key, me, lease=True):
            return True
        doc, rev = await self._store.get_json(key)
        if not rev or self._leader_in(doc, rev) is not None or self._foreign is not None:
            return False     # gone meanwhile (its delete wakes us again), or a leader of this run
        if await self._store.cas_json(key, me, rev, lease=True):
            log.warning("%s replaced the value at %s (revision %d): not a leader record of this run",
                        self.node.node_id, key, rev)
            return True
        return False

    async def _leadership(self) -> None:
        while True:
            await self._leader_vacant.wait()
            self._leader_vacant.clear()
            if self._foreign is not None:
                return   # this agent is leaving (its records are sealed with another key): it must not lead
            if not await self._campaign():
                continue  # someone else won; wait for the key to go again
            self._leadership_lost.clear()
            self._set_leading(True)
            if self._leader != self.node.node_id:
                self._leader = self.node.node_id
                self._publish(RdzvEvent(EventKind.LEADER_CHANGED, self._gen, self.node.node_id,
                                        f"{self.node.node_id} leads the run"))
            log.info("%s leads run %s", self.node.node_id, self.settings.run_id)
            try:
                await self._lead()
            finally:
                self._set_leading(False)

    def _set_leading(self, leading: bool) -> None:
        if leading == self._is_leader:
            return
        self._is_leader = leading
        for listener in list(self.leadership_listeners):
            listener()

    # --- leading ---------------------------------------------------------------------------------------

    async def _lead(self) -> None:
        """Form and annotate generations until our leader key disappears."""
        prefix = self.key("nodes/")
        nodes, header = await self._read_nodes(prefix)
        wake = asyncio.Event()
        watcher = asyncio.create_task(self._follow_nodes(prefix, header + 1, nodes, wake))
        quorum_since: float | None = None
        epoch = self._store.lease_epoch
        try:
            while not self._leadership_lost.is_set():
                if watcher.done():
                    watcher.result()  # re-raise a fatal watch error
                if self._foreign is not None:
                    return   # the job's records carry another key's seal: this agent leaves, deciding nothing
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
                    if not await self._cas_generation(decision.generation, expected):
                        await self.current()   # someone else wrote first: decide again on what they wrote
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
        """The key holds garbage (torn, foreign, forged, unsealed) and everyone runs on the last good record: the
        leader puts that record back, so whoever reads etcd (tpassctl, a node starting now) sees the job's
        generation again."""
        assert self._gen is not None
        bad = self._bad_rev
        if not await self._cas_generation(self._gen, self._gen.revision):
            await self.current()   # written meanwhile: read what is there now (garbage again: restored again)
            return
        log.warning("restored generation %d over the malformed record (revision %d)", self._gen.number, bad)

    # --- registrations ---------------------------------------------------------------------------------

    async def registrations(self) -> list[NodeInfo]:
        """The live registrations this agent accepts (with the run's seal, when it has a key), in key order."""
        nodes, _ = await self._read_nodes(self.key("nodes/"))
        return [entry.info for entry in nodes.values()]

    async def _read_nodes(self, prefix: str) -> tuple[dict[str, NodeEntry], int]:
        """The registrations taken under ``prefix``, and the header revision to watch on from."""
        items, header = await self._store.read_prefix_json(prefix)
        nodes: dict[str, NodeEntry] = {}
        for key, doc, mod, create in items:
            self._add_node(nodes, key[len(prefix):], key, doc, mod, create)
        return nodes, header

    async def _follow_nodes(self, prefix: str, start_revision: int, nodes: dict[str, NodeEntry],
                            wake: asyncio.Event) -> None:
        async for ev in self._store.watch_prefix(prefix, start_revision):
            self._apply_node_event(nodes, prefix, ev)
            if ev.kind == "reset":
                fresh, _ = await self._read_nodes(prefix)
                nodes.clear()
                nodes.update(fresh)
            wake.set()

    def _apply_node_event(self, nodes: dict[str, NodeEntry], prefix: str, ev: WatchEvent) -> None:
        node_id = ev.key[len(prefix):]
        if ev.kind == "put":
            old = nodes.get(node_id)
            # A rewrite keeps the node's place in the join order; a new key (re-registration) gets a new one.
            self._add_node(nodes, node_id, ev.key, ev.value, ev.mod_revision,
                           ev.create_revision or (old.join_order if old else ev.mod_revision))
        elif ev.kind == "delete":
            nodes.pop(node_id, None)

    def _add_node(self, nodes: dict[str, NodeEntry], node_id: str, key: str,
                  doc: dict[str, Any] | None, revision: int, create_rev: int) -> None:
        """Take ``nodes/<node_id>`` as a registration, or drop it: one the guard refuses (no seal of this run) or
        that is unreadable is no registration, and a leader never takes such a node into a generation."""
        if self._refused(key, doc, revision, named(node_id, "registration")):
            nodes.pop(node_id, None)
            return
        try:
            info = NodeInfo.from_json(doc or {})
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            self._refusals.say(key, revision, f"ignoring unreadable registration nodes/{node_id}: {exc}")
            nodes.pop(node_id, None)
            return
        nodes[node_id] = NodeEntry(info, create_rev)


async def _first_of(awaitables: list[Any], timeout: float | None) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
