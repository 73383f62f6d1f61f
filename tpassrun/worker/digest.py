"""Replica digests: after every swap or recovery, the ranks that must hold identical state say so, exactly.

What is compared: on each rank, every tracked object that its data-parallel replicas hold identically (model,
optimizer, schedulers, scaler, ``track_replicated`` objects; sharded state too when the rank declared a replica
group, ``Session.declare_replicas``), never the per-rank state (RNG, data position) nor a shard no other rank
holds. Its replica group is the declared one, or the whole world when nothing was declared (plain data
parallelism, the same assumption a recovery's donor choice makes).

The digest of a tensor (:func:`tensor_digest`) is exact to the bit and cheap: its bytes as 64-bit words laid out
in rows of 8 KiB, the wrapping sums of every row and of every column (two torch reductions, at memory speed, on
whatever device the tensor lives: nothing is copied to the host but the sums), the bytes that do not fill a
row, its dtype and shape, through BLAKE2b. Equal tensors give equal digests; any change confined to one word
(a flipped bit, a last-ulp difference), words moved to another row or another column, a different shape or
dtype all change it. Not detected: changes that cancel exactly (modulo 2**64) in every row and column sum they
touch, at least four words forming a rectangle - not how replicas diverge. The non-tensor values of an object
(an optimizer's hyper-parameters, a scheduler's counters) are digested as their canonical JSON.

The decision (:func:`decide`, :func:`repair_plan`) is pure: the same on every rank, from what every rank says.
In each replica group a strict majority of ranks that agree is right; without one, the only side with no rank
that has just loaded its state (a joiner, a survivor caught up or rolled back) is right, since the state that
was just moved is the suspect; otherwise no replica can be trusted and the group restarts. The worker's side
(the collectives, the repair, the report) is :mod:`tpassrun.worker.replicas`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

ROW_WORDS = 1024          # 8 KiB rows: the row sums are 1/1024 of the data, the column sums 8 KiB
VALUES = "(values)"       # an object's leaf name for its non-tensor values
SHOWN = 6                 # tensor names a console line shows per rank (the event holds more)


# --------------------------------------------------------------------------------------------- digests

def tensor_digest(tensor: Any) -> str:
    """The tensor's exact digest (32 hex digits); see the module doc."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}".encode())
    rows = raw.numel() // (8 * ROW_WORDS)
    if rows:
        if raw.storage_offset() % 8:
            raw = raw.clone()                          # a view into a flat buffer at an odd offset: align it
        words = raw[:rows * 8 * ROW_WORDS].view(torch.int64).view(rows, ROW_WORDS)
        h.update(host_bytes(words.sum(dim=1)))        # integer sums: exact, the same in any order
        h.update(host_bytes(words.sum(dim=0)))
    h.update(host_bytes(raw[rows * 8 * ROW_WORDS:]))
    return h.hexdigest()


def host_bytes(t: Any) -> bytes:
    """A tensor's bytes, copied to the host once (memcpy: neither numpy nor a byte-by-byte storage walk)."""
    import ctypes

    import torch

    if not t.numel():
        return b""
    host = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return ctypes.string_at(host.data_ptr(), host.numel())


@dataclass
class LocalDigest:
    """One rank's digest of the state it shares with its replicas."""

    leaves: dict[str, dict[str, str]] = field(default_factory=dict)   # object -> leaf name -> digest
    nbytes: int = 0
    error: str = ""

    @property
    def summary(self) -> bytes:
        """16 bytes standing for every leaf (names and digests)."""
        h = hashlib.blake2b(digest_size=16)
        h.update(json.dumps(self.leaves, sort_keys=True, separators=(",", ":")).encode())
        return h.digest()


