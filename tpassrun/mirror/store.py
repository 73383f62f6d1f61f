"""The mirror store: in-memory copies of per-rank state, newest two complete versions per (rank, kind), bounded.

See :mod:`tpassrun.mirror` for the API and its rules; :mod:`tpassrun.mirror.net` serves a store to the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tpassrun.schema import Record, Schema, SchemaError
from tpassrun.transfer import HandoffError

DEFAULT_MAX_BYTES = 1 << 30


class MirrorError(HandoffError):
    """A mirror request failed (connection lost, refused, malformed)."""


class MirrorMetaError(MirrorError, SchemaError):
    """A frame's meta that is not the value its op carries (the one codec's error, one line)."""


class MirrorFull(MirrorError):
    """The store refused a put: it would exceed its memory bound, or its epoch is stale."""


@dataclass(frozen=True)
class MirrorItem:
    owner: int
    kind: str
    version: int
    epoch: int
    data: bytes


@dataclass(frozen=True)
class MirrorEntry(Record):
    """What a store holds for one (owner, kind): its epoch, complete versions (ascending) and bytes."""

    SCHEMA: ClassVar[Schema] = Schema(what="mirror listing row", error=MirrorMetaError)

    owner: int
    kind: str
    epoch: int
    versions: tuple[int, ...]
    nbytes: int


# ---------------------------------------------------------------------------------------------- the store
class _Held:
    __slots__ = ("epoch", "versions")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.versions: dict[int, bytes] = {}

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.versions.values())


class MirrorStore:
    """In-memory copies keyed by (owner, kind): newest two complete versions each, ``max_bytes`` in all.

    Not thread-safe: the agent uses it from its event loop only (the server runs there too)."""

    KEEP = 2

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._held: dict[tuple[int, str], _Held] = {}
        self._bytes = 0
        self.reserved = 0                 # bytes of puts still arriving (counted against max_bytes)

    @property
    def nbytes(self) -> int:
        return self._bytes

    # --- admission -------------------------------------------------------------------------------------
    def _freed_by(self, owner: int, kind: str, version: int, epoch: int) -> int:
        held = self._held.get((owner, kind))
        if held is None:
            return 0
        if epoch > held.epoch:
            return held.nbytes
        if version in held.versions:
            return len(held.versions[version])
        if len(held.versions) >= self.KEEP and version > min(held.versions):
            return len(held.versions[min(held.versions)])
        return 0

    def admit(self, owner: int, kind: str, version: int, epoch: int, nbytes: int) -> str | None:
        """Make room for a put of ``nbytes`` (evicting older epochs' copies); None if it fits, else why not."""
        held = self._held.get((owner, kind))
        if held is not None and epoch < held.epoch:
            return f"stale epoch {epoch} for rank {owner}/{kind} (the store holds epoch {held.epoch})"
        need = nbytes - self._freed_by(owner, kind, version, epoch)
        if self._bytes + self.reserved + need <= self.max_bytes:
            return None
        newest = max((h.epoch for h in self._held.values()), default=epoch)
        for key in [k for k, h in self._held.items() if h.epoch < max(newest, epoch) and k != (owner, kind)]:
            self._drop(key)
            if self._bytes + self.reserved + need <= self.max_bytes:
                return None
        return (f"a copy of {nbytes} bytes for rank {owner}/{kind} does not fit: {self._bytes} held, "
                f"{self.reserved} arriving, limit {self.max_bytes}")

    # --- the operations --------------------------------------------------------------------------------
    def put(self, owner: int, kind: str, version: int, payload: bytes | bytearray | memoryview,
            epoch: int = 0) -> bool:
        """Keep a complete copy; True if kept (False: older than both versions held). Raises MirrorFull."""
        data = payload if isinstance(payload, bytes) else bytes(payload)
        why = self.admit(owner, kind, version, epoch, len(data))
        if why is not None:
            raise MirrorFull(why)
        return self._commit(owner, kind, version, epoch, data)

    def _commit(self, owner: int, kind: str, version: int, epoch: int, data: bytes) -> bool:
        key = (owner, kind)
        held = self._held.get(key)
        if held is None or epoch > held.epoch:
            if held is not None:
                self._drop(key)
            held = self._held[key] = _Held(epoch)
        elif epoch < held.epoch:
            raise MirrorFull(f"stale epoch {epoch} for rank {owner}/{kind} (the store holds epoch {held.epoch})")
        if version not in held.versions and len(held.versions) >= self.KEEP and version < min(held.versions):
            return False
        old = held.versions.pop(version, None)
        if old is not None:
            self._bytes -= len(old)
        held.versions[version] = data
        self._bytes += len(data)
        while len(held.versions) > self.KEEP:
            gone = held.versions.pop(min(held.versions))
            self._bytes -= len(gone)
        return True

    def get(self, owner: int, kind: str, version: int | None = None, epoch: int | None = None) -> MirrorItem | None:
        held = self._held.get((owner, kind))
        if held is None or not held.versions or (epoch is not None and held.epoch != epoch):
            return None
        v = max(held.versions) if version is None else version
        data = held.versions.get(v)
        return None if data is None else MirrorItem(owner, kind, v, held.epoch, data)

    def versions(self, owner: int, kind: str, epoch: int | None = None) -> tuple[int, ...]:
        held = self._held.get((owner, kind))
        if held is None or (epoch is not None and held.epoch != epoch):
            return ()
        return tuple(sorted(held.versions))

    def usage(self, owner: int | None = None, kind: str | None = None) -> list[MirrorEntry]:
        return [MirrorEntry(o, k, h.epoch, tuple(sorted(h.versions)), h.nbytes)
                for (o, k), h in sorted(self._held.items())
                if (owner is None or o == owner) and (kind is None or k == kind)]

    def bytes_held(self, owner: int | None = None, kind: str | None = None) -> int:
        return sum(e.nbytes for e in self.usage(owner, kind))

    def drop(self, owner: int | None = None, kind: str | None = None, below_epoch: int | None = None) -> int:
        """Forget matching copies (``below_epoch``: only those of older epochs); returns the bytes freed."""
        before = self._bytes
        for key in [k for k, h in self._held.items() if (owner is None or k[0] == owner)
                    and (kind is None or k[1] == kind) and (below_epoch is None or h.epoch < below_epoch)]:
            self._drop(key)
        return before - self._bytes

    def _drop(self, key: tuple[int, str]) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= held.nbytes


__all__ = ["DEFAULT_MAX_BYTES", "MirrorEntry", "MirrorError", "MirrorFull", "MirrorItem", "MirrorStore"]
