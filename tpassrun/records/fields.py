"""What every control-plane record shares: the schema version, :class:`RecordError`, :func:`record` (a record
type's schema for the one codec, :mod:`tpassrun.schema`), and :func:`load` (a malformed value is skipped and
logged once, never fatal).

The record types themselves are in ``faults`` (taints, failures, fallbacks), ``nodes`` (status, health, the run's
end), ``swaps`` (swap plans and reports) and ``pool``, each declared once and read and written by the one codec;
:mod:`tpassrun.records` re-exports them with the key layout.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, TypeVar

from tpassrun.records import provenance
from tpassrun.schema import Schema, SchemaError

log = logging.getLogger("tpassrun.records")

SCHEMA_VERSION = 1


class RecordError(SchemaError):
    """A value in etcd that is not a valid record of the expected type (wrong shape, type or version)."""


class UnauthenticatedRecord(RecordError):
    """A record of a sealed type (see :mod:`tpassrun.records.provenance`) without a good MAC of this run's key."""


def record(what: str, *, versioned: bool = True, named_by: str | None = None,
           check: Callable[[Any], str | None] | None = None) -> Schema:
    """The schema of a record type (its ``SCHEMA``): ``{"v": 1, ...}`` unless ``versioned`` is False (a record
    only ever nested in another), read strictly into :class:`RecordError`."""
    return Schema(what, version=SCHEMA_VERSION if versioned else None, error=RecordError, named_by=named_by,
                  check=check)


# ---------------------------------------------------------------------------------------------- validation
def _check(doc: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise RecordError(f"{what}: not a JSON object ({type(doc).__name__})")
    if doc.get("v") != SCHEMA_VERSION:
        raise RecordError(f"{what}: schema version {doc.get('v')!r}; this tpassrun reads v{SCHEMA_VERSION}")
    return doc


R = TypeVar("R")

_REPORTED: dict[str, int] = {}
_REPORTED_MAX = 1024


def load(decode: Callable[[Any], R], key: str, doc: Any, revision: int = 0) -> R | None:
    """``decode(doc)``, or None for a malformed value, or for a sealed record type (``SEALED``: swap plans,
    reports, the rendezvous's records) without a good MAC of the run key registered for ``key``
    (:mod:`tpassrun.records.provenance`); either is
    logged once per key and revision.

    One bad value must neither stop a reader nor flood the log: the coordinator re-reads every family on
    every change, a dashboard every half second.
    """
    try:
        run_key = _run_key_of(decode, key)
        if run_key is not None and (why := provenance.problem(key, doc, run_key)) is not None:
            raise UnauthenticatedRecord(why)
        record = decode(doc)
        if run_key is not None and hasattr(record, "with_run_key"):
            record = record.with_run_key(run_key)   # keys it derives from its own fields and the run key
        return record
    except RecordError as exc:
        if _REPORTED.get(key) != revision:
            if len(_REPORTED) >= _REPORTED_MAX:
                _REPORTED.pop(next(iter(_REPORTED)))
            _REPORTED[key] = revision
            if isinstance(exc, UnauthenticatedRecord):
                log.warning("refusing etcd record %s (revision %d): %s; ignored", key, revision, exc)
            else:
                log.warning("ignoring malformed etcd value %s (revision %d): %s", key, revision, exc)
        return None


def _run_key_of(decode: Callable[[Any], Any], key: str) -> "provenance.RunKey | None":
    """The run key to check ``key``'s record with: only for sealed record types (``SEALED`` on the type whose
    ``from_json`` decodes it, or on a decoding function: :func:`sealed`), and only when this process registered a
    key for that run."""
    owner = getattr(decode, "__self__", None)
    is_sealed = getattr(decode, "SEALED", False) or getattr(owner, "SEALED", False)
    return provenance.key_for(key) if is_sealed else None


F = TypeVar("F", bound=Callable[..., Any])


def sealed(decode: F) -> F:
    """Marks a decoding function (not a record type's ``from_json``) as one of a sealed record: :func:`load` checks
    the record's MAC before it decodes it, as for a type with ``SEALED``."""
    decode.SEALED = True   # type: ignore[attr-defined]
    return decode
