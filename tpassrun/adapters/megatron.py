"""Megatron-LM / megatron-core: what a rank must hand over, and what to rebuild after a re-formed world.

A megatron-core training loop with the lines tpassrun adds; the adapter comes right after the model, optimizer and
scheduler exist (a joiner loads the received state at that moment). ``tests/test_docs_run.py`` runs this very
block on CPU (megatron-core's GPU-only calls pointed at the CPU by ``examples/megatron/cpu_shims.py``), under
torchrun and under tpassrun with a rank SIGKILLed, and compares the two with ``torch.equal``::

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    import tpassrun
    from tpassrun.adapters.megatron import MegatronAdapter

    sess = tpassrun.init(backend="gloo")             # instead of init_process_group; "nccl" on GPUs
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                   max_sequence_length=16)           # on GPUs: .cuda()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)     # --use-distributed-optimizer
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)
    config.finalize_model_grads_func = finalize_model_grads
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, clip_grad=1.0, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt_config, [model])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=8,
                                        lr_decay_steps=120, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=120, wd_incr_style="constant")
    MICRO, DP = 2, ps.get_data_parallel_world_size()

    def batches(consumed):                           # as Megatron's sampler: a function of consumed_train_samples
        while True:
            start = consumed + ps.get_data_parallel_rank() * MICRO
            yield torch.randint(0, 128, (MICRO, 17), generator=torch.Generator().manual_seed(start))
            consumed += MICRO * DP

    adapter = MegatronAdapter(sess, [model], optimizer, scheduler, data_iterator=batches(0),
                              rebuild_data_iterator=batches)   # a joiner's iterator restarts at its position

    def forward_step(data_iterator, gpt):
        tokens = next(data_iterator)
        mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).triu(1)      # True: masked
        per_token = gpt(tokens[:, :-1], torch.arange(16).expand(MICRO, -1), mask, labels=tokens[:, 1:])
        return per_token, lambda out: (out.float().mean(), {})

    forward_backward = get_forward_backward_func()

    def train_step(iteration):                       # was: for iteration in range(...): train_step(...)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        adapter.progress.advance(MICRO * DP)         # counted at the step's start: its backward pass can seal it
        forward_backward(forward_step_func=forward_step, data_iterator=adapter.data_iterator, model=[model],
                         num_microbatches=1, seq_length=16, micro_batch_size=MICRO, forward_only=False)
        ok, _grad_norm, _zeros = optimizer.step()
        if ok:
            scheduler.step(increment=MICRO * DP)

    sess.run(train_step, 30)

The data iterator must be read through ``adapter.data_iterator`` (a joiner's is rebuilt by
``rebuild_data_iterator(consumed_train_samples)``), and ``adapter.progress`` advanced every iteration whatever the
step returns, at the step's start, before its first collective: the step's per-rank state is then whole when its
backward pass seals it, so a death after the survivors completed the step is recovered live (advanced after the
backward pass, as Megatron-LM counts, it switches the seal off and such a death restarts the group).
``examples/megatron/train_gpt.py`` is the same loop with TP, dropout and logging.

What travels (heavy = only at a handoff; light = also snapshotted at every step start for unplanned rollback):

* heavy ``megatron.model``: each model chunk's ``state_dict_for_save_checkpoint()`` (virtual-pipeline chunks are
  a list). The joiner takes the leaver's rank, hence the same TP/PP/CP/EP coordinates, so the rank-local form is
  exactly right; ``sharded_state_dict`` would only be needed to re-shard onto different coordinates.
* heavy ``megatron.optimizer``: ``optimizer.state_dict()`` plus, for a DistributedOptimizer
  (``--use-distributed-optimizer``), this rank's own shard (fp32 main params, ``exp_avg``, ``exp_avg_sq``,
  ``step``) via ``get_parameter_state_dp_reshardable()`` / ``load_parameter_state_from_dp_reshardable()``: no copy
  and no collective, unlike the ``dp_zero`` form, which gathers on DP rank 0 and so cannot run while the world is
  paused for a handoff. A DistributedOptimizer's shard is *sharded state* (``sess.track_sharded``): kept in a
  buddy's memory and refreshed every ``--shard-mirror-interval`` steps, as ZeRO-1/2's partitions are.
* heavy ``megatron.scheduler``: ``OptimizerParamScheduler.state_dict()``.
* light ``megatron.rng_tracker``: ``tensor_parallel.get_cuda_rng_tracker().get_states()`` (model-parallel,
  expert-parallel and data-parallel streams; differ across TP ranks, equal across DP replicas).
* light ``megatron.progress``: iteration, consumed train/valid samples, floating-point operations so far.
* light ``megatron.data``: the data iterator's own state if it has one (``state_dict`` or Energon's
  ``save_state``); Megatron's built-in samplers are rebuilt from ``consumed_train_samples`` instead.
* light ``megatron.rerun``: the rerun state machine (normally a single "not running" flag).

After a re-formed world every survivor runs :meth:`MegatronAdapter.reconfigure`: ``destroy_model_parallel()`` +
``initialize_model_parallel(...)`` with the same sizes, then every cached reference to an old group (layers'
``tp_group``, DDP bucket groups, the DistributedOptimizer's groups) is re-pointed at its new counterpart.

Donors: model and optimizer state exists only on ranks with the same model-parallel coordinates
(:func:`donor_rank`), which the adapter declares. Under a DistributedOptimizer nobody else holds this rank's
optimizer shard: an unplanned failure takes it from the buddy's mirror, together with the rank's model chunks
when it is model-parallel (TP/PP/CP/EP > 1: only its DP replicas hold them), and the scheduler from any rank; the
survivors roll back to the same step's local copy and the step in flight is re-executed (a whole node: every lost
rank's shard from its buddy). A planned swap is exact in every configuration (the leaver sends). Configurations
not handed over live (:func:`distopt_limit`: ``overlap_param_gather``, Megatron FSDP, several
DistributedOptimizer instances) run as under torchrun, a whole-group restart on an unplanned failure, the console
saying why in one line (:attr:`MegatronAdapter.live_recovery`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence

from tpassrun.adapters._common import (
    adopt_group_sockets,
    declare_replicas,
    portable,
    rebind_references,
    register,
    restore_portable,
)

log = logging.getLogger("tpassrun.adapters.megatron")

STATE_VERSION = 1
TESTED_VERSIONS = ("0.16.1",)
DEFAULT_ORDER = "tp-cp-ep-dp-pp"   # megatron-core's default rank order (the first token varies fastest)


# ---------------------------------------------------------------------------------------------
# rank layout: pure functions, mirroring megatron.core.parallel_state.RankGenerator


def _grid(rank: int, sizes: dict[str, int], order: str) -> dict[str, int]:
    """Coordinates of ``rank`` in the grid ``sizes`` laid out in ``order`` (first token fastest)."""
    tokens = order.lower().split("-")
    for name in sizes:
        if name not in tokens:
            tokens.append(name)   # Megatron appends missing size-1 dimensions the same way
    coords, stride = {}, 1
    for token in tokens:
        size = sizes.get(token, 1)
        coords[token] = (rank // stride) % size
        stride *= size
    return coords


def _rank_of(coords: dict[str, int], sizes: dict[str, int], order: str) -> int:
    """Inverse of :func:`_grid`."""
    tokens = order.lower().split("-")
    for name in sizes:
        if name not in tokens:
            tokens.append(name)
    rank, stride = 0, 1
    for token in tokens:
        rank += coords.get(token, 0) * stride
        stride *= sizes.get(token, 1)
    return rank


@dataclass(frozen=True)
class ParallelLayout:
    """The model-parallel sizes a job was started with: enough to re-initialise ``parallel_state`` identically
    and to compute who holds a replica of whom."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None           # expert tensor parallel size (None: same as tp, Megatron's default)
    vpp: int | None = None           # virtual pipeline stages per rank
    distopt_instances: int = 1       # num_distributed_optimizer_instances
    order: str = DEFAULT_ORDER
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)  # more initialize_model_parallel kwargs

    def data_parallel_size(self, world: int) -> int:
        mp = self.tp * self.pp * self.cp
        if world <= 0 or world % mp:
            raise ValueError(f"world size {world} is not a multiple of tp*pp*cp = {self.tp}*{self.pp}*{self.cp}")
        return world // mp

    def expert_data_parallel_size(self, world: int) -> int:
        etp = self.etp or self.tp
        emp = etp * self.ep * self.pp
        if world % emp:
            raise ValueError(f"world size {world} is not a multiple of etp*ep*pp = {etp}*{self.ep}*{self.pp}")
        return world // emp

    def coords(self, rank: int, world: int) -> dict[str, int]:
        """``{"tp", "cp", "dp", "pp"}`` in the dense grid and ``{"etp", "ep", "edp"}`` in the expert grid."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        if (not self.order.lower().endswith("pp") and self.pp > 1
                and self.expert_data_parallel_size(world) != self.data_parallel_size(world)):
            # Megatron refuses this too: the expert grid's pipeline groups would not match the dense grid's
            raise ValueError(f"order {self.order!r} without pp last needs equal dense and expert DP sizes")
        dense = _grid(rank, {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.data_parallel_size(world),
                             "pp": self.pp}, self.order)
        expert = _grid(rank, {"tp": self.etp or self.tp, "cp": 1, "ep": self.ep,
                              "dp": self.expert_data_parallel_size(world), "pp": self.pp}, self.order)
        return {"tp": dense["tp"], "cp": dense["cp"], "dp": dense["dp"], "pp": dense["pp"],
                "etp": expert["tp"], "ep": expert["ep"], "edp": expert["dp"]}

    def replica_ranks(self, rank: int, world: int) -> list[int]:
        """Every other rank holding the same model shards as ``rank`` (same TP/CP/PP and, with experts, the same
        expert coordinates), i.e. its data-parallel replicas, nearest DP index first (cyclically)."""
        mine = self.coords(rank, world)
        dp = self.data_parallel_size(world)
        dense = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": dp, "pp": self.pp}
        out = []
        for shift in range(1, dp):   # nearest DP index first, cyclically
            other = _rank_of({**mine, "ep": 0, "dp": (mine["dp"] + shift) % dp}, dense, self.order)
            if self.ep > 1:
                theirs = self.coords(other, world)
                if (theirs["etp"], theirs["ep"]) != (mine["etp"], mine["ep"]):
                    continue
            out.append((shift, other))
        return [r for _, r in sorted(out)]

    def init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``parallel_state.initialize_model_parallel`` reproducing this layout."""
        kwargs: dict[str, Any] = {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
            "num_distributed_optimizer_instances": self.distopt_instances,
            "order": self.order,
        }
        kwargs.update(self.extra)
        return kwargs

    @classmethod
    def from_parallel_state(cls, **extra: Any) -> "ParallelLayout":
        """Read the sizes of the live ``megatron.core.parallel_state`` (no I/O: module globals)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("megatron parallel_state is not initialised: call initialize_model_parallel first")
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
        inter = getattr(ps, "_INTER_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", None)
        distopt = inter.size() if inter is not None else 1
        return cls(tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size(),
                   cp=ps.get_context_parallel_world_size(), ep=ps.get_expert_model_parallel_world_size(),
                   etp=ps.get_expert_tensor_parallel_world_size(), vpp=vpp, distopt_instances=distopt,
                   extra=dict(extra))


def donor_rank(rank: int, tp: int, pp: int, cp: int, world: int, *, ep: int = 1, etp: int | None = None,
               order: str = DEFAULT_ORDER, avoid: Collection[int] = ()) -> int | None:
    """The rank that holds a replica of ``rank``'s model (and, without a sharded optimizer, optimizer) state:
    same TP/PP/CP (and expert) coordinates, another data-parallel replica; the next DP index, cyclically, that
    is not in ``avoid`` (dead or leaving ranks). None when DP size is 1 or every replica is avoided.

    >>> donor_rank(1, tp=2, pp=1, cp=1, world=4)    # ranks 0,1 = TP pair of replica 0; 2,3 = replica 1
    3
    """
    layout = ParallelLayout(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order)
    for other in layout.replica_ranks(rank, world):
        if other not in avoid:
            return other
    return None


# ---------------------------------------------------------------------------------------------
# Stateful views of Megatron objects


def _unwrap_chunks(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


class ModelChunksState:
    """All model chunks of this rank (one per virtual pipeline stage), in their rank-local form. ``replicated``
    is False when it is tracked as sharded state next to a DistributedOptimizer's shard (model-parallel ranks:
    only this rank's data-parallel replicas hold the same chunks, and the recovery takes its other state from any
    rank)."""

    copy_at_start = True    # its state_dict() is the model's at step 0 too (sharded state copied at step 0)

    def __init__(self, model: Any, *, replicated: bool = True) -> None:
        self.chunks = _unwrap_chunks(model)
        self.replicated = replicated

    def why_not_replicated(self) -> str:
        return ("a model-parallel rank's chunks, mirrored with its DistributedOptimizer shard (the tensor/pipeline "
                "peers of a rank hold other chunks)")

    def seal_modules(self) -> list[Any]:
        """The chunks themselves (``nn.Module``s, Megatron's DDP wrapper included): the session seals a step in
        their backward pass, before this rank's gradients reach the data-parallel all-reduce."""
        import torch

        return [c for c in self.chunks if isinstance(c, torch.nn.Module)]

    def state_dict(self) -> dict[str, Any]:
        out = []
        for chunk in self.chunks:
            save = getattr(chunk, "state_dict_for_save_checkpoint", None)
            out.append(portable(save() if save is not None else chunk.state_dict()))
        return {"v": STATE_VERSION, "chunks": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "model")
        if len(state["chunks"]) != len(self.chunks):
            raise ValueError(f"received {len(state['chunks'])} model chunks, this rank has {len(self.chunks)} "
                             "(different virtual pipeline size?)")
        for chunk, chunk_state in zip(self.chunks, state["chunks"]):
            chunk.load_state_dict(restore_portable(chunk_state, chunk.state_dict()), strict=True)


def _is_distributed_optimizer(opt: Any) -> bool:
    return hasattr(opt, "get_parameter_state_dp_reshardable") and hasattr(opt, "load_parameter_state_from_dp_reshardable")


def _leaf_optimizers(opt: Any) -> list[Any]:
    return list(getattr(opt, "chained_optimizers", None) or [opt])


class MegatronOptimizerState:
    """A MegatronOptimizer (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer, or a
    ChainedOptimizer of them). A DistributedOptimizer's parameter state is this rank's shard only: fp32 main
    params, ``exp_avg``, ``exp_avg_sq``, ``step``, read without a copy or a collective
    (``get_parameter_state_dp_reshardable``); ``replicated`` is then False (no other rank holds it)."""

    copy_at_start = True    # before its first step it travels as "fresh" (state_dict below)

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @property
    def sharded(self) -> bool:
        return any(_is_distributed_optimizer(o) for o in _leaf_optimizers(self.optimizer))

    @property
    def replicated(self) -> bool:
        return not self.sharded

    def why_not_replicated(self) -> str:
        return "Megatron's DistributedOptimizer keeps each data-parallel rank's optimizer shard on that rank only"

    def commit_optimizers(self) -> list[Any]:
        """The torch optimizers inside (``FP32Optimizer.optimizer``, ...): their ``step()`` runs after the
        gradient-norm collectives of a Megatron optimizer step, so it commits a training step."""
        import torch

        inner = [getattr(o, "optimizer", None) for o in _leaf_optimizers(self.optimizer)]
        return [o for o in inner if isinstance(o, torch.optim.Optimizer)]

    def state_dict(self) -> dict[str, Any]:
        leaves = _leaf_optimizers(self.optimizer)
        # A DistributedOptimizer's torch optimizer holds no state before its first step, and megatron-core's
        # state_dict() needs it (the step of its states): before that, "fresh" is the whole of it
        fresh = [i for i, o in enumerate(leaves) if _is_distributed_optimizer(o) and _never_stepped(o)]
        if fresh:
            common: Any = {_PER_LEAF: [_fresh_state(o) if i in fresh else portable(o.state_dict())
                                       for i, o in enumerate(leaves)]}
        else:
            common = portable(self.optimizer.state_dict())
        shards = {i: portable(o.get_parameter_state_dp_reshardable())
                  for i, o in enumerate(leaves) if _is_distributed_optimizer(o) and i not in fresh}
        return {"v": STATE_VERSION, "common": common, "param_shards": shards, "fresh": fresh}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        _check_version(state, "optimizer")
        leaves = _leaf_optimizers(self.optimizer)
        common, fresh = state["common"], [int(i) for i in state.get("fresh", ())]
        # common first: a DistributedOptimizer allocates its per-parameter state there
        if isinstance(common, dict) and _PER_LEAF in common:
            for i, (leaf, leaf_state) in enumerate(zip(leaves, common[_PER_LEAF])):
                if i in fresh:
                    _make_fresh(leaf, leaf_state)
                else:
                    leaf.load_state_dict(leaf_state)
        else:
            self.optimizer.load_state_dict(common)
        for leaf in leaves:
            if _is_distributed_optimizer(leaf):
                _unshare_steps(leaf)
        for index, shard in state["param_shards"].items():
            for bucket_states in _bucket_states(shard):
                for elem in bucket_states:
                    elem.setdefault("padding", False)   # the getter omits it; the loader filters on it
            with torch.no_grad():    # fp32 main params are views of the model's parameters: an in-place copy
                leaves[int(index)].load_parameter_state_from_dp_reshardable(shard)


_PER_LEAF = "__tpassrun_per_leaf__"


def _never_stepped(leaf: Any) -> bool:
    inner = getattr(leaf, "optimizer", None)
    return inner is not None and len(getattr(inner, "state", {})) == 0


def _fresh_state(leaf: Any) -> dict[str, Any]:
    scaler = getattr(leaf, "grad_scaler", None)
    return {"fresh": True, "grad_scaler": portable(scaler.state_dict()) if scaler else None}


def _make_fresh(leaf: Any, state: dict[str, Any]) -> None:
    """A DistributedOptimizer put back to before its first step (a survivor rolled back to step 0; a joiner's is
    already): no torch optimizer state, fp32 main params from the model's (loaded before it), the scaler's."""
    inner = leaf.optimizer
    inner.state.clear()
    for group in inner.param_groups:
        group.pop("step", None)          # (TE/Apex FusedAdam count steps in the group)
    reload = getattr(leaf, "reload_model_params", None)
    if callable(reload):
        reload()                         # fp32 main params as copies (bf16/fp16 models); views: the same values
    scaler = getattr(leaf, "grad_scaler", None)
    if scaler is not None and state.get("grad_scaler") is not None:
        scaler.load_state_dict(state["grad_scaler"])


def _unshare_steps(leaf: Any) -> None:
    """megatron-core 0.16's ``DistributedOptimizer.load_state_dict`` gives every parameter of a torch Adam the same
    ``step`` tensor; torch's Adam then adds 1 to it once per parameter at each step (wrong bias corrections from the
    next step on). One tensor per parameter, as the optimizer has it under torchrun."""
    seen: set[int] = set()
    for param_state in getattr(getattr(leaf, "optimizer", None), "state", {}).values():
        step = param_state.get("step") if isinstance(param_state, dict) else None
        if step is None or not hasattr(step, "clone"):
            continue
        if id(step) in seen:
            param_state["step"] = step.clone()
        seen.add(id(step))


def _bucket_states(shard: dict[Any, Any]) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for key, per_dtype in shard.items():
        if type(key) is int and isinstance(per_dtype, dict):
            for buckets in per_dtype.values():
                out.extend(buckets)
    return out


class SchedulerState:
    """Megatron's ``OptimizerParamScheduler``. Its ``load_state_dict`` *adds* the loaded step count to its own
    (``step(increment=num_steps)``): right on a joiner's fresh scheduler, twice the steps (a wrong learning rate
    from there on) on a survivor that takes a peer's state after a mixed commit. Loaded here from zero.
    ``last_epoch`` (its step count) lets the session tell whether a step that failed after its optimizer step had
    stepped the scheduler too."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    @property
    def last_epoch(self) -> int:
        return int(getattr(self.scheduler, "num_steps", 0))

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.scheduler, "num_steps"):
            self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(state)


class RngTrackerState:
    """Megatron's named CUDA RNG streams (``model-parallel-rng``, ``expert-parallel-rng``, ``data-parallel-rng``).

    The generic RNG capture covers ``torch.cuda``'s default generator; these streams live in the tracker."""

    def __init__(self, tracker_getter: Callable[[], Any] | None = None) -> None:
        self._tracker_getter = tracker_getter

    def _tracker(self) -> Any:
        if self._tracker_getter is not None:
            return self._tracker_getter()
        from megatron.core import tensor_parallel

        return tensor_parallel.get_cuda_rng_tracker()

    def state_dict(self) -> dict[str, Any]:
        states = {}
        for name, value in self._tracker().get_states().items():
            # cudagraph-safe trackers hold torch.Generator objects: their state is a tensor
            states[name] = value.get_state() if hasattr(value, "get_state") else value.clone()
        return {"v": STATE_VERSION, "states": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "rng_tracker")
        tracker = self._tracker()
        current = tracker.get_states()
        restored = {}
        for name, value in state["states"].items():
            live = current.get(name)
            if live is not None and hasattr(live, "set_state"):
                live.set_state(value)
                restored[name] = live
            else:
                restored[name] = value
        tracker.set_states(restored)


@dataclass
class MegatronProgress:
    """The counters Megatron's training loop keeps in ``args`` and its loop locals. The script updates them
    (:meth:`advance`) and reads them back on a joiner."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations: float = 0.0

    def advance(self, samples: int, flops: float = 0.0) -> None:
        self.iteration += 1
        self.consumed_train_samples += samples
        self.floating_point_operations += flops

    def state_dict(self) -> dict[str, Any]:
        return {"v": STATE_VERSION, "iteration": self.iteration, "consumed_train_samples": self.consumed_train_samples,
                "consumed_valid_samples": self.consumed_valid_samples,
                "floating_point_operations": float(self.floating_point_operations)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "progress")
        self.iteration = int(state["iteration"])
        self.consumed_train_samples = int(state["consumed_train_samples"])
        self.consumed_valid_samples = int(state["consumed_valid_samples"])
        self.floating_point_operations = float(state["floating_point_operations"])


class DataIteratorState:
    """The data iterator's position, when it can tell it (``state_dict`` / Energon's ``save_state``); otherwise
    ``rebuild(consumed_train_samples)`` re-creates it (Megatron's samplers are pure functions of that counter and
    the DP rank). The rebuild runs when the script next asks for the iterator (:attr:`iterator`), not when the
    position is loaded: a survivor rolled back loads it before the world is re-formed, when ``parallel_state``
    answers for no world (megatron-core: a data-parallel size of 0, a sampler that yields nothing)."""

    def __init__(self, iterator: Any, progress: MegatronProgress,
                 rebuild: Callable[[int], Any] | None = None) -> None:
        self._iterator = iterator
        self._rebuild_at: int | None = None     # a loaded position not rebuilt yet
        self.progress = progress
        self.rebuild = rebuild

    @property
    def iterator(self) -> Any:
        if self._rebuild_at is not None:
            assert self.rebuild is not None
            consumed, self._rebuild_at = self._rebuild_at, None
            self._iterator = _without_drawing(self.rebuild, consumed)
        return self._iterator

    @iterator.setter
    def iterator(self, value: Any) -> None:
        self._iterator, self._rebuild_at = value, None

    def state_dict(self) -> dict[str, Any]:
        if self._rebuild_at is None:
            it = self._iterator
            if hasattr(it, "state_dict"):
                return {"v": STATE_VERSION, "kind": "state_dict", "state": portable(it.state_dict())}
            if hasattr(it, "save_state"):
                return {"v": STATE_VERSION, "kind": "save_state", "state": portable(it.save_state())}
        # the position itself, not a reference to the counter: loading it needs no other object loaded first
        consumed = self._rebuild_at if self._rebuild_at is not None else self.progress.consumed_train_samples
        return {"v": STATE_VERSION, "kind": "consumed_samples", "state": None, "consumed": int(consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "data")
        kind = state["kind"]
        if kind == "state_dict":
            self.iterator.load_state_dict(state["state"])
        elif kind == "save_state":
            self.iterator.restore_state(state["state"])
        elif self.rebuild is not None:
            consumed = state.get("consumed")     # (absent from a sender of an earlier tpassrun: its counter)
            self._rebuild_at = int(consumed) if consumed is not None else int(self.progress.consumed_train_samples)


def _without_drawing(fn: Callable[[int], Any], arg: int) -> Any:
    """``fn(arg)`` with every global RNG put back after it: building a ``DataLoader`` iterator draws its base seed
    from torch's generator, and a rebuild inside a step would shift every random draw after it (dropout) away from
    the uninterrupted run's, where the iterator was built once, before training."""
    import random

    import torch

    py, cpu = random.getstate(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        import numpy as np
    except ImportError:
        np = None  # type: ignore[assignment]  # numpy is optional: then no numpy RNG to put back
    npy = np.random.get_state() if np is not None else None
    try:
        return fn(arg)
    finally:
        random.setstate(py)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if np is not None:
            np.random.set_state(npy)


class RerunStateMachineState:
    """Megatron's rerun state machine (result validation / step re-execution). Its enums travel by name and
    its ``ShardedObject`` wrapper is dropped: the joiner is the same rank, so the rank-level dict is enough."""

    def __init__(self, machine: Any, data_iterator: Any = None) -> None:
        self.machine = machine
        self.data_iterator = data_iterator

    def state_dict(self) -> dict[str, Any]:
        raw = self.machine.state_dict(self.data_iterator, "torch_dist")
        if raw is None:
            return {"v": STATE_VERSION, "active": False}
        sharded = raw["sharded"]
        sharded = getattr(sharded, "data", sharded)
        return {"v": STATE_VERSION, "active": True, "mode": raw["mode"].name, "state": raw["state"].name,
                "current_iteration": raw["current_iteration"], "sharded": portable(dict(sharded))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_version(state, "rerun")
        if not state["active"]:
            return
        machine = self.machine
        machine.load_state_dict({"mode": type(machine.mode)[state["mode"]], "state": type(machine.state)[state["state"]],
                                 "current_iteration": state["current_iteration"], "sharded": state["sharded"]})


def _check_version(state: Any, what: str) -> None:
    if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
        raise ValueError(f"megatron {what} state has version {getattr(state, 'get', lambda _k: None)('v')!r}, "
                         f"expected {STATE_VERSION}")


# ---------------------------------------------------------------------------------------------
# re-initialising parallel_state after a re-formed world


def _parallel_state_groups(ps: Any) -> dict[str, Any]:
    """Every process group (or list of groups) parallel_state holds, by global name."""
    import torch.distributed as dist

    out = {}
    for name, value in vars(ps).items():
        if not name.startswith("_"):
            continue
        if isinstance(value, dist.ProcessGroup):
            out[name] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dist.ProcessGroup) for v in value):
            out[name] = list(value)
    return out


