"""The metas of the mirror's frames (:mod:`tpassrun.mirror.net`'s wire), each declared once for the one codec
(:mod:`tpassrun.schema`): what a request asks for and what its answer says. The head, payload and tag around
them are fixed binary framing (``struct``), not here.

A meta is compact UTF-8 JSON, its keys in the order the fields are declared. A request the server cannot read is
answered BAD_REQUEST with the one-line :class:`~tpassrun.mirror.store.MirrorMetaError`; an answer the client cannot
read is that error on the client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from tpassrun.mirror.store import MirrorEntry, MirrorMetaError
from tpassrun.schema import Schema, dump, load

T = TypeVar("T")

MAX_KIND = 256       # a kind is a short string ("light", "shard/<name>")


def _request(any_kind: bool) -> Schema:
    """A request's schema: its ``kind`` a short string (or None, for any kind, when ``any_kind``)."""
    def problem(request: Any) -> str | None:
        kind = request.kind
        if (kind is None and any_kind) or (kind and len(kind) <= MAX_KIND):
            return None
        return f"kind must be a short string, not {kind!r:.80}"
    return Schema(what="mirror request", error=MirrorMetaError, check=problem)


_ONE_KIND, _ANY_KIND = _request(False), _request(True)
_ANSWER = Schema(what="mirror answer", error=MirrorMetaError)


# --------------------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class CopyRef:
    """PUT and PUSH: the copy the payload is."""

    SCHEMA: ClassVar[Schema] = _ONE_KIND

    owner: int
    kind: str
    version: int
    epoch: int


@dataclass(frozen=True)
class Get:
    """GET: that version and epoch, or the newest (None)."""

    SCHEMA: ClassVar[Schema] = _ONE_KIND

    owner: int
    kind: str
    version: int | None
    epoch: int | None


@dataclass(frozen=True)
class Select:
    """LIST: the rows of that owner and kind (None: any)."""

    SCHEMA: ClassVar[Schema] = _ANY_KIND

    owner: int | None
    kind: str | None


@dataclass(frozen=True)
class Drop:
    """DROP: the copies of that owner and kind (None: any), of epochs below ``below_epoch`` (None: all)."""

    SCHEMA: ClassVar[Schema] = _ANY_KIND

    owner: int | None
    kind: str | None
    below_epoch: int | None


# --------------------------------------------------------------------------------------------- answers
@dataclass(frozen=True)
class Stored:
    """PUT, OK: whether the copy was kept (not when older than both versions held)."""

    SCHEMA: ClassVar[Schema] = _ANSWER

    kept: bool


@dataclass(frozen=True)
class Failed:
    """Any op, REFUSED or BAD_REQUEST: why."""

    SCHEMA: ClassVar[Schema] = _ANSWER

    error: str = ""


@dataclass(frozen=True)
class Got:
    """GET, OK: the copy's version and epoch (its bytes are the payload)."""

    SCHEMA: ClassVar[Schema] = _ANSWER

    version: int
    epoch: int


@dataclass(frozen=True)
class NotFound:
    """GET, NOT_FOUND: nothing (``{}``)."""

    SCHEMA: ClassVar[Schema] = _ANSWER


@dataclass(frozen=True)
class Listing:
    """LIST, OK: the rows, the bytes the store holds and its bound."""

    SCHEMA: ClassVar[Schema] = _ANSWER

    entries: tuple[MirrorEntry, ...]
    bytes: int
    max_bytes: int


@dataclass(frozen=True)
class Dropped:
    """DROP, OK: the bytes freed."""

    SCHEMA: ClassVar[Schema] = _ANSWER

    freed: int


# --------------------------------------------------------------------------------------------- bytes
def encode(meta: Any) -> bytes:
    """A meta (one of the types above) as the frame carries it."""
    return json.dumps(dump(meta), separators=(",", ":")).encode()


def parse(raw: bytes) -> Any:
    """A frame's meta bytes as JSON (empty: ``{}``); :class:`MirrorMetaError` when they are not JSON."""
    try:
        return json.loads(raw) if raw else {}
    except ValueError as exc:
        raise MirrorMetaError(f"malformed mirror frame meta: {str(exc).splitlines()[0]}") from None


def read(cls: type[T], raw: bytes) -> T:
    """A frame's meta bytes read as a ``cls``; :class:`MirrorMetaError` for anything else."""
    return load(cls, parse(raw))


__all__ = ["CopyRef", "Dropped", "Drop", "Failed", "Get", "Got", "Listing", "MAX_KIND", "NotFound", "Select", "Stored",
           "encode", "parse", "read"]
