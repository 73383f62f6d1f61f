"""TorchTitan (FSDP2 / DTensor): Stateful views of a trainer's parts, and a rebuilt device mesh after a re-formed
world.

    adapter = TorchTitanAdapter(sess, trainer.model_parts, trainer.optimizers, trainer.lr_schedulers,
                                trainer.dataloader, trainer, world_mesh=parallel_dims.world_mesh)

What travels:

* heavy ``titan.model``: ``get_model_state_dict(part, StateDictOptions(full_state_dict=False))`` of every model
  part. Its values are DTensors; the handoff carries each one's *local shard* (the joiner takes the leaver's rank,
  hence the same mesh coordinates) and the joiner wraps it back with its own placements before
  ``set_model_state_dict``.
* heavy ``titan.optimizer``: torchtitan's ``OptimizersContainer`` (already flat, FQN-keyed, DTensor-valued via the
  same DCP helpers) or, for a plain optimizer, ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.
* heavy ``titan.lr_schedulers``: ``LRSchedulersContainer`` (already Stateful).
* light ``titan.dataloader`` (``ParallelAwareDataloader``: per-DP-rank bytes that torchtitan itself encodes) and
  ``titan.train_state`` (``step``, ``ntokens_seen``, ...). TorchTitan does not checkpoint RNG; tpassrun's generic
  RNG capture moves the global generators.

Replicas: FSDP shards model and optimizer over ``dp_shard``; only ranks on another ``dp_replicate`` (HSDP) hold
the same shards. Without a replicate dimension an unplanned failure has no live replica (:attr:`replicated`).

After a re-formed world, :meth:`TorchTitanAdapter.reconfigure` rebuilds the root device mesh with
``init_device_mesh`` (same shape, dim names and device type), takes the same named sub-meshes from it, and re-points
every cached reference (FSDP2's mesh info and process groups, every DTensor's spec) at the new meshes and groups.
Exercised on CPU with a one-process FSDP2 model; multi-dimensional meshes with flattened dims (``dp_shard_cp``)
and torchtitan itself (a heavy install) are not exercised here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from ._common import _collect, portable, rebind_references, register, restore_portable

log = logging.getLogger("tpassrun.adapters.torchtitan")

STATE_VERSION = 1


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


class ModelPartsState:
    """Every model part's sharded state (DTensor local shards)."""

    def __init__(self, model_parts: Sequence[Any]) -> None:
        self.model_parts = list(model_parts)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"v": STATE_VERSION,
                "parts": [portable(get_model_state_dict(part, options=_options())) for part in self.model_parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        _check(state, "model")
        if len(state["parts"]) != len(self.model_parts):
            raise ValueError(f"received {len(state['parts'])} model parts, this rank has {len(self.model_parts)}")
        for part, part_state in zip(self.model_parts, state["parts"]):
            like = get_model_state_dict(part, options=_options())
            set_model_state_dict(part, restore_portable(part_state, like), options=_options())


class OptimizerState:
    """torchtitan's OptimizersContainer (Stateful already) or a plain optimizer over ``model_parts``."""

    def __init__(self, optimizers: Any, model_parts: Sequence[Any]) -> None:
        self.optimizers = optimizers
        self.model_parts = list(model_parts)

    def _is_plain(self) -> bool:
        import torch

        return isinstance(self.optimizers, torch.optim.Optimizer) and not hasattr(self.optimizers, "model_parts")

    def _current(self) -> dict[str, Any]:
        if self._is_plain():
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model_parts[0], self.optimizers, options=_options())
        return self.optimizers.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"v": STATE_VERSION, "state": portable(self._current())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check(state, "optimizer")
        like = dict(self._current())
        like.update(_param_likes(self.model_parts, state["state"], like))
        restored = restore_portable(state["state"], like)
        if self._is_plain():
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self.model_parts[0], self.optimizers, restored, options=_options())
        else:
            self.optimizers.load_state_dict(restored)