def reinitialize_parallel_state(layout: ParallelLayout, roots: Sequence[Any]) -> int:
    """``destroy_model_parallel()`` + ``initialize_model_parallel(**layout.init_kwargs())``, then re-point every
    reference to an old group reachable from ``roots`` at the group with the same role. Returns the number of
    references replaced. Run on every rank of the re-formed world (group creation is collective)."""
    from megatron.core import parallel_state as ps

    old = _parallel_state_groups(ps)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(**layout.init_kwargs())
    new = _parallel_state_groups(ps)
    mapping: dict[int, Any] = {}
    for name, old_value in old.items():
        new_value = new.get(name)
        if new_value is None:
            continue
        if isinstance(old_value, list):
            for o, n in zip(old_value, new_value if isinstance(new_value, list) else []):
                mapping.setdefault(id(o), n)
        else:
            mapping.setdefault(id(old_value), new_value)
    replaced = rebind_references(roots, mapping)
    log.info("megatron parallel_state re-initialised (%s); %d cached group references re-pointed",
             layout.init_kwargs(), replaced)
    return replaced


def _megatron_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("megatron-core")
    except md.PackageNotFoundError:
        return "not installed"


def mirror_optimizer_setup(chunks: Sequence[Any], optimizer: Any, config_overrides: Any = None) -> int:
    """Make, on a survivor, the world-wide collectives a joiner makes while ``get_megatron_optimizer`` builds its
    optimizer: megatron-core 0.16 all-gathers every rank's parameter-group keys once per group of dense model
    chunks and once for the expert parameters (``_get_param_groups``). The survivor's own keys go in, the result
    is dropped, nothing is built. Returns the number of collectives made.

    The calls follow ``get_megatron_optimizer``'s own order for the version tested; pass
    ``MegatronAdapter(optimizer_factory=...)`` to repeat your own optimizer construction instead."""
    try:
        from megatron.core.optimizer import _get_param_groups
    except ImportError:
        raise RuntimeError(f"tpassrun's Megatron adapter mirrors megatron.core.optimizer._get_param_groups, which "
                           f"megatron-core {_megatron_version()} does not have (tested with megatron-core "
                           f"{', '.join(TESTED_VERSIONS)}): pass MegatronAdapter(optimizer_factory=...)") from None
    config = _leaf_optimizers(optimizer)[0].config
    chunks = list(chunks)
    fsdp = bool(getattr(getattr(chunks[0], "ddp_config", None), "use_megatron_fsdp", False))
    dense = ([[chunks[0]], chunks[1:]] if getattr(config, "overlap_param_gather_with_optimizer_step", False)
             else [chunks])
    calls = 0
    for group in dense:
        _get_param_groups(group, config, config_overrides)
        calls += 1
    if not fsdp:
        _get_param_groups(chunks, config, config_overrides)   # the expert-parallel parameters' groups
        calls += 1
    return calls


