"""Provenance of the control-plane records that steer a swap: a MAC with a per-run key that is never in etcd.

An etcd without authentication (an external one, or a c10d/static endpoint hosted without a user and password)
lets anyone who can reach it write a swap plan or a report; without this, the job would act on it (a leader
would carry a forged plan on with a real spare), and anyone who could read it would read the transfer secret.
With a **run key**, every record whose forgery would move state or steer a swap carries
``"mac": "v1:<hex>"``, an HMAC-SHA256 over its canonical JSON and its etcd key, and every reader checks it
(:func:`tpassrun.records.fields.load`): a record with a missing or bad MAC is logged once and ignored, never
retried, adopted or shown as the job's own.

Which records are sealed, and why (``SEALED`` on the record type):

- ``swaps/`` (:class:`~tpassrun.records.swaps.SwapPlan`): the orders. A plan names who sends which rank's
  state where, and its ``secret`` seeds the transfer key.
- ``reports/`` (:class:`~tpassrun.records.swaps.Report`): the leader copies a report's ``joiner_addr`` (where
  state is streamed) and ``light_b64`` (the step, RNG and data position a joiner applies) into the plan.
- the rendezvous's own records: ``generation`` (members, addresses, the workers' store, assignments),
  ``bootstrap/<n>`` (where a generation's workers meet: their gloo peers' addresses come from it),
  ``nodes/<id>`` (who may be taken into a generation, at which address), ``leader``, ``closed``. The rendezvous
  never imports this module: the agent hands it these functions as a
  :class:`~tpassrun.rendezvous.guard.RecordGuard` (:func:`tpassrun.records.nodes.rendezvous_guard`).

Not sealed: taints, failures, status, health, fallbacks. They are the leader's *inputs*: a forged one can make
the job run a swap or a restart of its own making (with genuine plans, real spares, registered addresses and
transfer keys it derives itself), which is what deleting keys in such an etcd can do anyway; it cannot make
state leave the job or foreign state enter it. Taints are also the operator's channel (``tpassctl taint``),
which need not hold the run key. Only etcd authentication stops that kind of disruption.

The key: the embedded etcd's agent draws one and keeps it in memory (its etcd has per-run credentials too);
jobs of several agents give every agent the same one, from ``$TPASSRUN_RUN_KEY`` or ``--rdzv-conf
run_key_file=PATH`` (a file only its owner can read), never from the command line. Keys derived from it
(:meth:`RunKey.derive`): the records' MAC key, each plan's transfer seed, the shard mirror's key, so reading
etcd gives none of them.

Readers find the key of a record by its etcd key's run prefix (:func:`register`): one process may host several
agents (tests) or a ``tpassctl`` reading one run.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tpassrun.settings import envnames as E

RUN_KEY_ENV = E.TPASSRUN_RUN_KEY
RUN_KEY_FILE_CONF = "run_key_file"          # --rdzv-conf run_key_file=PATH
MAC_FIELD = "mac"
MAC_VERSION = "v1"
MIN_KEY_CHARS = 16


class RunKeyError(ValueError):
    """A run key that cannot be used (too short, unreadable file)."""


@dataclass(frozen=True)
class RunKey:
    """The run's root secret (never on a command line; written by tpassrun only for a run on its own embedded etcd,
    0600 beside that etcd's password)."""

    root: bytes = field(repr=False)

    @classmethod
    def from_text(cls, text: str, where: str = "the run key") -> "RunKey":
        material = text.strip()
        if len(material) < MIN_KEY_CHARS:
            raise RunKeyError(f"{where} is too short ({len(material)} characters; at least {MIN_KEY_CHARS}: "
                              f"e.g. `openssl rand -hex 32`)")
        return cls(hmac.new(b"tpassrun-run-key/v1", material.encode(), hashlib.sha256).digest())

    @classmethod
    def generate(cls) -> "RunKey":
        return cls(secrets.token_bytes(32))

    def derive(self, label: str) -> bytes:
        """A key for one purpose; knowing one derived key tells nothing of the root or the others."""
        return hmac.new(self.root, label.encode(), hashlib.sha256).digest()

    @property
    def fingerprint(self) -> str:
        """Safe to show or publish: tells agents with different keys apart."""
        return self.derive("fingerprint").hex()[:12]


