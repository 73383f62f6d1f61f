"""TorchTitan (FSDP2 / DTensor): Stateful views of a trainer's parts, and a rebuilt device mesh after a re-formed
world.

A job built from torchtitan's components, with the lines tpassrun adds (``tests/test_docs_run.py`` runs this very
block on CPU, under torchrun and under tpassrun with a rank SIGKILLed, and compares the two with ``torch.equal``)::

    import torch
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.distributed import ParallelDims

    import tpassrun
    from tpassrun.adapters.torchtitan import TorchTitanAdapter

    sess = tpassrun.init(backend="gloo")             # instead of init_process_group; "nccl" on GPUs
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=sess.world_size)
    dims.build_mesh()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    fully_shard(model[0], mesh=dims.get_mesh("dp_shard"))
    fully_shard(model, mesh=dims.get_mesh("dp_shard"))
    optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
    TorchTitanAdapter(sess, [model], optimizers, None, None, None, parallel_dims=dims)

    def step(i):                                     # the batch: a pure function of the step and the rank
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * i + sess.rank))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()

    sess.run(step, 40)

Pass ``parallel_dims=``, not ``world_mesh=``: after a re-formed world the survivors must create the mesh's groups
exactly as a joiner does while it runs ``ParallelDims.build_mesh()`` (same groups, same order), and only the
``ParallelDims`` lets them (``world_mesh=`` is for a mesh made with ``init_device_mesh`` itself). In torchtitan's
``Trainer`` the objects are ``TorchTitanAdapter(sess, trainer.model_parts, trainer.optimizers,
trainer.lr_schedulers, trainer.dataloader, trainer, parallel_dims=trainer.parallel_dims)`` (``trainer`` is its
TrainState). On CPU, torchtitan 0.3.0 needs ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` before
``build_mesh()`` (it falls back to ``"cuda"``).

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
the same shards. The adapter declares them (``sess.declare_replicas``, from the mesh's rank grid) so an unplanned
recovery takes the dead rank's shards from one of them. Without a replicate dimension no live rank holds them and
they are recovered from the shard mirror when there is one. Both ways the views are tracked as sharded state
(``sess.track_sharded``): every rank keeps a local copy of each step's start, which under HSDP (no mirror) serves
the survivors that stopped a step apart (a rank died inside the replicate all-reduce after its shard group's last
reduce-scatter): everyone rolls back to it (:func:`tpassrun.plan.node_shards.replica_rollback`).

A step that failed half-way (a peer died in one of its collectives) is re-executed by the survivors: their model
view's ``drop_grads`` resets FSDP2's per-iteration state first (:func:`tpassrun.adapters._common.reset_failed_step`).

After a re-formed world, :meth:`TorchTitanAdapter.reconfigure` rebuilds the device meshes with
``ParallelDims.build_mesh()`` (or ``init_device_mesh``: same shape, dim names and device type), takes the same named
sub-meshes from them, and re-points every cached reference (FSDP2's mesh info and process groups, every DTensor's
spec) at the new meshes and groups. Exercised with torchtitan 0.3.0 on 4 CPU ranks (``tests/test_torchtitan_real.py``:
FSDP2 planned swap, HSDP and pure-FSDP SIGKILLs); meshes with TP/PP/CP or flattened dims (``dp_shard_cp``) are not.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from tpassrun.adapters._common import (
    _collect,
    adopt_group_sockets,
    declare_replicas,
    portable,
    rebind_references,
    register,
    reset_failed_step,
    restore_portable,
)

log = logging.getLogger("tpassrun.adapters.torchtitan")

STATE_VERSION = 1
TESTED_VERSIONS = ("0.3.0",)
ALONE = "FSDP shards its model and optimizer state over dp_shard and the mesh has no dp_replicate dimension"


def _options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=True)


def shard_coords(model_parts: Sequence[Any]) -> dict[str, int]:
    """This rank's coordinates on every mesh dim of its parameters except ``dp_replicate``: the ranks with equal
    coordinates (in other replica groups) hold exactly the same shards."""
    for part in model_parts:
        for param in part.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is not None and mesh.mesh_dim_names:
                coords = mesh.get_coordinate() or []
                return {n: int(c) for n, c in zip(mesh.mesh_dim_names, coords) if n != "dp_replicate"}
    return {}


def replica_group(model_parts: Sequence[Any]) -> list[int] | None:
    """The global ranks holding exactly this rank's shards: its own coordinates on every mesh dim of the
    parameters but ``dp_replicate``, any coordinate on ``dp_replicate`` (this rank alone without HSDP). None when
    no parameter is a DTensor (nothing is sharded). Read from the mesh's rank grid: no collective."""
    for part in model_parts:
        for param in part.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is None:
                continue
            coords = mesh.get_coordinate()
            if coords is None:
                return None
            names = tuple(mesh.mesh_dim_names or ())
            index = tuple(slice(None) if n == "dp_replicate" else c
                          for n, c in zip(names or [None] * len(coords), coords))
            return sorted(int(r) for r in mesh.mesh[index].flatten().tolist())
    return None


