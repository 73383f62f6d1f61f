"""Pure rendezvous decisions: (view, now, settings) -> Decision. No I/O, no clock, no etcd.

The leader agent keeps an ``RdzvView`` (live node registrations + the current generation record) up to
date from watches and asks ``decide`` what to do; the effect layer (``handler.py``) carries the decision
out with a compare-and-set and feeds the result back. Every decision carries a human-readable reason.

Forming a generation (record absent, or state ``forming``)::

    candidates = live nodes that are not --spare-node agents, ordered: previous members by group rank
                 (stable ranks), then newcomers by registration order (etcd create_revision)
    len >= max_nodes          -> FORM: first max_nodes are members, the rest and spare-node agents spares
    len >= min_nodes:
        re-forming round      -> FORM at once (everyone who wants in is already registered); a round
                                 with fewer candidates than previous members first promotes spare-node
                                 agents (join order) into the lost members' places
        first round           -> LAST_CALL: FORM once last_call_timeout has passed since min was reached
    len <  min_nodes          -> WAIT

While a generation is active the leader only annotates it (same number, ``UPDATE``): members or spare
nodes whose registration vanished go to ``lost``; new registrations go to ``waiting`` if a member slot is
free, else (or for --spare-node agents) to ``spare_nodes``. Agents turn those annotations into events.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Iterable, Mapping

from .config import RendezvousSettings
from .state import EventKind, Generation, GenState, Member, NodeInfo


@dataclass(frozen=True)
class NodeEntry:
    """A live registration: the node's record and its registration order (etcd create_revision)."""

    info: NodeInfo
    join_order: int

    @property
    def node_id(self) -> str:
        return self.info.node_id


@dataclass(frozen=True)
class RdzvView:
    """What the leader knows. ``quorum_since`` is when min_nodes was first reached in this forming round."""

    generation: Generation | None
    nodes: Mapping[str, NodeEntry] = field(default_factory=dict)
    closed: bool = False
    quorum_since: float | None = None


class Action(str, Enum):
    IDLE = "idle"  # nothing to do (closed run, or the active generation is up to date)
    WAIT = "wait"  # forming, not enough nodes yet (or last call still running: see wake_at)
    LAST_CALL = "last_call"  # min reached: start the last-call timer (store quorum_since)
    FORM = "form"  # write ``generation`` (state active) with this membership
    UPDATE = "update"  # rewrite the active generation with lost/waiting/spare annotations


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    generation: Generation | None = None
    wake_at: float | None = None  # when to decide again even if nothing changes
    quorum_since: float | None = None  # the value the effect layer keeps for the next call


def decide(view: RdzvView, now: float, settings: RendezvousSettings) -> Decision:
    """What the leader should do next. Pure: same inputs, same decision."""
    gen = view.generation
    if view.closed or (gen is not None and gen.state is GenState.CLOSED):
        return Decision(Action.IDLE, "run is closed")
    if gen is None or gen.state is GenState.FORMING:
        return _decide_forming(view, now, settings)
    return _decide_active(gen, view.nodes, settings)


def _decide_forming(view: RdzvView, now: float, settings: RendezvousSettings) -> Decision:
    gen = view.generation
    number = gen.number if gen is not None else 0
    previous = gen.members if gen is not None else ()
    candidates = order_candidates(previous, view.nodes.values())
    spare_agents = sorted((e for e in view.nodes.values() if e.info.spare_node), key=_join_key)
    # A re-forming round that lost members (node loss) promotes spare-node agents, in join order, into the
    # lost members' places: that is what a spare node is for. Without this the survivors wait for min_nodes
    # forever (or run smaller) while the spare node idles. The first round never promotes them.
    missing = min(len(previous), settings.max_nodes) - len(candidates)
    if previous and missing > 0 and spare_agents:
        promoted, spare_agents = spare_agents[:missing], spare_agents[missing:]
        candidates = _fill_lost_places(previous, candidates, promoted)
    have = len(candidates)
    if have >= settings.max_nodes:
        why = f"generation {number}: max_nodes={settings.max_nodes} reached ({have} candidates)"
        return Decision(Action.FORM, why, form_generation(number, candidates, spare_agents, settings, why))
    if have < settings.min_nodes:
        why = f"generation {number}: waiting for nodes ({have}/{settings.min_nodes} min)"
        return Decision(Action.WAIT, why)
    if previous:
        why = f"generation {number}: re-forming with {have} registered nodes (no last call on a restart)"
        return Decision(Action.FORM, why, form_generation(number, candidates, spare_agents, settings, why))
    if view.quorum_since is None:
        if settings.last_call_timeout <= 0:
            why = f"generation {number}: min_nodes={settings.min_nodes} reached, no last call configured"
            return Decision(Action.FORM, why, form_generation(number, candidates, spare_agents, settings, why))
        deadline = now + settings.last_call_timeout
        why = (f"generation {number}: min_nodes={settings.min_nodes} reached ({have}), last call "
               f"for {settings.last_call_timeout:g} s")
        return Decision(Action.LAST_CALL, why, wake_at=deadline, quorum_since=now)
    deadline = view.quorum_since + settings.last_call_timeout
    if now >= deadline:
        why = f"generation {number}: last call over with {have} nodes (max {settings.max_nodes})"
        return Decision(Action.FORM, why, form_generation(number, candidates, spare_agents, settings, why))
    why = f"generation {number}: last call running, {have}/{settings.max_nodes} nodes, {deadline - now:.1f} s left"
    return Decision(Action.WAIT, why, wake_at=deadline, quorum_since=view.quorum_since)


