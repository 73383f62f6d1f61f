"""The replica check on the worker: after every swap or recovery, before the first step in the re-formed world,
the ranks that must hold identical state compare an exact digest of it (:mod:`tpassrun.worker.digest` digests and
decides). A part of :class:`tpassrun.worker.session.Session`.

Where it touches the rest (each a call of one line): a survivor's re-formed world (``BoundaryCommands.on_reform``)
and a joiner's join (``SpareCommands.on_join``) make the check due (:meth:`ReplicaCheck.after_recovery`);
``Session.run`` runs it (``BoundaryCommands.check_replicas``) at the next step start, right after the step's start
snapshot (so that a collective of the check failing is that step failing, before anything of it ran). Nothing
happens at any other step.

The check, on every rank of the world at the same step: one ``all_gather`` of a few words per rank (its replica
group, a 16-byte digest of everything it compares, whether it just loaded its state). When every group agrees
that is all. Otherwise a second exchange carries each rank's digest per tensor (the names of what differs), every
rank reads the same decision, the differing ranks load the objects that differ from a trusted replica (point to
point, over the re-formed world) and all check again; without a trusted replica, or still differing after the
repair, the group restarts. Rank 0 tells its agent what was found (``protocol.ReplicasChecked``): the console line
and the ``replicas_checked`` event.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tpassrun.channel import ReplicasChecked
from tpassrun.schema import NonNegative, dump, load
from tpassrun.worker import digest
from tpassrun.worker.state import WorkerState
from tpassrun.worker.step import StepTransaction

log = logging.getLogger("tpassrun.worker")


class CheckFailed(Exception):
    """A collective of the replica check failed (a peer died or went away meanwhile)."""


class ReplicaCheck:
    """Session's replica check (see the module doc)."""

    def __init__(self, state: WorkerState, txn: StepTransaction) -> None:
        self.state = state
        self.txn = txn

    def after_recovery(self, loaded: bool) -> None:
        """A swap or recovery ended on this rank (``loaded``: its replicated state was just loaded: a joiner, a
        survivor caught up from a peer or rolled back to its own copy): the check is due at the next step start."""
        st = self.state
        st.replicas_due = bool(loaded or st.replicas_due)

    def _objects(self) -> tuple[tuple[int, ...], dict[str, Any]]:
        """This rank's replica group (declared, else the whole world) and what it holds identically to them."""
        st = self.state
        declared = tuple(st.replica_group)
        group = declared or tuple(range(st.world_size))
        if len(group) < 2:
            return group, {}
        return group, {name: obj for name, obj in st.tracked.items()
                       if name not in st.per_rank and (declared or name not in st.sharded)
                       and getattr(obj, "replicated", True) is not False}

    def rounds(self, step: int, loaded: bool) -> bool:
        """Check, repair when a trusted replica exists, check again. True: the group must restart."""
        st = self.state
        t0 = time.perf_counter()
        group, objects = self._objects()
        if loaded and objects:
            _test_corruption(st.rank, step, objects)
        local = _digest(objects)
        seconds = time.perf_counter() - t0
        compared = bool(objects) and not local.error
        verdict = digest.decide(_exchange(st.rank, group, local, loaded, compared))
        said: dict[str, Any] = dict(step=step, ranks=verdict.ranks, groups=len(verdict.groups), nbytes=local.nbytes,
                    seconds=round(seconds, 4))
        if local.error:
            log.warning("rank %d: its state could not be digested, not compared with its replicas: %s",
                        st.rank, local.error)
        if verdict.ok:
            self._say(ReplicasChecked(ok=True, **said))
            return False
        leaves = dict(enumerate(_gather_json(local.leaves if compared else {})))
        repairs, problem = digest.repair_plan(verdict, leaves)
        why = verdict.restart or problem
        detail = digest.describe_repairs(repairs)
        differ = {str(r.dst): {"tensors": list(r.tensors[:50]), "count": len(r.tensors), "source": r.src,
                               "objects": list(r.objects)} for r in repairs}
        if why:
            self._say(ReplicasChecked(ok=False, action="restart", differ=differ,
                                      detail=f"{why}{'; ' + detail if detail else ''}"[:900], **said))
            return True
        self._say(ReplicasChecked(ok=False, action="repair", differ=differ, detail=detail[:900], **said))
        for r in repairs:
            if st.rank == r.dst:
                log.warning("rank %d: its state differs from its replicas' at step %d (%s): loading %s from rank %d",
                            st.rank, step, ", ".join(r.tensors[:digest.SHOWN]), ", ".join(r.objects), r.src)
        _repair(st.rank, repairs, objects)
        if any(r.dst == st.rank for r in repairs) and st.window == step:
            st.window_marks = self.txn.replicated_marks()   # (schedulers it loaded)
        t1 = time.perf_counter()
        again = _digest(objects)
        said.update(nbytes=again.nbytes, seconds=round(time.perf_counter() - t1, 4))
        after = digest.decide(_exchange(st.rank, group, again, loaded, compared and not again.error))
        if after.ok:
            self._say(ReplicasChecked(ok=True, recheck=True, **said))
            return False
        self._say(ReplicasChecked(ok=False, recheck=True, action="restart", **said,
                                  detail=f"ranks {list(after.differ)} still differ from their replicas after the "
                                         f"repair{'; ' + after.restart if after.restart else ''}"[:900]))
        return True

    def _say(self, msg: ReplicasChecked) -> None:
        """Rank 0 tells its agent (one console line, one event); a rank that differs also logs it (below)."""
        st = self.state
        if st.rank == 0 and st.link is not None:
            st.link.send(msg)


