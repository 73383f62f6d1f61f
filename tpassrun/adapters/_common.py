"""What every framework adapter needs: registering state with a session, making framework state travel through
the handoff codec (which refuses DTensors, BytesIO and enums, because nothing is pickled), and re-pointing
objects that cached process groups or device meshes at the new ones after a re-formed world.

Nothing here imports a framework; torch is imported inside the functions that need it.
"""

from __future__ import annotations

import io
import types
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

BYTESIO_TAG = "__tpassrun_bytesio__"   # marks a Transformer-Engine-style ``_extra_state`` BytesIO in a state tree


def register(sess: Any, name: str, obj: Any, *, heavy: bool) -> None:
    """Track ``obj`` under ``name``.

    ``heavy`` state (weights, optimizer, everything identical on every data-parallel replica of a rank) travels
    only when a rank is handed over; light state (RNG, counters, data position) is also snapshotted at every step
    start so that an unplanned failure can roll it back. The worker decides by type (``nn.Module``, optimizer,
    scheduler are heavy); adapters wrap framework objects in small Stateful views, so they say it explicitly.
    """
    track_replicated = getattr(sess, "track_replicated", None)
    if heavy and callable(track_replicated):
        track_replicated(**{name: obj})
        return
    if heavy:
        sess.track(**{name: obj})
        # Session has no public "this wrapper is heavy" switch yet: without this, a model wrapper would be
        # snapshotted into the 256 KiB light buffer at every step.
        getattr(sess, "_per_rank", set()).discard(name)
        return
    sess.track_per_rank(**{name: obj})


def declare_replicas(sess: Any, ranks: Iterable[int], alone: str = "") -> None:
    """Tell tpassrun which ranks hold exactly this rank's model and optimizer state (``Session.declare_replicas``:
    an unplanned recovery takes the state from one of them, or restarts at once saying ``alone``)."""
    declare = getattr(sess, "declare_replicas", None)
    if callable(declare):
        declare(list(ranks), alone)


# ---------------------------------------------------------------------------------------------
# state trees the codec can carry


def portable(tree: Any) -> Any:
    """A copy of ``tree`` the handoff codec accepts: DTensor leaves become their local shard (the joiner takes
    the same mesh coordinates, so the local shard is exactly what it needs) and ``io.BytesIO`` becomes bytes."""
    import torch

    if isinstance(tree, torch.Tensor):
        local = getattr(tree, "to_local", None)
        if local is not None and type(tree) not in (torch.Tensor, torch.nn.Parameter):
            return local().detach()
        return tree
    if isinstance(tree, io.BytesIO):
        return {BYTESIO_TAG: tree.getvalue()}
    if isinstance(tree, Mapping):
        out: dict[Any, Any] = OrderedDict() if _is_ordered(tree) else {}   # any other mapping: a dict
        for key, value in tree.items():
            out[key] = portable(value)
        if _is_ordered(tree) and hasattr(tree, "_metadata"):
            out._metadata = tree._metadata  # type: ignore[attr-defined]
        return out
    if type(tree) is list:
        return [portable(v) for v in tree]
    if type(tree) is tuple:
        return tuple(portable(v) for v in tree)
    return tree


def restore_portable(tree: Any, like: Any) -> Any:
    """Inverse of :func:`portable`: local shards become DTensors again with the placements of ``like`` (the live
    object's own state tree), and tagged bytes become ``io.BytesIO``."""
    import torch

    if isinstance(tree, Mapping):
        if set(tree) == {BYTESIO_TAG}:
            return io.BytesIO(tree[BYTESIO_TAG])
        like_map = like if isinstance(like, Mapping) else {}
        out: dict[Any, Any] = OrderedDict() if _is_ordered(tree) else {}
        for key, value in tree.items():
            out[key] = restore_portable(value, like_map.get(key))
        if _is_ordered(tree) and hasattr(tree, "_metadata"):
            out._metadata = tree._metadata  # type: ignore[attr-defined]
        return out
    if type(tree) in (list, tuple):
        like_seq = like if type(like) in (list, tuple) and len(like) == len(tree) else [None] * len(tree)
        return type(tree)(restore_portable(v, w) for v, w in zip(tree, like_seq))
    if isinstance(tree, torch.Tensor) and like is not None and _is_dtensor(like):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(tree.to(like.to_local().device), like.device_mesh, like.placements,
                                  run_check=False, shape=like.shape, stride=like.stride())
    return tree


