"""The mirror data plane: redundant copies of per-rank state in another node's host memory.

Every agent runs a :class:`MirrorServer` around one in-memory :class:`MirrorStore`. Other processes of the job
(agents mirroring their workers' light snapshots, workers mirroring their shards from a background thread) put
copies into the store of their *buddy* node (:func:`buddy_ring`) with a :class:`MirrorClient`; when a node
dies, the copies of its ranks are still in its buddy's memory and a recovery reads them back. Nothing here
goes through etcd, and nothing is on a training step's path: a copy is pushed after the fact, by whoever
holds it.

API (what the agent and the shard mirror code against)::

    store = MirrorStore(max_bytes=1 << 30)
    store.put(owner=3, kind="light", version=41, payload=b"...", epoch=2)  # -> True if kept
    store.get(3, "light")                 # newest: MirrorItem(owner, kind, version, epoch, data) or None
    store.get(3, "light", version=40)     # that version, or None
    store.versions(3, "light")            # (40, 41): newest two complete versions, ascending
    store.usage()                         # [MirrorEntry(owner, kind, epoch, versions, nbytes), ...]
    store.bytes_held(owner=3)             # what it costs

    async with MirrorServer(store, key, host=advertised_addr, run_id=run_id) as server:   # the agent
        server.port                       # published in the agent's NodeInfo (``mirror_port``)

    with MirrorClient(addr, port, key, run_id=run_id) as client:        # blocking: a thread, or to_thread
        client.put(3, "light", 41, payload, epoch=2)                    # payload: bytes-like, or a list of
        client.get(3, "light", version=None)                            #   them (sent without joining)
        client.versions(3, "light"); client.list(); client.drop(owner=3)

* **owner** is an int, the rank's global rank (stable across swaps: a joiner takes the dead rank's number);
  **kind** a short string (``"light"``, ``"shard/<name>"``); **version** an int, normally the step the copy
  is for; **epoch** the generation that spawned the writer (a whole-group restart starts a new epoch: a copy
  from before it is never taken for one after it; a put with a newer epoch drops the older epoch's copies of
  that (owner, kind), one with an older epoch is refused).
* A store keeps the newest two *complete* versions of each (owner, kind): a put is visible only once all its
  bytes arrived and its MAC verified, so a writer dying mid-put leaves the previous versions intact. A put of
  a version already held replaces it; one older than both held versions is not kept (``put`` returns False).
* Memory is bounded (``max_bytes``): copies of older epochs are evicted first; then a put that does not fit
  is refused (:class:`MirrorFull` on the client), never half-kept.

Security: the server listens on the agent's advertised address only. Every connection proves the per-run
mirror key (:mod:`tpassrun.transfer.auth`'s HMAC handshake, purpose "mirror", the run id as context) before the
server reads a byte of request or allocates anything for it; every frame after that carries an HMAC-SHA256 tag
over its direction, sequence number, header, meta and payload; sizes are checked before allocation. A run with
``--rdzv-conf encrypt=true`` seals every frame's meta and payload with AES-256-GCM instead
(:mod:`tpassrun.mirror.seal`). The key
is drawn once per run and kept in the run's authenticated etcd (:func:`ensure_mirror_key`), never on a command
line or in a file; workers get it over their private agent socket.

The wire protocol and the server are :mod:`tpassrun.mirror.net`'s, the clients :mod:`tpassrun.mirror.client`'s.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Sequence

from tpassrun.mirror.client import MirrorClient, PushStream
from tpassrun.mirror.net import BAD_REQUEST, NOT_FOUND, OK, REFUSED, MirrorServer
from tpassrun.mirror.store import (
    DEFAULT_MAX_BYTES,
    MirrorEntry,
    MirrorError,
    MirrorFull,
    MirrorItem,
    MirrorMetaError,
    MirrorStore,
)
from tpassrun.schema import Record, Schema


# ---------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class MirrorTarget(Record):
    """Where one process's copies go: a node's mirror store and how to prove the key to it. The agent hands
    its workers theirs (their node's buddy) over the private agent socket (``mirror_info``); never printed."""

    SCHEMA: ClassVar[Schema] = Schema(what="mirror target", error=MirrorMetaError)

    node: str
    addr: str
    port: int
    key: bytes = dataclasses.field(repr=False)
    run_id: str = ""
    epoch: int = 0          # the epoch copies must carry (the generation that spawned the writers)
    encrypt: bool = False   # the run encrypts (--rdzv-conf encrypt=true): a client sends nothing in clear

    def client(self, timeout: float = 10.0) -> MirrorClient:
        return MirrorClient(self.addr, self.port, self.key, run_id=self.run_id, timeout=timeout,
                            encrypt=True if self.encrypt else None)



# ---------------------------------------------------------------------------------------------- key, ring
def new_mirror_key() -> bytes:
    return secrets.token_bytes(32)


async def ensure_mirror_key(store: Any, key_path: str) -> bytes:
    """The run's mirror key: the first agent draws it and creates ``key_path`` in the run's (authenticated)
    etcd; every agent reads the one that won. ``store`` is the rendezvous's ``EtcdStore``. A run with a run key
    (tpassrun/records/provenance.py) derives it from that instead, and never writes it: reading etcd does not give it."""
    from tpassrun.records import MirrorKey, RecordError, key_for  # the agent's side only: workers never import records

    run_key = key_for(key_path)
    if run_key is not None:
        return run_key.derive("mirror")

    await store.create_json(key_path, MirrorKey(new_mirror_key().hex()).to_json())
    doc, _rev = await store.get_json(key_path)
    try:
        key = bytes.fromhex(MirrorKey.from_json(doc).key)
    except (RecordError, ValueError) as exc:
        raise MirrorError(f"the run's mirror key in etcd ({key_path}) is unreadable: {exc}") from exc
    if len(key) < 16:
        raise MirrorError(f"the run's mirror key in etcd ({key_path}) is too short")
    return key


def ring_nodes(members: Sequence[str], holders: Iterable[str] = (), lost: Iterable[str] = ()) -> tuple[str, ...]:
    """The nodes of the buddy ring: ``members`` in group-rank order, then any other node that holds ranks
    (``holders``: a spare node that took a rank in a swap), sorted; nodes in ``lost`` left out."""
    gone = set(lost)
    ring = [m for m in members if m not in gone]
    ring += sorted({h for h in holders if h not in gone and h not in ring})
    return tuple(ring)


def buddy_ring(nodes: Sequence[str]) -> dict[str, str]:
    """node -> its buddy: the node that holds its copies (the next one in ``nodes``, wrapping). A ring of
    one node has no buddy (nothing else survives its loss)."""
    if len(nodes) < 2:
        return {}
    return {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)}


def copies_of(node: str, nodes: Sequence[str]) -> str | None:
    """Which node holds ``node``'s copies in the ring over ``nodes`` (None: no buddy)."""
    return buddy_ring(nodes).get(node)


__all__ = ["BAD_REQUEST", "DEFAULT_MAX_BYTES", "MirrorClient", "PushStream", "MirrorEntry", "MirrorError", "MirrorFull",
           "MirrorItem", "MirrorMetaError", "MirrorServer", "MirrorStore", "MirrorTarget", "NOT_FOUND", "OK", "REFUSED",
           "buddy_ring", "copies_of", "ensure_mirror_key", "new_mirror_key", "ring_nodes"]