def named_tensors(name: str, obj: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """``obj.state_dict()`` as the handoff codec encodes it (raises its ``HandoffError``), and each tensor leaf with
    its path (``model.fc1.weight``, ``optimizer.state.0.exp_avg``): a tensor met twice (tied weights) once, under
    its first path."""
    from tpassrun.transfer import TreeEncoder

    encoder = TreeEncoder()
    tree = encoder.encode(obj.state_dict(), name)
    paths: dict[int, str] = {}
    _tensor_paths(tree, name, paths)
    return tree, [(paths.get(i, f"{name}.#{i}"), t) for i, t in enumerate(encoder.tensors)]


def state_digest(objects: Mapping[str, Any]) -> LocalDigest:
    """Digest every object's ``state_dict()``: each tensor leaf by its path, the non-tensor values as one leaf
    (:data:`VALUES`). An object whose state the handoff codec refuses is one leaf saying so (its replicas refuse
    it alike)."""
    from tpassrun.transfer import HandoffError

    out = LocalDigest()
    for name in sorted(objects):
        try:
            tree, tensors = named_tensors(name, objects[name])
        except HandoffError as exc:
            out.leaves[name] = {VALUES: f"not digestible: {exc}"[:200]}
            continue
        leaves = {VALUES: hashlib.blake2b(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode(),
                                          digest_size=16).hexdigest()}
        for path, tensor in tensors:
            leaves[path] = tensor_digest(tensor)
            out.nbytes += tensor.numel() * tensor.element_size()
        out.leaves[name] = leaves
    return out


def _tensor_paths(tree: Any, path: str, out: dict[int, str]) -> None:
    """Tensor index -> the path of its first occurrence in an encoded tree (tpassrun.transfer.codec's tags)."""
    if type(tree) is list:
        for i, v in enumerate(tree):
            _tensor_paths(v, f"{path}.{i}", out)
        return
    if type(tree) is not dict:
        return
    if len(tree) == 1 and next(iter(tree)).startswith("$"):
        tag, body = next(iter(tree.items()))
        if tag == "$T":
            out.setdefault(body, path)
        elif tag == "$np":
            out.setdefault(body[0], path)
        elif tag == "$t":
            _tensor_paths(body, path, out)
        elif tag in ("$d", "$od"):
            for key, value in (body if tag == "$d" else body[0]):
                _tensor_paths(value, f"{path}.{key if type(key) in (str, int) else json.dumps(key)}", out)
        return
    for key, value in tree.items():
        _tensor_paths(value, f"{path}.{key}", out)


# --------------------------------------------------------------------------------------------- the decision

@dataclass(frozen=True)
class RankDigest:
    """What one rank says in the first round: its replica group (a key: equal for the ranks of one group),
    its summary digest, and whether its state was just loaded (it is the suspect)."""

    rank: int
    group: int
    summary: bytes
    loaded: bool = False
    compared: bool = True          # False: nothing to compare (alone), or its digest failed (``error``)


@dataclass(frozen=True)
class Verdict:
    """Every rank's reading of the first round, the same on all of them."""

    groups: tuple[tuple[int, ...], ...] = ()     # replica groups of >= 2 ranks, compared
    trusted: dict[int, tuple[int, ...]] = field(default_factory=dict)   # a differing rank -> the ranks it trusts
    restart: str = ""                            # why no agreeing replica can be determined

    @property
    def ok(self) -> bool:
        return not self.trusted and not self.restart

    @property
    def differ(self) -> tuple[int, ...]:
        return tuple(sorted(self.trusted))

    @property
    def ranks(self) -> int:
        return sum(len(g) for g in self.groups)


def decide(reports: Sequence[RankDigest]) -> Verdict:
    """Who disagrees with its replicas, and whom it may take its state from (see the module doc)."""
    by_group: dict[int, list[RankDigest]] = {}
    for r in sorted(reports, key=lambda r: r.rank):
        if r.compared:
            by_group.setdefault(r.group, []).append(r)
    groups, trusted, restarts = [], {}, []
    for members in by_group.values():
        if len(members) < 2:
            continue
        groups.append(tuple(m.rank for m in members))
        sides: dict[bytes, list[RankDigest]] = {}
        for m in members:
            sides.setdefault(m.summary, []).append(m)
        if len(sides) == 1:
            continue
        right = _trusted_side(list(sides.values()), len(members))
        if right is None:
            split = " vs ".join(_ranks_text([m.rank for m in side]) + (" (just loaded)" if any(m.loaded for m in side)
                                                                        else "") for side in sides.values())
            restarts.append(f"replicas {_ranks_text(groups[-1])} disagree ({split}) and no side can be trusted")
            continue
        order = tuple(m.rank for m in sorted(right, key=lambda m: (m.loaded, m.rank)))   # who kept its own first
        for m in members:
            if m.rank not in order:
                trusted[m.rank] = order
    return Verdict(groups=tuple(groups), trusted=trusted, restart="; ".join(restarts))


def _trusted_side(sides: list[list[RankDigest]], n: int) -> list[RankDigest] | None:
    for side in sides:
        if 2 * len(side) > n:
            return side                                    # a strict majority
    kept = [side for side in sides if not any(m.loaded for m in side)]
    return kept[0] if len(kept) == 1 else None             # the only side nobody just loaded


@dataclass(frozen=True)
class Repair:
    """``dst`` loads ``objects`` from ``src`` (whose state agrees with its group's trusted side); ``tensors``: the
    leaves that differ, for the console."""

    src: int
    dst: int
    objects: tuple[str, ...]
    tensors: tuple[str, ...]


def repair_plan(verdict: Verdict, leaves: Mapping[int, Mapping[str, Mapping[str, str]]]) -> tuple[list[Repair], str]:
    """(the repairs, in order; why none is possible, or ""), from every rank's leaf digests (the second round).
    A differing rank takes every object that differs from its first trusted replica; an object tracked on one
    side only cannot be repaired in place."""
    repairs, problems = [], []
    for dst in verdict.differ:
        src = verdict.trusted[dst][0]
        mine, theirs = leaves.get(dst, {}), leaves.get(src, {})
        if set(mine) != set(theirs):
            problems.append(f"rank {dst} tracks {sorted(set(mine) ^ set(theirs))} unlike rank {src}")
            continue
        objects = tuple(o for o in sorted(mine) if mine[o] != theirs[o])
        names = tuple(_leaf_name(o, leaf) for o in objects
                      for leaf in sorted(set(mine[o]) | set(theirs[o])) if mine[o].get(leaf) != theirs[o].get(leaf))
        repairs.append(Repair(src=src, dst=dst, objects=objects, tensors=names))
    return repairs, "; ".join(problems)


def _leaf_name(obj: str, leaf: str) -> str:
    return f"{obj} {VALUES}" if leaf == VALUES else leaf


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def describe_repairs(repairs: Sequence[Repair]) -> str:
    """One line: which rank differs in which tensors, and where it takes its state from."""
    parts = []
    for r in repairs:
        shown = ", ".join(r.tensors[:SHOWN]) + (f" (+{len(r.tensors) - SHOWN} more)" if len(r.tensors) > SHOWN else "")
        parts.append(f"rank {r.dst} differs in {shown or '?'}: takes {', '.join(r.objects)} from rank {r.src}")
    return "; ".join(parts)


__all__ = ["LocalDigest", "RankDigest", "Repair", "Verdict", "decide", "describe_repairs", "host_bytes", "named_tensors",
           "repair_plan", "state_digest", "tensor_digest"]