def _is_ordered(obj: Any) -> bool:
    return type(obj) is OrderedDict


def _is_dtensor(obj: Any) -> bool:
    return hasattr(obj, "device_mesh") and hasattr(obj, "placements") and hasattr(obj, "to_local")


# ---------------------------------------------------------------------------------------------
# a step that failed half-way (re-executed after an unplanned recovery)


def fsdp2_roots(module: Any) -> list[Any]:
    """The outermost FSDP2 (``fully_shard``) modules in ``module``'s tree (the module itself when it is one)."""
    from torch.distributed.fsdp import FSDPModule

    roots: list[str] = []
    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, FSDPModule) and not any(name == r or name.startswith(r + ".") or r == ""
                                                     for r in roots):
            roots.append(name)
            found.append(sub)
    return found


def reset_failed_step(module: Any) -> int:
    """Forget everything a forward/backward that died in a collective left behind in ``module``, so that the step
    can be re-executed exactly as if it had never started. Returns the number of FSDP2 roots reset.

    Plain modules keep only gradients (dropped). FSDP2 also keeps per-iteration state across a failed backward:
    parameter groups left unsharded (the re-executed forward would skip their all-gather while a joiner issues
    it: gloo then sees mismatched sizes), the queued post-backward callback flag (the next backward would never
    finalize), the forward root marker and post-forward order (backward prefetch), in-flight all-gather and
    reduce-scatter results, HSDP's partially reduced gradients. torch 2.13's public
    ``FSDPModule.reset_iter_state()`` clears all of it on the root; gradients already reduced into the sharded
    parameters' ``.grad`` are dropped by ``zero_grad(set_to_none=True)``.
    """
    roots = fsdp2_roots(module)
    for root in roots:
        _torch_attr(root, "reset_iter_state", "FSDPModule")()
        # reset_iter_state() leaves the gradients autograd already wrote into the *unsharded* parameters (the
        # groups whose backward ran but whose reduce-scatter never did: the next backward would add to them) and
        # the reduce-dtype accumulation buffer: torch has no public way to reach them.
        for state in _fsdp2_states(root):
            for group in _torch_attr(state, "_fsdp_param_groups", "FSDPState"):
                for param in _torch_attr(group, "fsdp_params", "FSDPParamGroup"):
                    _torch_attr(type(param), "unsharded_param", "FSDPParam")   # the accessor of _unsharded_param
                    unsharded = getattr(param, "_unsharded_param", None)   # absent before the first all-gather
                    if unsharded is not None:
                        unsharded.grad = None
                    _torch_attr(param, "unsharded_accumulated_grad", "FSDPParam")
                    param.unsharded_accumulated_grad = None
    module.zero_grad(set_to_none=True)
    return len(roots)


FSDP2_TESTED_TORCH = ("2.13.0",)


def _fsdp2_states(root: Any) -> list[Any]:
    """Every FSDP2 state under ``root`` (each ``fully_shard`` call has one), deduplicated."""
    from torch.distributed.fsdp import FSDPModule

    states: dict[int, Any] = {}
    for sub in root.modules():
        if isinstance(sub, FSDPModule):
            state = _torch_attr(sub, "_get_fsdp_state", "FSDPModule")()
            states.setdefault(id(state), state)
    return list(states.values())


def _torch_attr(obj: Any, attr: str, owner: str) -> Any:
    """A torch (FSDP2) attribute tpassrun depends on; a clear error naming the tested versions if it is gone."""
    try:
        return getattr(obj, attr)
    except AttributeError:
        import torch

        raise RuntimeError(f"tpassrun cannot reset FSDP2 after a failed step: {owner}.{attr} is missing in torch "
                           f"{torch.__version__} (tested with torch {', '.join(FSDP2_TESTED_TORCH)})") from None


# ---------------------------------------------------------------------------------------------
# re-pointing cached process groups / meshes


