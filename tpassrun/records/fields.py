"""What every control-plane record shares: the schema version, :class:`RecordError`, the strict field readers
each ``from_json`` uses, and :func:`load` (a malformed value is skipped and logged once, never fatal).

The record types themselves are in ``records_faults`` (taints, failures, fallbacks), ``records_nodes`` (status,
health, the run's end) and ``records_swaps`` (swap plans and reports); :mod:`tpassrun.records` re-exports them
with the key layout.
"""

from __future__ import annotations

import enum
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


def _str(doc: Mapping[str, Any], key: str, what: str, default: str | None = None) -> str:
    value = doc.get(key, default)
    if not isinstance(value, str):
        raise RecordError(f"{what}: {key} must be a string, not {value!r}")
    return value


def _opt_str(doc: Mapping[str, Any], key: str, what: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise RecordError(f"{what}: {key} must be a string or null, not {value!r}")
    return value


def _int(doc: Mapping[str, Any], key: str, what: str, default: int | None = None, *, minimum: int | None = None) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{what}: {key} must be an integer, not {value!r}")
    if minimum is not None and value < minimum:
        raise RecordError(f"{what}: {key} must be >= {minimum}, not {value}")
    return value


def _opt_int(doc: Mapping[str, Any], key: str, what: str, *, minimum: int | None = None) -> int | None:
    return None if doc.get(key) is None else _int(doc, key, what, minimum=minimum)


def _opt_ranks(doc: Mapping[str, Any], key: str, what: str) -> tuple[int, ...] | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                              for r in value):
        raise RecordError(f"{what}: {key} must be a list of ranks or null, not {value!r:.80}")
    return tuple(value)


def _num(doc: Mapping[str, Any], key: str, what: str, default: float = 0.0) -> float:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{what}: {key} must be a number, not {value!r}")
    return float(value)


def _bool(doc: Mapping[str, Any], key: str, what: str, default: bool = False) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise RecordError(f"{what}: {key} must be true or false, not {value!r}")
    return value


def _list(doc: Mapping[str, Any], key: str, what: str) -> list[Any]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise RecordError(f"{what}: {key} must be a list, not {value!r}")
    return value


def _enum(cls: type[E], doc: Mapping[str, Any], key: str, what: str) -> E:
    try:
        return cls(doc.get(key))
    except ValueError:
        raise RecordError(f"{what}: {key} {doc.get(key)!r} is not one of "
                          f"{', '.join(m.value for m in cls)}") from None


def _addr(value: Any, what: str) -> tuple[str, int] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str)
            or isinstance(value[1], bool) or not isinstance(value[1], int) or not 0 < value[1] < 65536):
        raise RecordError(f"{what}: an address must be [host, port], not {value!r}")
    return value[0], value[1]


E = TypeVar("E", bound=enum.Enum)
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