def _decide_active(gen: Generation, nodes: Mapping[str, NodeEntry], settings: RendezvousSettings) -> Decision:
    lost = list(gen.lost)
    spares = list(gen.spare_nodes)
    waiting = list(gen.waiting)
    notes: list[str] = []
    # A vanished registration means the node's lease expired (or it left): tell everyone.
    for node_id in gen.member_ids:
        if node_id not in nodes and node_id not in lost:
            lost.append(node_id)
            notes.append(f"member {node_id} lost")
    for node_id in list(spares):
        if node_id not in nodes:
            spares.remove(node_id)
            if node_id not in lost:
                lost.append(node_id)
            notes.append(f"spare node {node_id} lost")
    for node_id in list(waiting):
        if node_id not in nodes:
            waiting.remove(node_id)
            notes.append(f"waiting node {node_id} left")
    known = set(gen.member_ids) | set(spares) | set(waiting)
    newcomers = sorted((e for e in nodes.values() if e.node_id not in known), key=_join_key)
    for node_id in [n for n in lost if n in nodes and n in gen.member_ids and not gen.placed(n)]:
        # a lost member back (its link healed) whose ranks all run elsewhere now (a recovery spread them over
        # other nodes' spare slots): it serves as a spare node, as a node that took no lost member's place would;
        # kept lost, it waited in the rendezvous, idle, until the next restart, and failed at the run's end
        lost.remove(node_id)
        spares.append(node_id)
        notes.append(f"{node_id}, lost earlier, is back as a spare node (its ranks run elsewhere)")
    for entry in newcomers:
        if entry.node_id in lost:
            continue  # a lost node that came back keeps its "lost" mark until the next generation
        if entry.info.spare_node or len(gen.members) + len(waiting) >= settings.max_nodes:
            spares.append(entry.node_id)
            notes.append(f"{entry.node_id} joined as a spare node")
        else:
            waiting.append(entry.node_id)
            notes.append(f"{entry.node_id} is waiting for a member slot")
    if not notes:
        return Decision(Action.IDLE, f"generation {gen.number} is up to date")
    why = f"generation {gen.number}: " + "; ".join(notes)
    updated = replace(gen, spare_nodes=tuple(spares), waiting=tuple(waiting), lost=tuple(lost))
    return Decision(Action.UPDATE, why, updated)


def _join_key(entry: NodeEntry) -> tuple[int, str]:
    return (entry.join_order, entry.node_id)


def order_candidates(previous: Iterable[Member], nodes: Iterable[NodeEntry]) -> list[NodeEntry]:
    """Live non-spare-node registrations: previous members first (by group rank), then newcomers by join order.

    This is what keeps node ranks stable across generations: survivors keep their relative order.
    """
    live = {e.node_id: e for e in nodes if not e.info.spare_node}
    ordered: list[NodeEntry] = []
    for m in sorted(previous, key=lambda m: m.group_rank):
        entry = live.pop(m.node_id, None)
        if entry is not None:
            ordered.append(entry)
    ordered.extend(sorted(live.values(), key=_join_key))
    return ordered


