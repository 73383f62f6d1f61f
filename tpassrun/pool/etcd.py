"""The thin etcd I/O of a spare pool (decisions are in :mod:`.plan`).

The one guarantee that matters: **a pool node is held by at most one job**. A claim is one etcd transaction:
``claims/<node>`` must not exist (version 0) and ``nodes/<node>`` must still be the registration the claimer
read (same mod revision: the node did not leave, re-register or change state meanwhile); then the claim is put
bound to the claimer's lease. Two claimers racing for one node: etcd serialises the transactions, exactly one
compare holds. A claimer that dies: its lease expires, etcd deletes the claim, the node is free again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import aetcd

from tpassrun.pool.plan import PoolView
from tpassrun.records import (
    Claim,
    HistoryEntry,
    PoolInfo,
    PoolKeys,
    PoolNode,
    PreemptRequest,
    RecordError,
    load_sealed,
    pool_seal,
    provenance,
)
from tpassrun.rendezvous import EtcdStore, LeaseIs, encode_value


class PoolError(RuntimeError):
    """A pool that cannot be used (absent, another key): one line, said at start."""


@dataclass
class Pool:
    """One pool, seen through one :class:`EtcdStore` (with a lease for a node or a claimer; without for tpassctl)."""

    store: EtcdStore
    keys: PoolKeys
    key: provenance.RunKey
    name: str

    # --- the pool itself -----------------------------------------------------------------------------
    async def create(self) -> bool:
        """Write ``info`` (False: the pool exists already, with this key or another)."""
        info = PoolInfo(self.name, time.time(), self.key.fingerprint)
        return await self.store.create_json(self.keys.info, pool_seal(self.key, self.keys.info, info.to_json()))

    async def check(self) -> PoolInfo:
        """The pool's info, or :class:`PoolError` saying why it cannot be used (absent, or sealed with another
        key: the job was not given this pool's key)."""
        doc, _ = await self.store.get_json(self.keys.info)
        if doc is None:
            raise PoolError(f"spare pool {self.name!r} does not exist (create it with `tpassctl pool create "
                            f"{self.name}`)")
        try:
            return PoolInfo.from_json(load_sealed(self.key, self.keys.info, doc))
        except RecordError:
            raise PoolError(f"spare pool {self.name!r} was created with another pool key (key {self.key.fingerprint}"
                            f" given, pool's {doc.get('fingerprint', '?')}): give its key by --rdzv-conf "
                            f"pool_key_file=PATH or $TPASSRUN_POOL_KEY") from None

    async def delete(self) -> None:
        await self.store.delete_prefix(self.keys.prefix)

    # --- reading -------------------------------------------------------------------------------------
    async def read(self) -> tuple[PoolView, dict[str, int], list[HistoryEntry]]:
        """Everything in one range read: the view, each node record's mod revision (what a claim compares on),
        and the history; records without a good pool-key MAC are skipped."""
        items, _ = await self.store.read_prefix_json(self.keys.prefix)
        nodes: dict[str, PoolNode] = {}
        claims: dict[str, Claim] = {}
        preempts: dict[str, PreemptRequest] = {}
        revs: dict[str, int] = {}
        history: list[HistoryEntry] = []
        exists = False
        for key, doc, mod, _create in items:
            try:
                if key == self.keys.info:
                    load_sealed(self.key, key, doc)
                    exists = True
                elif key.startswith(self.keys.nodes):
                    node = PoolNode.from_json(load_sealed(self.key, key, doc))
                    nodes[node.node_id] = node
                    revs[node.node_id] = mod
                elif key.startswith(self.keys.claims):
                    claim = Claim.from_json(load_sealed(self.key, key, doc))
                    claims[claim.node_id] = claim
                elif key.startswith(self.keys.preempts):
                    req = PreemptRequest.from_json(load_sealed(self.key, key, doc))
                    preempts[req.node_id] = req
                elif key.startswith(self.keys.history):
                    history.append(HistoryEntry.from_json(load_sealed(self.key, key, doc)))
            except RecordError:
                continue
        return PoolView(nodes=nodes, claims=claims, exists=exists, preempts=preempts), revs, history

    def decode_claim(self, key: str, doc: Any) -> Claim | None:
        try:
            return Claim.from_json(load_sealed(self.key, key, doc))
        except RecordError:
            return None

    def decode_preempt(self, key: str, doc: Any) -> tuple[PreemptRequest | None, str]:
        """A pre-emption request, or None and why it is refused (no good pool-key MAC, malformed)."""
        try:
            return PreemptRequest.from_json(load_sealed(self.key, key, doc)), ""
        except RecordError as exc:
            return None, str(exc)

    # --- a pool node's writes ------------------------------------------------------------------------
    async def register(self, node: PoolNode) -> int:
        """Put this node's record bound to its lease (it leaves the pool when it dies)."""
        key = self.keys.node(node.node_id)
        return await self.store.put_json(key, pool_seal(self.key, key, node.to_json()), lease=True)

    async def drop_claim(self, node_id: str) -> None:
        """The node itself ends a claim (its spare node exited: the job ended or released it)."""
        await self.store.delete(self.keys.claim(node_id))

    async def drop_preempt(self, node_id: str) -> None:
        """The node is done with a pre-emption request (it went idle for the requester)."""
        await self.store.delete(self.keys.preempt(node_id))

    # --- a claimer's writes --------------------------------------------------------------------------
    async def claim(self, claim: Claim, node_rev: int) -> bool:
        """Claim ``claim.node_id`` if nobody holds it and its record is still at ``node_rev``: one transaction,
        the claim bound to this store's lease. False: another job won, or the node changed or left."""
        if self.store.lease_id is None:
            raise PoolError("a claim must be bound to the claimer's lease (this store has none)")
        ckey, nkey = self.keys.claim(claim.node_id).encode(), self.keys.node(claim.node_id).encode()
        raw = encode_value(pool_seal(self.key, self.keys.claim(claim.node_id), claim.to_json()))
        lease = self.store.lease_id

        async def op(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(compare=[c.transactions.version(ckey) == 0,
                                                 c.transactions.mod(nkey) == node_rev],
                                        success=[c.transactions.put(ckey, raw, lease=lease)], failure=[])
            return bool(ok)

        won = await self.store.call(op)
        if won:
            await self.note(claim.node_id, "claimed", claim.job, claim.reason)
        return won

    async def release(self, node_id: str, job: str, why: str) -> bool:
        """Delete our claim on ``node_id`` (only if it is still bound to our lease: never another job's)."""
        ckey, lease = self.keys.claim(node_id).encode(), self.store.lease_id
        if lease is None:
            return False

        async def op(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(compare=[LeaseIs(ckey) == lease], success=[c.transactions.delete(ckey)],
                                        failure=[])
            return bool(ok)

        done = await self.store.call(op)
        if done:
            await self.note(node_id, "released", job, why)
        return done

    async def give_back(self, claim: Claim, why: str) -> bool:
        """Mark our claim on ``claim.node_id`` released (a put under our lease, only if the claim is still bound to
        it): the pool node stops the job's spare node, drops the claim and is idle again. False: not ours."""
        ckey, lease = self.keys.claim(claim.node_id), self.store.lease_id
        if lease is None:
            return False
        raw = encode_value(pool_seal(self.key, ckey, replace(claim, released=why).to_json()))

        async def op(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(compare=[LeaseIs(ckey.encode()) == lease],
                                        success=[c.transactions.put(ckey.encode(), raw, lease=lease)], failure=[])
            return bool(ok)

        done = await self.store.call(op)
        if done:
            await self.note(claim.node_id, "released", claim.job, why)
        return done

    async def request_preempt(self, req: PreemptRequest) -> None:
        """Ask ``req.node_id`` to give up its lower-priority member, bound to this store's lease (a requester that
        dies withdraws it). The pool node decides (seal, priorities); the claim comes after, as on an idle node."""
        if self.store.lease_id is None:
            raise PoolError("a pre-emption request must be bound to the requester's lease (this store has none)")
        key = self.keys.preempt(req.node_id)
        await self.store.put_json(key, pool_seal(self.key, key, req.to_json()), lease=True)

    async def note(self, node_id: str, event: str, job: str | None, detail: str = "") -> None:
        entry = HistoryEntry(time.time(), node_id, event, job, detail)
        key = self.keys.history_entry(entry.time, node_id)
        await self.store.put_json(key, pool_seal(self.key, key, entry.to_json()))