def replica_dims(model_parts: Sequence[Any]) -> int:
    """Size of the ``dp_replicate`` dim of the parameters' mesh (1 without HSDP)."""
    for part in model_parts:
        for param in part.parameters():
            mesh: Any = getattr(param, "device_mesh", None)
            names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
            if "dp_replicate" in names:
                return int(mesh["dp_replicate"].size())
            if mesh is not None:
                return 1
    return 1


class _Sharded:
    """Model and optimizer views: replicated only across ``dp_replicate`` (HSDP). The layout is read while the
    world is alive (a donor answers after its groups were aborted) and again after every re-formed world."""

    model_parts: list[Any]
    _replicas: int = 1
    _coords: dict[str, int] = {}
    # state_dict() changes nothing at step 0 (the optimizer view forgets the state describing a fresh optimizer
    # materializes: OptimizerState._current): the shard mirror copies step 0 too (tpassrun/worker/shards.py)
    copy_at_start = True

    def refresh_layout(self) -> None:
        self._replicas = replica_dims(self.model_parts)
        self._coords = shard_coords(self.model_parts)

    @property
    def replicated(self) -> bool:
        return self._replicas > 1

    def why_not_replicated(self) -> str:
        return ("FSDP shards the model and optimizer over dp_shard and there is no dp_replicate dimension: no live "
                "rank holds this rank's shards (a planned swap is exact, an unplanned failure restarts the group)")




class ModelPartsState(_Sharded):
    """Every model part's sharded state (DTensor local shards), with the shard coordinates they belong to."""

    def __init__(self, model_parts: Sequence[Any]) -> None:
        self.model_parts = list(model_parts)
        self.refresh_layout()

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"v": STATE_VERSION, "coords": dict(self._coords),
                "parts": [portable(get_model_state_dict(part, options=_options())) for part in self.model_parts]}

    def drop_grads(self) -> None:
        """A step failed half-way and will be re-executed (unplanned recovery): reset FSDP2's per-iteration state
        (unsharded groups, post-backward flags, partial reductions) and drop the gradients."""
        for part in self.model_parts:
            reset_failed_step(part)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        _check(state, "model")
        mine = self._coords
        if state.get("coords", mine) != mine:
            # a donor from another shard position (unplanned recovery): never load someone else's shards
            raise ValueError(f"received the shards of mesh coordinates {state['coords']}, this rank holds {mine}")
        if len(state["parts"]) != len(self.model_parts):
            raise ValueError(f"received {len(state['parts'])} model parts, this rank has {len(self.model_parts)}")
        for part, part_state in zip(self.model_parts, state["parts"]):
            like = get_model_state_dict(part, options=_options())
            set_model_state_dict(part, restore_portable(part_state, like), options=_options())