def _digest(objects: dict[str, Any]) -> digest.LocalDigest:
    try:
        return digest.state_digest(objects)
    except Exception as exc:  # noqa: BLE001 - never a reason to stop training: said, this rank is not compared
        return digest.LocalDigest(error=f"{type(exc).__name__}: {exc}"[:300])


# --------------------------------------------------------------------------------------------- collectives

def _device() -> Any:
    """Where the check's tensors go: the default group's backend decides (NCCL takes CUDA tensors only)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # gloo raises plain RuntimeErrors: any failure here is the collective's
        raise CheckFailed(f"{getattr(fn, '__name__', fn)} failed") from exc


def _exchange(rank: int, group: Sequence[int], local: digest.LocalDigest, loaded: bool,
              compared: bool) -> list[digest.RankDigest]:
    """The first round: one all_gather of five words per rank."""
    import torch
    import torch.distributed as dist

    key = int.from_bytes(hashlib.blake2b(json.dumps(sorted(group)).encode(), digest_size=8).digest(), "little",
                         signed=True)
    summary = local.summary
    mine = torch.tensor([key, int.from_bytes(summary[:8], "little", signed=True),
                         int.from_bytes(summary[8:], "little", signed=True), int(loaded), int(compared)],
                        dtype=torch.int64, device=_device())
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    _collective(dist.all_gather, out, mine)
    reports = []
    for r, words in enumerate(out):
        k, s0, s1, was_loaded, was_compared = (int(w) for w in words.cpu())
        reports.append(digest.RankDigest(rank=r, group=k, loaded=bool(was_loaded), compared=bool(was_compared),
                                         summary=s0.to_bytes(8, "little", signed=True)
                                         + s1.to_bytes(8, "little", signed=True)))
    return reports


def _gather_json(doc: Any) -> list[Any]:
    """Every rank's ``doc`` (JSON), in rank order: two all_gathers (the sizes, then the padded bytes)."""
    import torch
    import torch.distributed as dist

    device = _device()
    data = json.dumps(doc, separators=(",", ":")).encode()
    world = dist.get_world_size()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    _collective(dist.all_gather, sizes, size)
    longest = max(int(s) for s in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(mine) for _ in range(world)]
    _collective(dist.all_gather, out, mine)
    return [json.loads(digest.host_bytes(t[:int(n)]) or b"null") for t, n in zip(out, sizes)]


# --------------------------------------------------------------------------------------------- the repair

def _repair(rank: int, repairs: Sequence[digest.Repair], objects: dict[str, Any]) -> None:
    """Each repair in order, point to point: ``src`` sends the objects' state (a JSON head: the encoded trees and
    the tensors' dtypes and shapes; then each tensor's bytes), ``dst`` loads it (``load_state_dict``, as a joiner
    does). A sender that cannot encode says so in its head and sends nothing more; a receiver that cannot load
    keeps its state (the check after the repair then finds it still differing)."""
    for r in repairs:
        if rank == r.src:
            _send_objects(r.dst, {n: objects[n] for n in r.objects})
        elif rank == r.dst:
            _receive_objects(r.src, {n: objects[n] for n in r.objects})