# ---------------------------------------------------------------------------------------------
# the DistributedOptimizer: handed over live, or what keeps it from it


def distopt_limit(chunks: Sequence[Any], layout: ParallelLayout, *, can_mirror: bool) -> str | None:
    """Why this DistributedOptimizer's shards cannot be recovered live from the mirror (None: they can). Each
    reason is a configuration this adapter has not made exact; the job then runs as under torchrun (a whole-group
    restart on an unplanned failure, said in one console line), never worse. Pure: reads config attributes."""
    if not can_mirror:
        return "this tpassrun session keeps no sharded state (sess.track_sharded)"
    if layout.distopt_instances > 1:
        return (f"num_distributed_optimizer_instances={layout.distopt_instances} (several DistributedOptimizer "
                "instances) is not handed over live")
    for chunk in chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is None:
            continue
        if getattr(ddp, "use_megatron_fsdp", False) or getattr(ddp, "use_custom_fsdp", False):
            return "Megatron FSDP (use_megatron_fsdp) is not handed over live"
        if getattr(ddp, "overlap_param_gather", False):
            # the next forward pass finishes the parameter all-gather the optimizer step started: the model a
            # step-start copy would read is still being written
            return "overlap_param_gather=True (the parameter all-gather runs into the next step) is not handed over live"
    return None