class OptimizerState(_Sharded):
    """torchtitan's OptimizersContainer (Stateful already) or a plain optimizer over ``model_parts``."""

    def __init__(self, optimizers: Any, model_parts: Sequence[Any]) -> None:
        self.optimizers = optimizers
        self.model_parts = list(model_parts)
        self.refresh_layout()

    def _is_plain(self) -> bool:
        import torch

        return isinstance(self.optimizers, torch.optim.Optimizer) and not hasattr(self.optimizers, "model_parts")

    def _current(self) -> dict[str, Any]:
        """The flat, FQN-keyed state dict. An optimizer that never stepped has no state yet, and both torchtitan's
        ``OptimizersContainer.state_dict()`` and DCP's ``get_optimizer_state_dict`` materialize it by running a
        zero-gradient, zero-lr step, which counts as a step (Adam's ``step`` becomes 1, so the first real update
        would differ from torchrun's): forget the state such a call created, as if it had never run."""
        fresh = [o for o in self.commit_optimizers() if not o.state]
        if self._is_plain():
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            current: dict[str, Any] = get_optimizer_state_dict(self.model_parts[0], self.optimizers, options=_options())
        else:
            current = self.optimizers.state_dict()
        for opt in fresh:
            opt.state.clear()
        return current

    def _fresh(self) -> list[int]:
        return [i for i, o in enumerate(self.commit_optimizers()) if not o.state]

    def commit_optimizers(self) -> list[Any]:
        """The torch optimizers whose ``step()`` commits a training step (tpassrun's step transaction)."""
        if self._is_plain():
            return [self.optimizers]
        return list(_require(self.optimizers, "optimizers"))

    def drop_grads(self) -> None:
        self.optimizers.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        fresh = self._fresh()     # optimizers that never stepped: their param groups travel, no state
        return {"v": STATE_VERSION, "state": portable(self._current()), "fresh": fresh}

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
        inner = self.commit_optimizers()
        for i in state.get("fresh", ()):
            inner[int(i)].state.clear()     # the sender's had never stepped (loading materialized its state)


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

    def rebuild_from(self, parallel_dims: Any) -> dict[int, Any]:
        """``{id(old mesh or group): new}`` with the new meshes taken from a ``ParallelDims`` whose
        ``build_mesh()`` already ran in the new world (by dim names: the same named meshes the model used)."""
        mapping: dict[int, Any] = {}
        for old in self.meshes:
            names = tuple(old.mesh_dim_names or ())
            if old is self.root:
                new = _require(parallel_dims, "world_mesh")
            else:
                new = parallel_dims.get_mesh(list(names) if len(names) > 1 else names[0])
            mapping[id(old)] = new
            for dim, group in enumerate(self.groups[id(old)]):
                mapping.setdefault(id(group), new.get_group(dim))
        return mapping