def run_key_from(conf: Mapping[str, str], environ: Mapping[str, str],
                 read_file: Callable[[str, str], str]) -> RunKey | None:
    """The run key a job was given: ``--rdzv-conf run_key_file=PATH`` (``read_file`` refuses a file others can
    read), else ``$TPASSRUN_RUN_KEY``; None when neither."""
    path = conf.get(RUN_KEY_FILE_CONF)
    if path:
        return RunKey.from_text(read_file(path, "run key file"), f"the run key file {path}")
    if environ.get(RUN_KEY_ENV):
        return RunKey.from_text(environ[RUN_KEY_ENV], f"${RUN_KEY_ENV}")
    return None


# ---------------------------------------------------------------------------------------------- the MAC
def _message(etcd_key: str, doc: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != MAC_FIELD}
    # the etcd key is bound too: a genuine record copied under another key (another swap's id) is refused
    return (f"tpassrun-record/{MAC_VERSION}\0{etcd_key}\0".encode()
            + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def mac_of(etcd_key: str, doc: Mapping[str, Any], key: RunKey) -> str:
    tag = hmac.new(key.derive("records"), _message(etcd_key, doc), hashlib.sha256).hexdigest()
    return f"{MAC_VERSION}:{tag}"


def seal(etcd_key: str, doc: Mapping[str, Any], key: RunKey | None = None) -> dict[str, Any]:
    """``doc`` with its MAC (the key registered for ``etcd_key``'s run when not given); unchanged without one."""
    key = key or key_for(etcd_key)
    out = {k: v for k, v in doc.items() if k != MAC_FIELD}
    if key is not None:
        out[MAC_FIELD] = mac_of(etcd_key, out, key)
    return out


def problem(etcd_key: str, doc: Any, key: RunKey) -> str | None:
    """Why ``doc`` is not a record this run wrote (None: its MAC is good)."""
    if not isinstance(doc, Mapping):
        return None     # not even an object: the record's own validation says so
    given = doc.get(MAC_FIELD)
    if given is None:
        return "it carries no MAC (written by someone without the run key)"
    if not isinstance(given, str) or not given.startswith(MAC_VERSION + ":"):
        return f"its MAC is not a {MAC_VERSION} MAC"
    if not hmac.compare_digest(given, mac_of(etcd_key, doc, key)):
        return "its MAC does not match (forged, altered, moved from another key, or an agent with another run key)"
    return None


def sealed_with_another_key(etcd_key: str, doc: Any, key: RunKey) -> bool:
    """Whether ``doc`` carries a well-formed MAC that ``key`` did not make: what an agent given another run key
    writes (a forgery can look the same; a record without a MAC is a stranger's, not this)."""
    given = doc.get(MAC_FIELD) if isinstance(doc, Mapping) else None
    if not isinstance(given, str) or not given.startswith(MAC_VERSION + ":") or len(given) != len(MAC_VERSION) + 65:
        return False
    return not hmac.compare_digest(given, mac_of(etcd_key, doc, key))


def carries_mac(doc: Any) -> bool:
    """Whether ``doc`` was sealed by someone (checked or not)."""
    return isinstance(doc, Mapping) and MAC_FIELD in doc


# ---------------------------------------------------------------------------------------------- registry
_REGISTERED: list[tuple[str, RunKey]] = []


def register(prefix: str, key: RunKey) -> Callable[[], None]:
    """Records under ``prefix`` (a run's etcd prefix) are sealed and checked with ``key`` in this process until
    the returned callable is called."""
    entry = (prefix, key)
    _REGISTERED.append(entry)

    def unregister() -> None:
        if entry in _REGISTERED:
            _REGISTERED.remove(entry)
    return unregister


def key_for(etcd_key: str) -> RunKey | None:
    """The run key registered for the run ``etcd_key`` belongs to (the latest registration wins)."""
    for prefix, key in reversed(_REGISTERED):
        if etcd_key.startswith(prefix):
            return key
    return None


def env_without_key(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment minus the run key and a spare pool's key (workers run user code: they never need them)."""
    return {k: v for k, v in environ.items() if k not in (RUN_KEY_ENV, E.TPASSRUN_POOL_KEY)}