def _fill_lost_places(previous: Iterable[Member], candidates: list[NodeEntry],
                      promoted: list[NodeEntry]) -> list[NodeEntry]:
    """Put promoted spare nodes at the group ranks of the members that are gone, so every survivor keeps its
    ranks and only the lost node's ranks move (to the spare node). Appending them instead would shift the
    survivors' ranks, and a survivor's old worker could still hold a rank that another node starts anew."""
    live = {e.node_id: e for e in candidates}
    queue = list(promoted)
    ordered: list[NodeEntry] = []
    for m in sorted(previous, key=lambda m: m.group_rank):
        if m.node_id in live:
            ordered.append(live.pop(m.node_id))
        elif queue:
            ordered.append(queue.pop(0))
    return ordered + [e for e in candidates if e.node_id in live] + queue


def form_generation(
    number: int,
    candidates: list[NodeEntry],
    spare_agents: list[NodeEntry],
    settings: RendezvousSettings,
    reason: str,
) -> Generation:
    """An active generation: the first max_nodes candidates as members, everyone else as spare nodes."""
    members: list[Member] = []
    offset = 0
    chosen = candidates[: settings.max_nodes]
    if number == 0:
        # The first round ranks its members as torchrun's dynamic rendezvous does: sorted by (address, pid), not
        # by arrival (on one machine the agent started first gets the low ranks even if it registered last, e.g.
        # while it was starting the etcd). Later rounds keep the previous members' group ranks (swaps need it).
        chosen = sorted(chosen, key=lambda e: (e.info.addr, e.info.pid, e.join_order))
    for group_rank, entry in enumerate(chosen):
        info = entry.info
        members.append(Member(info.node_id, group_rank, info.addr, info.nproc, offset, info.spares, info.role))
        offset += info.nproc
    extra = [e.node_id for e in candidates[settings.max_nodes:]]
    spares = tuple(extra + [e.node_id for e in spare_agents])
    return Generation(number=number, state=GenState.ACTIVE, members=tuple(members), spare_nodes=spares,
                      world_size=offset, reason=reason, formed=number)


def restart_generation(gen: Generation, reason: str) -> Generation:
    """The forming record that asks every agent to re-join. Keeps the members so ranks stay stable."""
    return Generation(number=gen.number + 1, state=GenState.FORMING, members=gen.members,
                      spare_nodes=gen.spare_nodes, world_size=gen.world_size, reason=reason)


def closed_generation(gen: Generation | None, reason: str) -> Generation:
    if gen is None:
        return Generation(number=0, state=GenState.CLOSED, reason=reason)
    return replace(gen, state=GenState.CLOSED, reason=reason, waiting=())


def events_between(old: Generation | None, new: Generation | None) -> list[tuple[EventKind, str | None, str]]:
    """What an agent should hear when the generation record goes from ``old`` to ``new``.

    Returns ``(kind, node_id, reason)`` triples; an annotation-only rewrite (same number, same members)
    becomes node_lost / node_waiting / spare_node_joined, anything else generation_changed.
    """
    if new is None or old == new:
        return []
    if new.state is GenState.CLOSED:
        if old is not None and old.state is GenState.CLOSED:
            return []
        return [(EventKind.CLOSED, None, new.reason or "run closed")]
    if old is None or (old.number, old.state, old.members) != (new.number, new.state, new.members):
        return [(EventKind.GENERATION_CHANGED, None, new.reason)]
    out: list[tuple[EventKind, str | None, str]] = []
    for node_id in new.lost:
        if node_id not in old.lost:
            out.append((EventKind.NODE_LOST, node_id, f"node {node_id} lost (lease expired or left)"))
    for node_id in new.waiting:
        if node_id not in old.waiting:
            out.append((EventKind.NODE_WAITING, node_id, f"node {node_id} is waiting to join"))
    for node_id in new.spare_nodes:
        if node_id not in old.spare_nodes:
            out.append((EventKind.SPARE_NODE_JOINED, node_id, f"spare node {node_id} joined"))
    rest_old = replace(old, lost=(), waiting=(), spare_nodes=())
    rest_new = replace(new, lost=(), waiting=(), spare_nodes=())
    if rest_old != rest_new:  # e.g. assignments, swap_id, bootstrap rewritten under the same number
        out.append((EventKind.GENERATION_CHANGED, None, new.reason))
    return out
