"""A spare pool's records in etcd: the pool itself, its nodes, the claims on them, the claims' history.

Every record is ``{"v": 1, ...}`` JSON sealed with the **pool key** (``provenance.seal``: an HMAC bound to the
etcd key), the one secret of the pool's trust domain: its nodes and the jobs allowed to draw from it hold it,
etcd never does. A reader refuses a record without a good MAC (:func:`load_sealed`), so a pool node never runs a
job whose claim was not written by a pool-key holder, and a stranger cannot fake an idle node.

Layout, under ``<etcd prefix>-pools/<name>/`` (a sibling of the runs' prefix: no run id can collide with it):

- ``info``: :class:`PoolInfo`, written once by ``tpassctl pool create``; a job checks it at start (no pool, or a
  pool sealed with another key: one-line error).
- ``nodes/<node_id>``: :class:`PoolNode`, bound to the pool node's lease (a dead pool node leaves the pool).
- ``claims/<node_id>``: :class:`Claim`, created only if absent (compare on version 0) and bound to the
  **claimer's** lease: a claimer that dies frees the claim; two claims on one node cannot exist.
- ``history/<time>-<node_id>``: :class:`HistoryEntry`, unleased, what ``tpassctl pool status`` lists.
- ``preempt/<node_id>``: :class:`PreemptRequest`, bound to the **requester's** lease: a higher-priority job asks the
  pool node to give up the lower-priority job it runs as a member (the node checks the seal and the priorities).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tpassrun import schema
from tpassrun.records import provenance
from tpassrun.records.fields import RecordError, _check, record
from tpassrun.schema import NonNegative, OneOf, Positive, wire

POOL_KEY_CONF = "pool_key_file"      # --rdzv-conf pool_key_file=PATH (else $TPASSRUN_POOL_KEY)


def pool_prefix(etcd_prefix: str, name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"{name!r} is not a pool name (no '/', not empty, not starting with '.')")
    return f"{etcd_prefix.rstrip('/')}-pools/{name}/"


@dataclass(frozen=True)
class PoolKeys:
    prefix: str          # pool_prefix(...)

    @property
    def info(self) -> str:
        return self.prefix + "info"

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes/"

    @property
    def claims(self) -> str:
        return self.prefix + "claims/"

    @property
    def history(self) -> str:
        return self.prefix + "history/"

    def node(self, node_id: str) -> str:
        return self.nodes + _part(node_id)

    def claim(self, node_id: str) -> str:
        return self.claims + _part(node_id)

    @property
    def preempts(self) -> str:
        return self.prefix + "preempt/"

    def preempt(self, node_id: str) -> str:
        return self.preempts + _part(node_id)

    def history_entry(self, when: float, node_id: str) -> str:
        return self.history + f"{when:017.6f}-{_part(node_id)}"


def _part(text: str) -> str:
    if not text or "/" in text:
        raise ValueError(f"{text!r} cannot be one part of an etcd key")
    return text


# ---------------------------------------------------------------------------------------------- sealing
def pool_seal(key: provenance.RunKey, etcd_key: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    return provenance.seal(etcd_key, doc, key)


def load_sealed(key: provenance.RunKey, etcd_key: str, doc: Any) -> Mapping[str, Any]:
    """``doc`` if it carries a good pool-key MAC for ``etcd_key``; :class:`RecordError` with the reason otherwise."""
    why = provenance.problem(etcd_key, doc, key)
    if why is not None:
        raise RecordError(f"{etcd_key}: {why}")
    return _check(doc, etcd_key)


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class PoolInfo(schema.Record):
    name: str
    created: float
    fingerprint: str           # the pool key's (safe to show): tells pools of different keys apart

    SCHEMA: ClassVar[schema.Schema] = record("pool info")


IDLE = "idle"
SERVING = "serving"
SPARE = "spare"      # a claim's kind: the pool node starts the job's --spare-node (replacement capacity)
MEMBER = "member"    # a claim's kind: the pool node starts one of the job's member nodes (lower-priority work that a
                     # higher-priority job may pre-empt)


@dataclass(frozen=True)
class PoolNode(schema.Record):
    """``nodes/<node_id>``: a pool node, idle or serving the job named by ``job``."""

    node_id: str
    host: str
    nproc: Positive            # worker slots it can start (the job's --nproc-per-node must fit)
    since: float
    state: Annotated[str, OneOf(IDLE, SERVING)] = IDLE
    job: str | None = None
    agent: str | None = None   # serving: the node id its spare node has in the job (once joined; the job's view
                               # names the node by it)

    SCHEMA: ClassVar[schema.Schema] = record("pool node")


@dataclass(frozen=True)
class JobSpec(schema.Record):
    """What a pool node needs to start as the job's ``--spare-node``: the launch line minus the script's secrets.

    ``run_key_box`` is the job's run key (text) sealed under the pool key (:func:`box`, AES-256-GCM): the pool node needs
    it to join the job's rendezvous, and nobody who can only read etcd may learn it. ``env`` is the worker
    environment minus secrets (``provenance.env_without_key`` and the etcd password)."""

    run_id: str
    endpoint: str
    # non-secret --rdzv-conf items (etcd_prefix, timeouts, cacert paths)
    rdzv_conf: str = field(metadata=wire(missing=""))
    nproc_per_node: Positive
    entrypoint: str
    args: tuple[str, ...] = field(metadata=wire(missing=()))
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = ""
    run_key_box: str = ""
    nnodes: str = "1"
    max_restarts: NonNegative = 0

    SCHEMA: ClassVar[schema.Schema] = record("job spec", versioned=False)


@dataclass(frozen=True)
class Claim(schema.Record):
    """``claims/<node_id>``: job ``job`` (its leader ``claimer``, priority ``priority``) holds pool node ``node_id``
    since ``since``. Bound to the claimer's lease."""

    node_id: str
    job: str
    claimer: str
    priority: int = field(metadata=wire(missing=0))
    since: float
    reason: str = field(metadata=wire(missing=""))
    # seconds from the job's need to this claim (the claim-wait gauge); keyword-only, its key comes before spec's
    waited: float = field(default=0.0, kw_only=True)
    spec: JobSpec | None = None
    released: str = ""          # why the job gave the node back (its ranks went home); "" while it holds it. A put,
                                # not a delete: a deleted claim is a claimer that died, which never stops a joined node
    kind: Annotated[str, OneOf(SPARE, MEMBER)] = field(default=SPARE, metadata=wire(omit_default=True))

    SCHEMA: ClassVar[schema.Schema] = record("pool claim")


