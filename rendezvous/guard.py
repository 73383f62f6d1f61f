"""Who wrote a rendezvous record: the seal this run's agents put on what they write, checked on every read.

On an etcd without authentication anyone who can write to it could otherwise hand a new generation's workers an
attacker's store (``bootstrap/<n>``), steer every agent with a forged ``generation``, slip a node of their own into
one (``nodes/<id>``), or take ``leader`` and ``closed``. With a run key every record the rendezvous writes carries
a MAC bound to its etcd key, and every read checks it.

The rendezvous never imports the rest of tpassrun, so it does not know the key: the agent injects a
:class:`RecordGuard` (``tpassrun.records.nodes.rendezvous_guard``). The default guard seals nothing and refuses
nothing: a run without a key behaves as it always did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

# What an agent told that the job's records carry another key's seal should do about it (one line, no traceback).
SAME_KEY_HINT = "give every agent the same run key: --rdzv-conf run_key_file=PATH or $TPASSRUN_RUN_KEY"


def _as_is(_etcd_key: str, doc: dict[str, Any]) -> dict[str, Any]:
    return doc


def _nothing(_etcd_key: str, _doc: Any) -> str | None:
    return None


@dataclass(frozen=True)
class RecordGuard:
    """The run's seal on the rendezvous's records (keys: ``generation``, ``bootstrap/<n>``, ``nodes/<id>``,
    ``leader``, ``closed``).

    ``seal(etcd_key, doc)``: the document as written (with its MAC). ``problem(etcd_key, doc)``: why a record read
    is not this run's (None: it is); such a record is treated as absent or malformed, never acted on.
    ``foreign(etcd_key, doc)``: why a record shows agents that seal with another key than this one (a MAC of the
    right form that this key did not make; for an agent without a key, any MAC), said as a phrase after the
    record's name ("was sealed with another run key"). A record without any MAC is a stranger's, not foreign.
    """

    seal: Callable[[str, dict[str, Any]], dict[str, Any]] = _as_is
    problem: Callable[[str, Any], str | None] = _nothing
    foreign: Callable[[str, Any], str | None] = _nothing


class RefusalLog:
    """Says each refused or unreadable record once per (etcd key, revision): readers re-read on every change, and
    one bad value must neither flood the log nor go unsaid."""

    MAX = 1024

    def __init__(self) -> None:
        self._said: dict[str, int] = {}

    def say(self, key: str, revision: int, text: str) -> None:
        if self._said.get(key) == revision:
            return
        if len(self._said) >= self.MAX:
            self._said.pop(next(iter(self._said)))
        self._said[key] = revision
        log.warning("%s", text)


def named(node_id: Any, what: str) -> str:
    """``node X's <what>`` for a record that names its node (not yet trusted: shown, never parsed), else ``the
    <what>``."""
    if isinstance(node_id, str) and node_id and node_id.isprintable():
        return f"node {node_id[:80]}'s {what}"
    return f"the {what}"