def rebind_references(roots: Iterable[Any], replacements: Mapping[int, Any], *, max_objects: int = 200_000) -> int:
    """Replace, inside every object reachable from ``roots``, each reference to an object whose ``id`` is a key of
    ``replacements`` by the mapped object. Returns how many references were replaced.

    Frameworks cache process groups everywhere (Megatron layers keep ``tp_group``, DDP buckets keep the
    data-parallel group, FSDP2 keeps its mesh and DTensor specs keep theirs); after a re-formed world the old
    groups are dead. Rather than knowing every attribute of every version, walk instance ``__dict__``s, lists,
    dicts and tuples (rebuilt in place), and DTensor specs. Classes, modules, functions and plain tensors are not
    entered; closures are not seen (say so in the adapter's notes).
    """
    import torch

    seen: set[int] = set()
    replaced = 0
    stack = list(roots)
    old_ids = set(replacements)

    def swap(value: Any) -> tuple[Any, bool]:
        if id(value) in old_ids:
            return replacements[id(value)], True
        if type(value) is tuple and any(id(v) in old_ids for v in value):
            return tuple(replacements.get(id(v), v) for v in value), True
        return value, False

    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in old_ids:
            continue
        seen.add(id(obj))
        if len(seen) > max_objects:
            raise RuntimeError(f"rebind_references: more than {max_objects} objects reachable; refusing to walk on")
        if isinstance(obj, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes,
                            int, float, bool, type(None))):
            continue
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            continue
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                new, hit = swap(value)
                if hit:
                    obj[key] = new
                    replaced += 1
                else:
                    stack.append(value)
            continue
        if isinstance(obj, list):
            for i, value in enumerate(obj):
                new, hit = swap(value)
                if hit:
                    obj[i] = new
                    replaced += 1
                else:
                    stack.append(value)
            continue
        if isinstance(obj, (tuple, set, frozenset)):
            stack.extend(obj)   # tuples holding a group are rebuilt by their owner's swap() above
            continue
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for key, value in list(attrs.items()):
                new, hit = swap(value)
                if hit:
                    object.__setattr__(obj, key, new) if _frozen(obj) else attrs.__setitem__(key, new)
                    replaced += 1
                else:
                    stack.append(value)
    return replaced


def _frozen(obj: Any) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


@dataclass
class GroupSnapshot:
    """The process groups some objects reference, with their member ranks, recorded while they were alive, so
    that the same groups can be re-created in a re-formed world.

    Groups are re-created in their original creation order and with ``new_group``'s default (world-wide)
    synchronization: that is exactly what a joiner does when it builds the framework's objects from scratch
    (DeepSpeed's ``_clone_world_group``, Megatron's ``initialize_model_parallel``), so the survivors' calls and
    the joiner's pair up (same group names, same store keys). Mixing modes, or orders, hangs the new world.
    """

    groups: list[tuple[Any, tuple[int, ...], bool]] = field(default_factory=list)   # (group, ranks, is_world)

    @classmethod
    def of(cls, roots: Iterable[Any]) -> "GroupSnapshot":
        import torch.distributed as dist

        world = dist.group.WORLD
        found: dict[int, Any] = {}
        _collect(roots, lambda o: isinstance(o, dist.ProcessGroup), found)
        groups = []
        for group in found.values():
            ranks = tuple(dist.get_process_group_ranks(group))
            groups.append((group, ranks, group is world))
        groups.sort(key=lambda g: (not g[2], _creation_index(g[0]), g[1]))
        return cls(groups)

    def recreate(self) -> dict[int, Any]:
        """New groups with the same members in the current world, ``{id(old): new}``. Every rank of the new
        world must call this (the joiner makes the same calls while building its objects)."""
        import torch.distributed as dist

        mapping: dict[int, Any] = {}
        for group, ranks, is_world in self.groups:
            mapping[id(group)] = dist.group.WORLD if is_world else dist.new_group(list(ranks))
        return mapping


def _creation_index(group: Any) -> int:
    """torch names groups made without hashed names by a counter ("1", "2", ...): their creation order."""
    name = str(getattr(group, "group_name", ""))
    return int(name) if name.isdigit() else 1 << 30


def _collect(roots: Iterable[Any], match: Callable[[Any], bool], found: dict[int, Any],
             max_objects: int = 200_000) -> None:
    import torch

    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > max_objects:
            return
        if match(obj):
            found[id(obj)] = obj
            continue
        if isinstance(obj, (type, types.ModuleType, types.FunctionType, str, bytes, int, float, bool, type(None))):
            continue
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                stack.extend(attrs.values())


def adopt_group_sockets() -> int:
    """Let tpassrun tear the sockets of the groups created since the world's init down on a failure (so a peer
    blocked in a sub-group collective fails at once instead of waiting for gloo's timeout)."""
    from tpassrun.worker import GROUP_SOCKETS

    return GROUP_SOCKETS.adopt_since_init()