@dataclass(frozen=True)
class PreemptRequest(schema.Record):
    """``preempt/<node_id>``: job ``job`` (priority ``priority``, its leader ``requester``) asks pool node ``node_id``
    to give up the lower-priority job it runs as a member, because ``reason``. Bound to the requester's lease."""

    node_id: str
    job: str
    requester: str
    priority: int
    since: float
    reason: str = ""

    SCHEMA: ClassVar[schema.Schema] = record("pool pre-emption request")


@dataclass(frozen=True)
class HistoryEntry(schema.Record):
    """``history/<time>-<node>``: one claim or release, for ``tpassctl pool status``."""

    time: float
    node_id: str
    event: str                  # "claimed", "released", "expired", "joined", "left"
    job: str | None = None
    detail: str = ""

    SCHEMA: ClassVar[schema.Schema] = record("pool history")


# ---------------------------------------------------------------------------------------------- the run key box
BOX_VERSION = "v2"
_BOX_LABEL = "pool/run-key-box/" + BOX_VERSION     # the box key: derived from the pool key for this use only
_BOX_AAD = b"tpassrun-pool-run-key-box/" + BOX_VERSION.encode()
_BOX_NONCE = 12


def box(key: provenance.RunKey, plaintext: str) -> str:
    """``plaintext`` sealed under the pool key: ``"v2:" + hex(nonce | AES-256-GCM(plaintext) | tag)``, the nonce
    random (96 bits: a pool key boxes a handful of run keys, never near GCM's bound on random nonces), the key
    derived from the pool key for this use only. The tag makes the box authenticated on its own (the sealed
    record's MAC covers it too)."""
    nonce = secrets.token_bytes(_BOX_NONCE)
    sealed = AESGCM(key.derive(_BOX_LABEL)).encrypt(nonce, plaintext.encode(), _BOX_AAD)
    return f"{BOX_VERSION}:{(nonce + sealed).hex()}"


def unbox(key: provenance.RunKey, boxed: str) -> str:
    """The run key in ``boxed``; :class:`RecordError` (one line) when it is not a v2 box this pool key sealed. A box
    of the tpassrun before v2 (plain hex, a home-made stream cipher) is refused as such, never decrypted into garbage."""
    version, sep, body = boxed.partition(":")
    if not sep:
        if _looks_like_v1(boxed):
            raise RecordError(f"the job's run key box was sealed by an older tpassrun (box v1), which this pool node "
                              f"no longer opens: restart the job with this tpassrun version ({BOX_VERSION} boxes)")
        raise RecordError("the run key box is not a tpassrun box")
    if version != BOX_VERSION:
        raise RecordError(f"the run key box is a {version!r} box; this tpassrun opens {BOX_VERSION} boxes: run the job "
                          "and the pool nodes with one tpassrun version")
    try:
        raw = bytes.fromhex(body)
    except ValueError:
        raise RecordError("the run key box is not hex") from None
    if len(raw) < _BOX_NONCE + 16:
        raise RecordError("the run key box is too short")
    try:
        return AESGCM(key.derive(_BOX_LABEL)).decrypt(raw[:_BOX_NONCE], raw[_BOX_NONCE:], _BOX_AAD).decode()
    except (InvalidTag, UnicodeDecodeError):
        raise RecordError("the run key box does not open with this pool key (another pool's, or altered)") from None


def _looks_like_v1(boxed: str) -> bool:
    """A v1 box: hex of a 16-byte nonce and the XORed text, nothing else."""
    try:
        return len(bytes.fromhex(boxed)) >= 16
    except ValueError:
        return False