@dataclass(frozen=True)
class RepairHead:
    """What a repair's sender sends first: the objects' encoded trees (tensor references numbered across all of
    them), why it could not (then nothing follows), and each tensor's dtype and shape, in the order they follow."""

    objects: Mapping[str, Any]
    error: str
    specs: tuple[tuple[str, tuple[NonNegative, ...]], ...]


def _send_objects(dst: int, objects: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    trees: dict[str, Any] = {}
    tensors: list[Any] = []
    error = ""
    try:
        for name, obj in objects.items():
            tree, named = digest.named_tensors(name, obj)
            trees[name] = _renumber(tree, len(tensors))
            tensors += [t for _, t in named]
    except Exception as exc:  # noqa: BLE001 - said in the head: the receiver keeps its state
        trees, tensors, error = {}, [], f"{type(exc).__name__}: {exc}"[:300]
    head = RepairHead(trees, error, tuple((str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors))
    device = _device()
    data = json.dumps(dump(head), separators=(",", ":")).encode()
    _collective(dist.send, torch.tensor([len(data)], dtype=torch.int64, device=device), dst)
    _collective(dist.send, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), dst)
    for t in tensors:
        if t.numel():
            _collective(dist.send, t.detach().contiguous().reshape(-1).view(torch.uint8).to(device), dst)


def _receive_objects(src: int, objects: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from tpassrun.transfer import decode_tree, dtype_from_name

    device = _device()
    size = torch.empty(1, dtype=torch.int64, device=device)
    _collective(dist.recv, size, src)
    data = torch.empty(int(size), dtype=torch.uint8, device=device)
    _collective(dist.recv, data, src)
    head = load(RepairHead, json.loads(digest.host_bytes(data)))
    tensors = []
    for dtype, shape in head.specs:
        t = torch.empty(shape, dtype=dtype_from_name(dtype), device=device)
        if t.numel():
            _collective(dist.recv, t.reshape(-1).view(torch.uint8), src)
        tensors.append(t)
    if head.error:
        log.warning("rank %d could not send its state for the repair: %s", src, head.error)
        return
    for name, tree in head.objects.items():
        try:
            objects[name].load_state_dict(decode_tree(tree, tensors))
        except Exception as exc:  # noqa: BLE001 - it keeps its state; the check after the repair says it differs
            log.warning("loading %s from rank %d for the repair failed: %s: %s", name, src, type(exc).__name__, exc)


def _renumber(tree: Any, offset: int) -> Any:
    """An encoded tree's tensor references shifted by ``offset`` (several objects' trees share one tensor list)."""
    if type(tree) is list:
        return [_renumber(v, offset) for v in tree]
    if type(tree) is not dict:
        return tree
    if len(tree) == 1 and next(iter(tree)) in ("$T", "$np"):
        tag, body = next(iter(tree.items()))
        return {tag: body + offset} if tag == "$T" else {tag: [body[0] + offset, *body[1:]]}
    return {k: _renumber(v, offset) for k, v in tree.items()}


# --------------------------------------------------------------------------------------------- tests' fault

def _test_corruption(rank: int, step: int, objects: dict[str, Any]) -> None:
    """The ``loaded``/``corrupt`` fault point (:mod:`tpassrun.worker.faultpoints`): flip the lowest bit of one tensor's first
    byte, in place, as a recovery that loaded one wrong bit would leave it."""
    import torch

    from tpassrun.worker import faultpoints as testing

    if not testing.ENABLED:
        return
    fault = testing.claim(rank, step, "loaded", "corrupt")
    if fault is None:
        return
    want = fault.get("tensor")
    for name in sorted(objects):
        for path, tensor in digest.named_tensors(name, objects[name])[1]:
            if want in (None, path) and tensor.numel():
                raw = tensor.detach().reshape(-1).view(torch.uint8)
                raw[:1].bitwise_xor_(1)
                log.warning("rank %d: test fault: flipped a bit of %s after loading its state", rank, path)
                return
    log.warning("rank %d: test fault: no tensor %r to corrupt", rank, want)


__all__ = ["CheckFailed", "ReplicaCheck"]
