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
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from tpassrun.records import provenance
from tpassrun.records.fields import SCHEMA_VERSION, RecordError, _check, _int, _num, _opt_str, _str

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

    def history_entry(self, when: float, node_id: str) -> str:
        return self.history + f"{when:017.6f}-{_part(node_id)}"


def _part(text: str) -> str:
    if not text or "/" in text:
        raise ValueError(f"{text!r} cannot be one part of an etcd key")
    return text


# ---------------------------------------------------------------------------------------------- sealing
def seal(key: provenance.RunKey, etcd_key: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    return provenance.seal(etcd_key, doc, key)


def load_sealed(key: provenance.RunKey, etcd_key: str, doc: Any) -> Mapping[str, Any]:
    """``doc`` if it carries a good pool-key MAC for ``etcd_key``; :class:`RecordError` with the reason otherwise."""
    why = provenance.problem(etcd_key, doc, key)
    if why is not None:
        raise RecordError(f"{etcd_key}: {why}")
    return _check(doc, etcd_key)


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class PoolInfo:
    name: str
    created: float
    fingerprint: str           # the pool key's (safe to show): tells pools of different keys apart

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "PoolInfo":
        w = "pool info"
        return cls(name=_str(doc, "name", w), created=_num(doc, "created", w), fingerprint=_str(doc, "fingerprint", w))


IDLE = "idle"
SERVING = "serving"


@dataclass(frozen=True)
class PoolNode:
    """``nodes/<node_id>``: a pool node, idle or serving the job named by ``job``."""

    node_id: str
    host: str
    nproc: int                 # worker slots it can start (the job's --nproc-per-node must fit)
    since: float
    state: str = IDLE
    job: str | None = None
    agent: str | None = None   # serving: the node id its spare node has in the job (once joined; the job's view
                               # names the node by it)

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "PoolNode":
        w = "pool node"
        state = _str(doc, "state", w, IDLE)
        if state not in (IDLE, SERVING):
            raise RecordError(f"{w}: state {state!r} is not idle or serving")
        return cls(node_id=_str(doc, "node_id", w), host=_str(doc, "host", w), nproc=_int(doc, "nproc", w, minimum=1),
                   since=_num(doc, "since", w), state=state, job=_opt_str(doc, "job", w),
                   agent=_opt_str(doc, "agent", w))


@dataclass(frozen=True)
class JobSpec:
    """What a pool node needs to start as the job's ``--spare-node``: the launch line minus the script's secrets.

    ``run_key_box`` is the job's run key (text) encrypted under the pool key (:func:`box`): the pool node needs
    it to join the job's rendezvous, and nobody who can only read etcd may learn it. ``env`` is the worker
    environment minus secrets (``provenance.env_without_key`` and the etcd password)."""

    run_id: str
    endpoint: str
    rdzv_conf: str              # non-secret --rdzv-conf items (etcd_prefix, timeouts, cacert paths)
    nproc_per_node: int
    entrypoint: str
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = ""
    run_key_box: str = ""
    nnodes: str = "1"
    max_restarts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "endpoint": self.endpoint, "rdzv_conf": self.rdzv_conf,
                "nproc_per_node": self.nproc_per_node, "entrypoint": self.entrypoint, "args": list(self.args),
                "env": dict(self.env), "cwd": self.cwd, "run_key_box": self.run_key_box,
                "nnodes": self.nnodes, "max_restarts": self.max_restarts}

    @classmethod
    def from_json(cls, doc: Any) -> "JobSpec":
        w = "job spec"
        if not isinstance(doc, Mapping):
            raise RecordError(f"{w}: not an object")
        args, env = doc.get("args", []), doc.get("env", {})
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise RecordError(f"{w}: args must be a list of strings")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise RecordError(f"{w}: env must map strings to strings")
        return cls(run_id=_str(doc, "run_id", w), endpoint=_str(doc, "endpoint", w),
                   rdzv_conf=_str(doc, "rdzv_conf", w, ""), nproc_per_node=_int(doc, "nproc_per_node", w, minimum=1),
                   entrypoint=_str(doc, "entrypoint", w), args=tuple(args), env=dict(env), cwd=_str(doc, "cwd", w, ""),
                   run_key_box=_str(doc, "run_key_box", w, ""), nnodes=_str(doc, "nnodes", w, "1"),
                   max_restarts=_int(doc, "max_restarts", w, 0, minimum=0))


@dataclass(frozen=True)
class Claim:
    """``claims/<node_id>``: job ``job`` (its leader ``claimer``, priority ``priority``) holds pool node ``node_id``
    since ``since``. Bound to the claimer's lease."""

    node_id: str
    job: str
    claimer: str
    priority: int
    since: float
    reason: str
    spec: JobSpec | None = None
    waited: float = 0.0         # seconds from the job's need to this claim (the claim-wait gauge)
    released: str = ""          # why the job gave the node back (its ranks went home); "" while it holds it. A put,
                                # not a delete: a deleted claim is a claimer that died, which never stops a joined node

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "node_id": self.node_id, "job": self.job, "claimer": self.claimer,
                "priority": self.priority, "since": self.since, "reason": self.reason, "waited": self.waited,
                "spec": self.spec.to_json() if self.spec is not None else None, "released": self.released}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "Claim":
        w = "pool claim"
        spec = doc.get("spec")
        return cls(node_id=_str(doc, "node_id", w), job=_str(doc, "job", w), claimer=_str(doc, "claimer", w),
                   priority=_int(doc, "priority", w, 0), since=_num(doc, "since", w), reason=_str(doc, "reason", w, ""),
                   spec=JobSpec.from_json(spec) if spec is not None else None, waited=_num(doc, "waited", w, 0.0),
                   released=_str(doc, "released", w, ""))


@dataclass(frozen=True)
class HistoryEntry:
    """``history/<time>-<node>``: one claim or release, for ``tpassctl pool status``."""

    time: float
    node_id: str
    event: str                  # "claimed", "released", "expired", "joined", "left"
    job: str | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "HistoryEntry":
        w = "pool history"
        return cls(time=_num(doc, "time", w), node_id=_str(doc, "node_id", w), event=_str(doc, "event", w),
                   job=_opt_str(doc, "job", w), detail=_str(doc, "detail", w, ""))


# ---------------------------------------------------------------------------------------------- the run key box
def box(key: provenance.RunKey, plaintext: str) -> str:
    """``plaintext`` encrypted under the pool key: a random nonce, an HMAC-SHA256 keystream (counter mode) XORed
    in. Its integrity is the sealed record's MAC (encrypt-then-MAC); the keystream key is derived for this use
    only."""
    nonce = secrets.token_bytes(16)
    data = plaintext.encode()
    return (nonce + _xor(key, nonce, data)).hex()


def unbox(key: provenance.RunKey, boxed: str) -> str:
    try:
        raw = bytes.fromhex(boxed)
    except ValueError:
        raise RecordError("the run key box is not hex") from None
    if len(raw) < 16:
        raise RecordError("the run key box is too short")
    try:
        return _xor(key, raw[:16], raw[16:]).decode()
    except UnicodeDecodeError:
        raise RecordError("the run key box does not open with this pool key") from None


def _xor(key: provenance.RunKey, nonce: bytes, data: bytes) -> bytes:
    stream_key = key.derive("pool/run-key-box")
    out = bytearray()
    for block in range(0, len(data), 32):
        pad = hmac.new(stream_key, nonce + block.to_bytes(8, "big"), hashlib.sha256).digest()
        out += bytes(a ^ b for a, b in zip(data[block:block + 32], pad))
    return bytes(out)