def _require(obj: Any, attr: str) -> Any:
    try:
        return getattr(obj, attr)
    except AttributeError:
        import importlib.metadata as md

        try:
            version = md.version("torchtitan")
        except md.PackageNotFoundError:
            version = "not installed"
        raise RuntimeError(f"tpassrun's TorchTitan adapter needs {type(obj).__name__}.{attr}, which torchtitan "
                           f"{version} does not have (tested with torchtitan {', '.join(TESTED_VERSIONS)})") from None


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
        parallel_dims: torchtitan's ``ParallelDims`` (its ``build_mesh()`` already called): after a re-formed
            world the survivors call ``build_mesh()`` again, as a joiner does. Pass it whenever the mesh came
            from it.
        world_mesh: only for a mesh made with ``init_device_mesh`` (rebuilt with it); found from the parameters
            when None.
    """

    def __init__(self, sess: Any, model_parts: Sequence[Any], optimizers: Any, lr_schedulers: Any,
                 dataloader: Any, train_state: Any, *, world_mesh: Any = None, parallel_dims: Any = None) -> None:
        self.sess = sess
        self.model_parts = list(model_parts)
        self.optimizers = optimizers
        self.parallel_dims = parallel_dims
        if world_mesh is None and parallel_dims is not None:
            world_mesh = _require(parallel_dims, "world_mesh")
        self.world_mesh = world_mesh
        self._meshes: MeshSnapshot | None = None
        if _distributed_ready():
            self.record_meshes()   # local bookkeeping: which meshes/groups the model uses
            adopt_group_sockets()
            group = replica_group(self.model_parts)
            if group is not None:   # who holds this rank's shards: the donors of an unplanned recovery
                declare_replicas(sess, group, "" if len(group) > 1 else ALONE)
        if train_state is not None:
            register(sess, "titan.train_state", train_state, heavy=False)
        if dataloader is not None:
            register(sess, "titan.dataloader", dataloader, heavy=False)
        self._views = [ModelPartsState(self.model_parts), OptimizerState(optimizers, self.model_parts)]
        # Sharded state (sess.track_sharded): pure FSDP, no other rank holds this rank's shards, so they are
        # mirrored to a buddy node; HSDP, the replica group holds them (declared above) and nothing is mirrored, but
        # every rank keeps a local copy of the step's start: a rank dying inside the replicate all-reduce after
        # its shard group's last reduce-scatter leaves that group committed and its replicas not, and only a
        # rollback of everyone to the step's start is exact then.
        track_sharded = getattr(sess, "track_sharded", None)
        for name, view in (("titan.model", self._views[0]), ("titan.optimizer", self._views[1])):
            if callable(track_sharded):
                track_sharded(**{name: view})
            else:
                register(sess, name, view, heavy=True)
        if lr_schedulers is not None:
            register(sess, "titan.lr_schedulers", lr_schedulers, heavy=True)
        sess.on_reconfigure(self.reconfigure)

    @property
    def replicated(self) -> bool:
        """Whether another rank holds this rank's shards: only with a ``dp_replicate`` dimension of size > 1."""
        mesh: Any = self.world_mesh if self.world_mesh is not None else (self._meshes.root if self._meshes else None)
        names = getattr(mesh, "mesh_dim_names", None) or ()
        return "dp_replicate" in names and mesh["dp_replicate"].size() > 1

    def _roots(self) -> list[Any]:
        return [*self.model_parts, self.optimizers]

    def _rebuilt_parallel_dims(self) -> Any:
        """A joiner builds its meshes with ``ParallelDims.build_mesh()``: do exactly the same (same group creation
        order and backends), then make the user's ``parallel_dims`` object hand out the new meshes."""
        import dataclasses

        old = self.parallel_dims
        init = {f.name: getattr(old, f.name) for f in dataclasses.fields(old) if f.init and not f.name.startswith("_")}
        new = type(old)(**init)
        _require(new, "build_mesh")()
        for f in dataclasses.fields(old):
            object.__setattr__(old, f.name, getattr(new, f.name))
        return old

    def record_meshes(self) -> MeshSnapshot:
        self._meshes = MeshSnapshot.of(self._roots(), self.world_mesh)
        return self._meshes

    def reconfigure(self) -> int:
        """Rebuild the device mesh in the new world and re-point FSDP2's and the DTensors' references at it."""
        if self._meshes is None:
            raise RuntimeError("TorchTitanAdapter.record_meshes() was not called before the world was re-formed")
        mapping = (self._meshes.rebuild() if self.parallel_dims is None
                   else self._meshes.rebuild_from(self._rebuilt_parallel_dims()))
        old_root = self._meshes.root
        replaced = rebind_references(self._roots(), mapping)
        if self.world_mesh is not None:
            self.world_mesh = mapping[id(old_root)]
        self._meshes = MeshSnapshot.of(self._roots(), self.world_mesh)
        for view in self._views:
            view.refresh_layout()
        adopt_group_sockets()
        log.info("torchtitan: device mesh rebuilt, %d references re-pointed", replaced)
        return replaced


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


__all__ = ["MeshSnapshot", "ModelPartsState", "OptimizerState", "TorchTitanAdapter"]