# ---------------------------------------------------------------------------------------------
# the adapter


class MegatronAdapter:
    """Registers a Megatron job's state with a tpassrun session and rebuilds its groups after every swap.

    Args:
        sess: the session from ``tpassrun.init()``.
        model: a model chunk or the list of chunks (virtual pipeline), usually wrapped in Megatron's DDP.
        optimizer: the MegatronOptimizer from ``get_megatron_optimizer``.
        opt_param_scheduler: Megatron's ``OptimizerParamScheduler`` (or None).
        data_iterator: the training data iterator, when it can report its position (see DataIteratorState).
        rerun_state_machine: ``get_rerun_state_machine()`` when the job uses result validation.
        layout: the parallel layout to re-create; read from the live ``parallel_state`` when None.
        rebuild_data_iterator: ``fn(consumed_train_samples) -> iterator`` for iterators without state.
        progress: counters to carry (a fresh MegatronProgress when None).
        optimizer_factory: the call that built ``optimizer`` (``lambda: get_megatron_optimizer(cfg, model)``).
            Building a Megatron optimizer is collective, so after a swap the survivors make the same collectives
            as the joiner: by default those of megatron-core 0.16's ``get_megatron_optimizer``
            (:func:`mirror_optimizer_setup`), with a factory by calling it and dropping the result.
    """

    def __init__(self, sess: Any, model: Any, optimizer: Any, opt_param_scheduler: Any, *,
                 data_iterator: Any = None, rerun_state_machine: Any = None, layout: ParallelLayout | None = None,
                 rebuild_data_iterator: Callable[[int], Any] | None = None,
                 progress: MegatronProgress | None = None,
                 rng_tracker_getter: Callable[[], Any] | None = None,
                 optimizer_factory: Callable[[], Any] | None = None) -> None:
        self.sess = sess
        self.optimizer_factory = optimizer_factory
        self.model = model
        self.optimizer = optimizer
        self.scheduler = opt_param_scheduler
        self.layout = layout if layout is not None else ParallelLayout.from_parallel_state()
        self.progress = progress if progress is not None else MegatronProgress()
        self.optimizer_state = MegatronOptimizerState(optimizer)
        chunks = _unwrap_chunks(model)
        track_sharded: Any = getattr(sess, "track_sharded", None)
        # a DistributedOptimizer: its shard (and, on a model-parallel rank, the model chunks, which only its
        # data-parallel replicas share) kept in a buddy's memory and recovered from there; or, when this
        # configuration is not handed over (distopt_limit), what torchrun does, said when a rank dies
        self.distopt_limit = (distopt_limit(chunks, self.layout, can_mirror=callable(track_sharded))
                              if self.optimizer_state.sharded else None)
        self.distopt_mirrored = self.optimizer_state.sharded and self.distopt_limit is None
        model_parallel = self.layout.tp * self.layout.pp * self.layout.cp * self.layout.ep > 1
        self.model_state = ModelChunksState(model, replicated=not (self.distopt_mirrored and model_parallel))
        self.rng_state = RngTrackerState(rng_tracker_getter)
        self.data_state = (DataIteratorState(data_iterator, self.progress, rebuild_data_iterator)
                           if data_iterator is not None or rebuild_data_iterator is not None else None)
        # light state first: on a joiner the counters must be loaded before the data iterator is rebuilt
        register(sess, "megatron.progress", self.progress, heavy=False)
        register(sess, "megatron.rng_tracker", self.rng_state, heavy=False)
        if self.data_state is not None:
            register(sess, "megatron.data", self.data_state, heavy=False)
        if rerun_state_machine is not None:
            register(sess, "megatron.rerun", RerunStateMachineState(rerun_state_machine, data_iterator), heavy=False)
        if self.model_state.replicated:
            register(sess, "megatron.model", self.model_state, heavy=True)
        else:
            track_sharded(**{"megatron.model": self.model_state})
        if self.distopt_mirrored:
            track_sharded(**{"megatron.optimizer": self.optimizer_state})
        else:
            register(sess, "megatron.optimizer", self.optimizer_state, heavy=True)
        if opt_param_scheduler is not None:
            register(sess, "megatron.scheduler", SchedulerState(opt_param_scheduler), heavy=True)
        self._declare_replicas()
        if _distributed_ready():
            adopt_group_sockets()   # a peer blocked in a tensor/data-parallel collective fails at once on a death
        sess.on_reconfigure(self.reconfigure)

    def _declare_replicas(self) -> None:
        """The donors of an unplanned recovery of this rank: its data-parallel replicas (same TP/PP/CP/expert
        coordinates); under a DistributedOptimizer this rank alone: its shard (and on a model-parallel rank its
        chunks) come from the buddy's mirror, the rest (scheduler) from any rank, or, when the configuration is
        not handed over, the group restarts saying why."""
        import torch.distributed as dist

        if not _distributed_ready():
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.optimizer_state.sharded:
            why = self.optimizer_state.why_not_replicated()
            declare_replicas(self.sess, [rank], f"{why}; {self.distopt_limit}" if self.distopt_limit else why)
        else:
            declare_replicas(self.sess, [rank, *self.layout.replica_ranks(rank, world)])

    @property
    def data_iterator(self) -> Any:
        """The current data iterator (a joiner may have rebuilt it)."""
        return None if self.data_state is None else self.data_state.iterator

    @property
    def replicated(self) -> bool:
        """Whether a live data-parallel replica holds everything this rank holds. False with a
        DistributedOptimizer (the shard is unique): see :attr:`live_recovery`."""
        return not self.optimizer_state.sharded

    @property
    def live_recovery(self) -> bool:
        """Whether an unplanned failure of this rank is recovered live: from a replica, or under a
        DistributedOptimizer from the buddy's mirror; False when :attr:`distopt_limit` says why not (then only a
        planned swap is live, an unplanned failure restarts the group as under torchrun)."""
        return self.distopt_limit is None

    def donor_for(self, rank: int, world: int, avoid: Collection[int] = ()) -> int | None:
        """:func:`donor_rank` for this job's layout."""
        lay = self.layout
        return donor_rank(rank, lay.tp, lay.pp, lay.cp, world, ep=lay.ep, etp=lay.etp, order=lay.order, avoid=avoid)

    def reconfigure(self) -> int:
        """Do on a survivor what a joiner does collectively while it builds its objects, in the same order:
        re-create parallel_state's groups (re-pointing the model's and optimizer's cached references at them),
        then the optimizer construction's collectives. Registered with ``sess.on_reconfigure``."""
        chunks = _unwrap_chunks(self.model)
        replaced = reinitialize_parallel_state(self.layout, [*chunks, self.optimizer])
        if self.optimizer_factory is not None:
            self.optimizer_factory()            # its collectives pair with the joiner's; the optimizer is dropped
        elif self.optimizer is not None and hasattr(_leaf_optimizers(self.optimizer)[0], "config"):
            mirror_optimizer_setup(chunks, self.optimizer)
        adopt_group_sockets()
        return replaced


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


__all__ = ["DEFAULT_ORDER", "DataIteratorState", "distopt_limit", "MegatronAdapter", "MegatronOptimizerState", "MegatronProgress",
           "ModelChunksState", "ParallelLayout", "RerunStateMachineState", "RngTrackerState", "SchedulerState",
           "donor_rank", "mirror_optimizer_setup", "reinitialize_parallel_state"]