def _param_likes(model_parts: Sequence[Any], received: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A joiner's optimizer has no state yet, so nothing tells how to re-wrap ``state.<fqn>.exp_avg``: use the
    parameter ``<fqn>`` itself, whose shard has the same placements."""
    params = {}
    for part in model_parts:
        params.update(dict(part.named_parameters()))
    out = {}
    for key, value in received.items():
        if key in current or not key.startswith("state.") or not hasattr(value, "shape"):
            continue
        fqn = key[len("state."):].rsplit(".", 1)[0]
        param = params.get(fqn)
        local = getattr(param, "to_local", None)
        if param is not None and local is not None and tuple(local().shape) == tuple(value.shape):
            out[key] = param
    return out


def _check(state: Any, what: str) -> None:
    if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
        raise ValueError(f"torchtitan {what} state version {getattr(state, 'get', lambda _k: None)('v')!r}, "
                         f"expected {STATE_VERSION}")


# ---------------------------------------------------------------------------------------------
# device mesh


@dataclass
class MeshSnapshot:
    """The meshes a model uses and their per-dim groups, noted while the world was alive (once the worker has
    destroyed the old world, a mesh can no longer resolve its groups by name)."""

    root: Any
    meshes: list[Any] = field(default_factory=list)
    groups: dict[int, list[Any]] = field(default_factory=dict)    # id(mesh) -> [group of dim 0, dim 1, ...]

    @classmethod
    def of(cls, roots: Sequence[Any], world_mesh: Any = None) -> "MeshSnapshot":
        from torch.distributed.device_mesh import DeviceMesh

        found: dict[int, Any] = {}
        _collect(roots, lambda o: isinstance(o, DeviceMesh), found)
        meshes = list(found.values())
        root = world_mesh
        if root is None:
            if not meshes:
                raise ValueError("no DeviceMesh is reachable from the model parts: pass world_mesh=")
            root = _root_of(meshes[0])
        if all(m is not root for m in meshes):
            meshes.append(root)
        return cls(root, meshes, {id(m): [m.get_group(i) for i in range(m.ndim)] for m in meshes})

    def rebuild(self) -> dict[int, Any]:
        """New meshes (collective: every rank) and ``{id(old mesh or group): new}``."""
        from torch.distributed.device_mesh import init_device_mesh

        old_root = self.root
        names = old_root.mesh_dim_names
        new_root = init_device_mesh(old_root.device_type, tuple(old_root.mesh.shape), mesh_dim_names=names)
        mapping: dict[int, Any] = {}
        for old in self.meshes:
            if old is old_root:
                new = new_root
            elif old.mesh_dim_names and names and all(n in names for n in old.mesh_dim_names):
                new = new_root[old.mesh_dim_names if old.ndim > 1 else old.mesh_dim_names[0]]
            else:
                raise NotImplementedError(f"cannot rebuild mesh {old} (dims {old.mesh_dim_names}): only the root "
                                          f"mesh {names} and its named slices are supported")
            mapping[id(old)] = new
            for dim, group in enumerate(self.groups[id(old)]):
                mapping.setdefault(id(group), new.get_group(dim))
        return mapping


def _root_of(mesh: Any) -> Any:
    getter = getattr(mesh, "_get_root_mesh", None)
    root = getter() if getter is not None else None
    return root if root is not None else mesh


class TorchTitanAdapter:
    """Registers a torchtitan trainer's parts with a tpassrun session and rebuilds the mesh after every swap.

    Args:
        sess: the session from ``tpassrun.init()``.
        model_parts: ``trainer.model_parts`` (FSDP2/TP-parallelised modules).
        optimizers: ``OptimizersContainer`` (or one torch optimizer over ``model_parts[0]``).
        lr_schedulers: ``LRSchedulersContainer`` (or a torch scheduler), or None.
        dataloader: ``ParallelAwareDataloader`` (or anything Stateful), or None.
        train_state: TrainState (``step``, ``ntokens_seen``), or None.
        world_mesh: the root mesh (``parallel_dims.world_mesh``); found from the parameters when None.
    """

    def __init__(self, sess: Any, model_parts: Sequence[Any], optimizers: Any, lr_schedulers: Any,
                 dataloader: Any, train_state: Any, *, world_mesh: Any = None) -> None:
        self.sess = sess
        self.model_parts = list(model_parts)
        self.optimizers = optimizers
        self.world_mesh = world_mesh
        self._meshes: MeshSnapshot | None = None
        if _distributed_ready():
            self.record_meshes()   # local bookkeeping: which meshes/groups the model uses
        if train_state is not None:
            register(sess, "titan.train_state", train_state, heavy=False)
        if dataloader is not None:
            register(sess, "titan.dataloader", dataloader, heavy=False)
        register(sess, "titan.model", ModelPartsState(self.model_parts), heavy=True)
        register(sess, "titan.optimizer", OptimizerState(optimizers, self.model_parts), heavy=True)
        if lr_schedulers is not None:
            register(sess, "titan.lr_schedulers", lr_schedulers, heavy=True)
        sess.on_reconfigure(self.reconfigure)

    @property
    def replicated(self) -> bool:
        """Whether another rank holds this rank's shards: only with a ``dp_replicate`` dimension of size > 1."""
        mesh = self.world_mesh if self.world_mesh is not None else (self._meshes.root if self._meshes else None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        return "dp_replicate" in names and mesh["dp_replicate"].size() > 1

    def _roots(self) -> list[Any]:
        return [*self.model_parts, self.optimizers]

    def record_meshes(self) -> MeshSnapshot:
        self._meshes = MeshSnapshot.of(self._roots(), self.world_mesh)
        return self._meshes

    def reconfigure(self) -> int:
        """Rebuild the device mesh in the new world and re-point FSDP2's and the DTensors' references at it."""
        if self._meshes is None:
            raise RuntimeError("TorchTitanAdapter.record_meshes() was not called before the world was re-formed")
        mapping = self._meshes.rebuild()
        old_root = self._meshes.root
        replaced = rebind_references(self._roots(), mapping)
        if self.world_mesh is not None:
            self.world_mesh = mapping[id(old_root)]
        self._meshes = MeshSnapshot.of(self._roots(), self.world_mesh)
        log.info("torchtitan: device mesh rebuilt, %d references re-pointed", replaced)
        return replaced


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


__all__ = ["MeshSnapshot", "ModelPartsState", "OptimizerState", "TorchTitanAdapter"]
