"""DeepSpeed: a Stateful view of a ``DeepSpeedEngine``, and the engine's groups re-created after a re-formed world.

A DeepSpeed script as its users write it, with the lines tpassrun adds (``tests/test_docs_run.py`` runs this very
block on CPU, under torchrun and under tpassrun with a rank SIGKILLed, and compares the two with ``torch.equal``)::

    import argparse

    import deepspeed
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import tpassrun
    from tpassrun.adapters.data import ResumableLoader
    from tpassrun.adapters.deepspeed import DeepSpeedAdapter

    # --deepspeed_config ds_config.json, e.g. {"train_micro_batch_size_per_gpu": 8,
    #   "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
    #   "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "total_num_steps": 100}}}
    # (ZeRO-1 or 2: the same script)
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args()
    sess = tpassrun.init(backend="gloo")             # instead of deepspeed.init_distributed(); "nccl" on GPUs
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=args.deepspeed_config)
    xs = torch.randn(1024, 16, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(xs, xs.sum(dim=1, keepdim=True).sin())
    loader = DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(),
                        sampler=DistributedSampler(dataset, seed=0))
    batches = ResumableLoader(loader)                # endless batches whose position travels with the rank
    DeepSpeedAdapter(sess, engine, data_loader=batches)

    def micro_step(i):                               # was: for x, y in loader: ...
        x, y = batches.next()
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()                                # the optimizer steps every gradient_accumulation_steps

    sess.run(micro_step, 60)

What travels (heavy = only at a handoff; light = also snapshotted at every step start):

* heavy: the module's ``state_dict()`` (under ZeRO-3 its buffers only); the optimizer through the engine's own
  objects: under ZeRO-1/2/3 ``engine.optimizer.state_dict()`` is *this rank's partition* (ZeRO-1/2:
  ``base_optimizer_state``, ``single_partition_of_fp32_groups``, ...; ZeRO-3: the base optimizer's state and
  ``fp32_flat_groups``, from which the load rebuilds the rank's parameter partitions) and is loaded back with
  ``load_from_fp32_weights=True`` so the fp32 master shard is exact
  even under bf16/fp16, without any collective; without ZeRO the wrapped optimizer's ``state_dict()``;
  ``engine.lr_scheduler``; ``global_steps``, ``global_samples``, ``skipped_steps``, ``micro_steps``. The loss
  scaler (an object, never pickled) travels as its plain attributes and is applied to the joiner's own scaler.
* light: the data position (any loader with ``state_dict()``, e.g. :class:`tpassrun.adapters.data.ResumableLoader`).

After a re-formed world (survivors, in ``on_reconfigure``) the adapter does what a joiner's
``deepspeed.initialize`` does collectively, in the same order: re-create the groups the engine cached (DeepSpeed's
clone of the world group in ``deepspeed.utils.groups``, the groups in ``deepspeed.comm``'s backend) with
``new_group``'s default synchronization, then the engine's parameter broadcast, whose result the survivors throw
away (the joiner loads the real state right after). Under ZeRO-3 those are the joiner's whole-parameter broadcasts
(the engine's, then zero.Init's as it partitions) and the ZeRO-3 optimizer's three barriers, made with throw-away
buffers, and every survivor's parameter coordinator goes back to a fresh one's state (its trace recording makes
collectives of its own). Both sides therefore issue the same collectives and the new world never hangs.

Replicas: ZeRO partitions are owned by DP index and nobody else holds a rank's partition, so under ZeRO-1/2/3 the
partition is tracked on its own as sharded state (:class:`DeepSpeedZeroState`, ``sess.track_sharded``): it is
mirrored to a buddy node (from step 0 on: DeepSpeed creates the optimizer state at initialization, so a death in
the first step or accumulation window is recovered too), and an unplanned failure takes the module, scheduler and
counters from a survivor and the partition from the mirror (without a mirror copy the job falls back to a
whole-group restart, saying why); a planned swap (the leaver sends its own partition) is exact. ZeRO-0 state is
identical on every rank: unplanned recovery takes it from a survivor. DeepSpeed does not save RNG; tpassrun's
generic RNG capture moves the global generators (``deepspeed.checkpointing``'s model-parallel CUDA tracker is not
covered).

Configurations the adapter cannot hand over run exactly as under torchrun (:func:`handover_refused`: nothing is
handed over, a planned swap is refused, an unplanned failure restarts the group with one console line saying
why): ZeRO-Offload / ZeRO-Infinity (``offload_optimizer``/``offload_param``: the partitions live in buffers or
NVMe files tpassrun does not copy), ``elastic_checkpoint`` under ZeRO-1/2, ZeRO++ hierarchical partitioning
(``zero_hpz_partition_size`` > 1) and the pipeline engine.

Tested against DeepSpeed 0.19.8 on CPU (``DS_ACCELERATOR=cpu``, gloo), each run ending ``torch.equal`` to the same
script under torchrun: ZeRO 0/1/2 planned swaps, a ZeRO-0 SIGKILL recovered from a replica, ZeRO-1/2 SIGKILLs
(mid-backward, and from outside at a random instant) recovered from the shard mirror, a ZeRO-1 SIGKILL without a
mirror, one under ``elastic_checkpoint`` and a ZeRO-3 one without a mirror falling back to a whole-group restart
that says why, a ZeRO-3 SIGKILL inside the first accumulation window recovered from the mirror
(``tests/test_deepspeed_real.py``); the example above (ZeRO-1 or 2 there, gradient accumulation, clipping,
WarmupDecayLR) through a SIGKILL at a random instant and then a planned swap (``tests/test_docs_run.py``);
``bench/frameworks.py`` repeats the SIGKILL at many instants on 4 ranks (``examples/deepspeed/train.py`` with
``ds_config_zero3.json`` for ZeRO-3), ``bench/node_instants.py --script`` a whole node. A ZeRO-3 run is compared
with :func:`zero3_partition` (the partition without DeepSpeed's alignment padding, which differs run to run).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from tpassrun.adapters._common import (
    GroupSnapshot,
    adopt_group_sockets,
    declare_replicas,
    portable,
    rebind_references,
    register,
    restore_portable,
)

log = logging.getLogger("tpassrun.adapters.deepspeed")

STATE_VERSION = 2
TESTED_VERSIONS = ("0.19.8",)
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
_SCALER_KEY = "__tpassrun_loss_scaler__"
_ENUM_KEY = "__tpassrun_int_enum__"
# Entries of a ZeRO optimizer state_dict that describe the live layout rather than training progress (fragment
# address objects, used by universal checkpoints only): kept from the joiner's own optimizer.
_LAYOUT_ONLY = ("param_slice_mappings",)
_PLAIN = (int, float, bool, str, type(None))


def zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


def _version() -> str:
    mod = sys.modules.get("deepspeed")
    return str(getattr(mod, "__version__", "unknown"))


def _require(obj: Any, attr: str) -> Any:
    """A DeepSpeed attribute the adapter depends on; a clear error naming the versions tested if it is gone."""
    try:
        return getattr(obj, attr)
    except AttributeError:
        raise RuntimeError(f"tpassrun's DeepSpeed adapter needs {type(obj).__name__}.{attr}, which DeepSpeed "
                           f"{_version()} does not have (tested with DeepSpeed {', '.join(TESTED_VERSIONS)})") from None


def _is_loss_scaler(obj: Any) -> bool:
    return any(c.__name__ == "LossScalerBase" for c in type(obj).__mro__)


def _scaler_state(scaler: Any) -> dict[str, Any]:
    import torch

    attrs = {k: v for k, v in vars(scaler).items() if type(v) in _PLAIN or isinstance(v, torch.dtype)}
    return {_SCALER_KEY: type(scaler).__name__, "attrs": attrs}


def _to_portable_optimizer(sd: Any) -> Any:
    """The ZeRO/fp16 optimizer's state_dict with its objects made plain: the loss scaler as its attributes,
    int enums (``ZeroStageEnum``) as ints, layout-only entries dropped."""
    import enum

    if not isinstance(sd, dict):
        return portable(sd)
    out: dict[str, Any] = {}
    for key, value in sd.items():
        if key in _LAYOUT_ONLY:
            continue
        if _is_loss_scaler(value):
            out[key] = _scaler_state(value)
        elif isinstance(value, enum.Enum):
            out[key] = {_ENUM_KEY: int(value.value)}
        else:
            out[key] = portable(value)
    return out


def _from_portable_optimizer(sd: Any, live: Any) -> Any:
    """Inverse of :func:`_to_portable_optimizer` against the joiner's own optimizer ``live``: the received scaler
    attributes are applied to the live scaler object, enums and layout entries are taken from the live state."""
    if not isinstance(sd, dict):
        return sd
    own = live.state_dict()
    out: dict[str, Any] = {}
    for key, value in sd.items():
        if isinstance(value, dict) and _SCALER_KEY in value:
            scaler = own.get(key)
            if scaler is None or type(scaler).__name__ != value[_SCALER_KEY]:
                raise ValueError(f"received a {value[_SCALER_KEY]} loss scaler, this engine has "
                                 f"{type(scaler).__name__}: the DeepSpeed configs differ")
            for attr, v in value["attrs"].items():
                setattr(scaler, attr, v)
            out[key] = scaler
        elif isinstance(value, dict) and set(value) == {_ENUM_KEY}:
            out[key] = own.get(key, value[_ENUM_KEY])
        else:
            out[key] = value
    for key in _LAYOUT_ONLY:
        if key in own:
            out[key] = own[key]
    return out


class DeepSpeedEngineState:
    """Module, optimizer (this rank's ZeRO partition), scheduler and counters of one engine. With
    ``optimizer=False`` the optimizer is left to a :class:`DeepSpeedZeroState` (tracked as sharded state)."""

    def __init__(self, engine: Any, *, optimizer: bool = True) -> None:
        self.engine = engine
        self.with_optimizer = optimizer

    @property
    def replicated(self) -> bool:
        """Whether every data-parallel rank holds this same state: only without ZeRO (stage 0), or without the
        optimizer. A survivor never donates a non-replicated state for an unplanned recovery (it would hand over
        the wrong partition)."""
        return zero_stage(self.engine) == 0 or not self.with_optimizer

    def why_not_replicated(self) -> str:
        return (f"DeepSpeed ZeRO-{zero_stage(self.engine)} keeps each rank's optimizer partition on that rank only; "
                "no live replica exists (a planned swap is exact, an unplanned failure restarts the group)")

    def drop_grads(self) -> None:
        """Forget the gradients of a step that failed half-way (it is re-executed after an unplanned recovery), or
        of an accumulation window rolled back to its start (its micro-steps are re-executed: the engine's micro-step
        count goes back to the window's start with them)."""
        self.engine.micro_steps = micro_steps_at_window_start(self.engine)
        self.engine.module.zero_grad(set_to_none=True)
        optimizer = getattr(self.engine, "optimizer", None)
        if optimizer is not None:
            if zero_stage(self.engine) in (1, 2):
                reset_zero_reduction(optimizer)
            elif zero_stage(self.engine) >= 3:
                reset_zero3_step(self.engine)
            optimizer.zero_grad(set_to_none=True)


    def state_dict(self) -> dict[str, Any]:
        engine = self.engine
        stage = zero_stage(engine)
        optimizer = getattr(engine, "optimizer", None)
        scheduler = getattr(engine, "lr_scheduler", None)
        return {
            "v": STATE_VERSION,
            "zero_stage": stage,
            "module": portable(_module_state(engine)),
            "optimizer": None if optimizer is None or not self.with_optimizer
            else _to_portable_optimizer(optimizer.state_dict()),
            "lr_scheduler": None if scheduler is None else portable(scheduler.state_dict()),
            "counters": {name: (micro_steps_at_window_start(engine) if name == "micro_steps" else getattr(engine, name))
                         for name in COUNTERS if hasattr(engine, name)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"deepspeed engine state version {state.get('v')!r}, expected {STATE_VERSION}")
        engine = self.engine
        stage = zero_stage(engine)
        if state["zero_stage"] != stage:
            raise ValueError(f"received ZeRO stage {state['zero_stage']} state, this engine runs stage {stage}")
        # ZeRO-3: the parameters are the partition's (DeepSpeedZeroState); the module carries its buffers only
        engine.module.load_state_dict(restore_portable(state["module"], engine.module.state_dict()), strict=stage < 3)
        if state["optimizer"] is not None:
            self._load_optimizer(_from_portable_optimizer(state["optimizer"], engine.optimizer), stage)
        if state["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for name, value in state["counters"].items():
            setattr(engine, name, value)

    def _load_optimizer(self, optim_state: Any, stage: int) -> None:
        optimizer = self.engine.optimizer
        if stage == 0:
            optimizer.load_state_dict(optim_state)
            return
        if getattr(optimizer, "elastic_checkpoint", False):
            # elastic loading merges every DP rank's partition; a handoff carries only this rank's
            raise ValueError("tpassrun: set zero_optimization.elastic_checkpoint=false to hand ZeRO state over")
        dp_size = int(getattr(self.engine, "dp_world_size", 1) or 1)
        # The engine's loader picks entry [dp_rank] of a per-partition list; this rank's is the only one we have.
        optimizer.load_state_dict([optim_state] * dp_size, load_optimizer_states=True, load_from_fp32_weights=True,
                                  checkpoint_folder=None)


def _module_state(engine: Any) -> Any:
    """The module's state_dict; under ZeRO-3 without its parameters: each rank holds its partition of them only
    (``ds_tensor``; the ``data`` of a partitioned one is empty), carried by :class:`DeepSpeedZeroState`, so what
    is left (buffers) is identical on every data-parallel rank."""
    state = engine.module.state_dict()
    if zero_stage(engine) < 3:
        return state
    params = {name for name, _ in engine.module.named_parameters(remove_duplicate=False)}
    kept = type(state)((k, v) for k, v in state.items() if k not in params)
    if hasattr(state, "_metadata"):
        kept._metadata = state._metadata
    return kept


def reset_zero3_step(engine: Any) -> None:
    """Put a ZeRO-3 engine back to how a step (or an accumulation window) finds it, after a forward/backward that
    failed half-way or a rollback to the window's start. Local only (the old process groups are gone).

    What a failed step leaves behind (read from DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer_Stage3``,
    ``PartitionedParameterCoordinator``, ``partition_parameters``): parameters gathered whole (or in flight, with
    all-gather handles of the dead world) and marked active in sub-modules; the reduction buckets; the
    gradient-accumulation counter; and the parameter coordinator's trace, which a fresh engine (the joiner's)
    records again from scratch with collectives (``assert_ints_same_as_other_ranks``) a survivor with a complete
    trace would not make. So every rank's coordinator goes back to a fresh one's state (the trace only steers
    prefetching: the numbers do not change), and survivors and joiner make the same collectives."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

    optimizer = engine.optimizer
    module = engine.module
    registry = getattr(module, "ds_inflight_param_registry", None)
    if registry is not None:
        registry.clear()            # all-gather handles of the dead world: never waited on
    for param in module.parameters():
        active = getattr(param, "ds_active_sub_modules", None)
        if active is not None:
            active.clear()
        if getattr(param, "ds_status", None) not in (None, ZeroParamStatus.NOT_AVAILABLE):
            # back to the partition (``ds_tensor`` is untouched by a forward/backward), persistent parameters too:
            # a failed forward may have released some of them on this rank only; partitioned everywhere, the
            # next forward gathers them on every rank alike (load_zero3_partition leaves a joiner the same)
            free_param(param)
    offload = getattr(optimizer, "parameter_offload", None)
    coordinator = offload.get_param_coordinator() if offload is not None else None
    if coordinator is not None:
        _fresh_coordinator(coordinator)
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        bucket.clear_params()
    flags = getattr(optimizer, "params_already_reduced", None)
    if isinstance(flags, dict):
        for key in flags:
            flags[key] = False
    if isinstance(getattr(optimizer, "averaged_gradients", None), dict):
        optimizer.averaged_gradients = {}
    optimizer.zero_grad(set_to_none=True)   # micro_step_id = 0: the window's first micro-step overwrites


def _fresh_coordinator(coordinator: Any) -> None:
    """A ZeRO-3 ``PartitionedParameterCoordinator`` as ``__init__`` leaves it: no trace (INVALID), no step in
    progress, nothing in flight or available. Its fields are name-mangled: set through the class's prefix."""
    from deepspeed.runtime.zero.partitioned_param_coordinator import ZeRoTraceMode

    prefix = "_PartitionedParameterCoordinator__"
    _require(coordinator, prefix + "trace_mode")
    setattr(coordinator, prefix + "trace_mode", ZeRoTraceMode.INVALID)
    _require(coordinator, "_clear_trace_structures")()
    setattr(coordinator, prefix + "step_id", 0)
    setattr(coordinator, prefix + "n_available_params", 0)
    for name in ("ongoing_fetch_events", "ongoing_fetch_leaf_module_events", "active_backward_submodules"):
        held = getattr(coordinator, prefix + name, None)
        if held is not None:
            held.clear()


def micro_steps_at_window_start(engine: Any) -> int:
    """The engine's micro-step count at the start of the current gradient-accumulation window.

    Invariant: tpassrun's accumulation window (the steps since the last optimizer step) starts where DeepSpeed's
    does, at a multiple of ``gradient_accumulation_steps`` micro-steps (the engine steps the optimizer when
    ``(micro_steps + 1) % gas == 0``, then counts that micro-step). ``micro_steps`` is the only counter that moves
    inside a window; it is heavy state (identical on every rank), so a rollback to the window's start must take
    it back too: a survivor or a joiner starting the window's first micro-step with the count of its second one
    would step the optimizer one micro-batch early on every rank, consistently, and silently diverge from
    torchrun. (A caller-owned boundary, ``managed_gradient_accumulation() == False``, keeps the count as is.)"""
    count = int(getattr(engine, "micro_steps", 0))
    managed = getattr(engine, "managed_gradient_accumulation", None)
    if callable(managed) and not managed():
        return count
    gas = engine.gradient_accumulation_steps() if callable(getattr(engine, "gradient_accumulation_steps", None)) else 1
    return count - count % max(1, int(gas))


def reset_zero_reduction(optimizer: Any) -> None:
    """Put a ZeRO-1/2 optimizer's gradient-reduction bookkeeping back to how a step finds it, after a backward that
    failed half-way (a peer died in one of its reductions): the partly filled reduction buckets, the "already
    reduced" flags and the partition counters would make the re-executed step reduce other sizes than the joiner's
    fresh optimizer (gloo: "Received data size doesn't match expected size"). Local only (no collective: the old
    process groups are gone by then). Read from DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer``."""
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        bucket.clear()
        bucket.index = 0
    for name in ("extra_large_param_to_reduce",):
        held = getattr(optimizer, name, None)
        if isinstance(held, dict):
            held.clear()
    flags = getattr(optimizer, "params_already_reduced", None)
    if isinstance(flags, list):
        flags[:] = [False] * len(flags)
    for lst in getattr(optimizer, "previous_reduced_grads", {}).values():
        lst.clear()
    for name in ("averaged_gradients", "all_grad_tensors"):
        held = getattr(optimizer, name, None)
        if isinstance(held, dict):
            for key in held:
                held[key] = None
    totals = getattr(optimizer, "total_grads_in_partition", {})
    for i, parts in getattr(optimizer, "is_partition_reduced", {}).items():
        for partition_id in parts:
            parts[partition_id] = False
            optimizer.remaining_grads_in_partition[i][partition_id] = totals[i][partition_id]
            computed = optimizer.is_grad_computed[i][partition_id]
            for param_id in computed:
                computed[param_id] = False
    release = getattr(optimizer, "_release_ipg_buffers", None)
    if callable(release):
        release()                       # also: ready_for_gradients = False (the next backward sets buckets up)
    if hasattr(optimizer, "micro_step_id"):
        optimizer.micro_step_id = -1    # INITIAL_MICRO_STEP_ID, as step() leaves it
    if hasattr(optimizer, "_epilogue_ran_this_backward"):
        optimizer._epilogue_ran_this_backward = False


class DeepSpeedZeroState:
    """This rank's ZeRO optimizer partition alone (fp32 master shard, base optimizer state, loss scaler; under
    ZeRO-3 also this rank's parameter partition, restored from the fp32 master shard):
    tracked as sharded state (``sess.track_sharded``), so that it is mirrored to a buddy node and an unplanned
    failure is recovered from there; module, scheduler and counters stay in the replicated
    :class:`DeepSpeedEngineState`."""

    replicated = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def why_not_replicated(self) -> str:
        return f"DeepSpeed ZeRO-{zero_stage(self.engine)} keeps each rank's optimizer partition on that rank only"

    def copy_at_start(self) -> bool:
        """DeepSpeed creates the partition's optimizer state at initialization (a zero-gradient step in
        ``initialize_optimizer_states``): its ``state_dict()`` changes nothing at step 0, which is copied too."""
        return True

    def commit_optimizers(self) -> list[Any]:
        """The step of the torch optimizer inside the ZeRO optimizer is where the partition starts changing."""
        base = getattr(self.engine.optimizer, "optimizer", None)
        import torch

        return [base] if isinstance(base, torch.optim.Optimizer) else []

    def state_dict(self) -> dict[str, Any]:
        return {"v": STATE_VERSION, "zero_stage": zero_stage(self.engine),
                "optimizer": _to_portable_optimizer(self.engine.optimizer.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"deepspeed ZeRO state version {state.get('v')!r}, expected {STATE_VERSION}")
        stage = zero_stage(self.engine)
        if state["zero_stage"] != stage:
            raise ValueError(f"received ZeRO stage {state['zero_stage']} state, this engine runs stage {stage}")
        optim_state = _from_portable_optimizer(state["optimizer"], self.engine.optimizer)
        if stage >= 3:
            load_zero3_partition(self.engine, optim_state)
        else:
            DeepSpeedEngineState(self.engine)._load_optimizer(optim_state, stage)


def load_zero3_partition(engine: Any, optim_state: dict[str, Any]) -> None:
    """This rank's ZeRO-3 partition into the live engine, without communication: DeepSpeed 0.19.8's rigid loader
    (base optimizer state, fp32 master partition, the parameter partitions rebuilt from it), then every parameter
    partitioned (persistent ones too). That is the state every rank of a re-formed world starts from: a survivor's
    reset (:func:`reset_zero3_step`) leaves the same, and the first forward then gathers what it needs on every
    rank alike. (DeepSpeed's own ``load_state_dict`` partitions the persistent parameters and expects a collective
    gather after it.)"""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, free_param

    optimizer = engine.optimizer
    if getattr(optimizer, "elastic_checkpoint", False):
        raise ValueError("tpassrun: ZeRO-3 elastic checkpointing is not handed over")
    _require(optimizer, "_rigid_load_state_dict")(optim_state, load_optimizer_states=True)
    for param in engine.module.parameters():
        active = getattr(param, "ds_active_sub_modules", None)
        if active is not None:
            active.clear()
        if getattr(param, "ds_status", ZeroParamStatus.NOT_AVAILABLE) != ZeroParamStatus.NOT_AVAILABLE:
            free_param(param)


def zero3_partition(engine: Any) -> dict[str, Any]:
    """This rank's ZeRO-3 partition as plain tensors without DeepSpeed's alignment padding: ``params`` (name ->
    this rank's slice of each parameter, whole for a persistent one), ``fp32`` (the master partition, per sub-group
    one tensor per parameter) and ``optim`` (the base optimizer's state, per sub-group, the same way). What to
    compare between two runs: a partition's elements past the parameter's end (the last rank's, or a whole
    partition of a parameter smaller than the world) are ``torch.empty`` memory of ``zero.Init``'s partition buffer
    that nothing reads, and they differ run to run under plain torchrun too (rank 1's fp32 partition of a 2-rank
    run of examples/deepspeed/train.py: one element, 5.2e28 in one run, 3013.3 in the next). DeepSpeed's own
    ``get_groups_without_padding`` trims the last rank's only."""
    import torch
    import torch.distributed as dist

    def valid(p: Any) -> int:
        """How many elements of this rank's partition of ``p`` are the parameter's."""
        part = int(p.ds_tensor.ds_numel)
        index = dist.get_rank(p.ds_process_group) if dist.is_initialized() else 0
        return max(0, min(part, int(p.ds_numel) - index * part))

    def lean(flat: Any, group: list[Any]) -> list[Any]:
        out, offset = [], 0
        for p in group:
            part = int(p.ds_tensor.ds_numel)
            out.append(flat.detach()[offset:offset + valid(p)].clone())
            offset += part
        return out

    optimizer = engine.optimizer
    params: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        params[name] = (p.data.detach().clone() if getattr(p, "ds_persist", False)
                        else p.ds_tensor.detach()[:valid(p)].clone())
    groups = _require(optimizer, "fp16_groups")
    flats = _require(optimizer, "fp32_partitioned_groups_flat")
    fp32 = [lean(flat, group) for flat, group in zip(flats, groups)]
    optim: list[dict[str, Any]] = []
    for flat, group in zip(flats, groups):
        state = optimizer.optimizer.state.get(flat, {})
        optim.append({key: lean(value, group) if torch.is_tensor(value) and value.numel() == flat.numel()
                      else value.detach().clone() if torch.is_tensor(value) else value
                      for key, value in state.items()})
    return {"params": params, "fp32": fp32, "optim": optim}


# ZeRO-3 live recovery (the partition mirrored, a failed step reset, the survivors mirroring the joiner's
# initialization collectives): every SIGKILL trial at a random instant, 4 ranks + 1 spare, recovered live and
# torch.equal to torchrun (issue 35; bench/README.md). False sends ZeRO-3 back to torchrun's path (restart).
ZERO3_LIVE = True


def handover_refused(engine: Any) -> str | None:
    """Why tpassrun cannot hand this engine's state over (None: it can). Such a job runs exactly as under
    torchrun: an unplanned failure restarts the group, saying this. Each reason is a configuration whose state
    lives where the adapter does not reach, or that it was never tested with."""
    stage = zero_stage(engine)
    if any(c.__name__ == "PipelineEngine" for c in type(engine).__mro__):
        return "DeepSpeed's pipeline engine (PipelineModule) is not handed over by tpassrun"
    for what, getter in (("offload_optimizer", "zero_offload_optimizer"), ("offload_param", "zero_offload_param")):
        get = getattr(engine, getter, None)
        offload = get() if callable(get) and stage >= 1 else None
        device = str(getattr(getattr(offload, "device", None), "value", getattr(offload, "device", "none")))
        if offload is not None and device not in ("none", "None"):
            return (f"DeepSpeed ZeRO-{stage} with {what} to {device} keeps the partitions in "
                    f"{'NVMe swap files' if device == 'nvme' else 'offload buffers'} tpassrun does not copy")
    elastic = getattr(engine, "zero_elastic_checkpoint", None)
    if stage in (1, 2) and callable(elastic) and elastic():
        return ("DeepSpeed ZeRO-{} with zero_optimization.elastic_checkpoint=true loads every rank's partition at "
                "once; a handoff carries one").format(stage)
    hpz = getattr(engine, "zero_hpz_partition_size", None)
    if stage >= 3 and callable(hpz) and int(hpz() or 1) > 1:
        return "DeepSpeed ZeRO++ hierarchical partitioning (zero_hpz_partition_size > 1) is not handed over"
    if stage >= 3 and not ZERO3_LIVE:
        return ("DeepSpeed ZeRO-3 partitions are not handed over live yet (the survivor of a recovery fails "
                "after the joiner comes in)")
    return None


class RefusedState:
    """Stands, in the session, for an engine tpassrun cannot hand over (:func:`handover_refused`): a handoff is
    refused (``handover_refused()``, the worker's ``on_send_state``) and no rank is another's replica."""

    replicated = False

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def why_not_replicated(self) -> str:
        return self.reason

    def handover_refused(self) -> str:
        return self.reason

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(f"tpassrun: {self.reason}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError(f"tpassrun: {self.reason}")


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


class DeepSpeedAdapter:
    """Registers a DeepSpeed engine with a tpassrun session and, after every swap, repeats on the survivors the
    collectives a joiner's ``deepspeed.initialize`` makes.

    Args:
        sess: the session from ``tpassrun.init()``.
        engine: the ``DeepSpeedEngine`` from ``deepspeed.initialize``.
        data_loader: a loader with ``state_dict()``/``load_state_dict()`` (e.g.
            :class:`tpassrun.adapters.data.ResumableLoader`), carried per rank.
    """

    def __init__(self, sess: Any, engine: Any, *, data_loader: Any = None) -> None:
        if _version() not in TESTED_VERSIONS and "deepspeed" in sys.modules:
            log.warning("tpassrun's DeepSpeed adapter was tested with DeepSpeed %s, this is %s",
                        ", ".join(TESTED_VERSIONS), _version())
        self.sess = sess
        self.engine = engine
        self.data_loader = data_loader
        self._groups: GroupSnapshot | None = None
        self.refused = handover_refused(engine)
        if self.refused is not None:
            # torchrun's path: nothing is handed over, an unplanned failure restarts the group (one console line,
            # the agent's, says why: the reason declared below), a planned swap is refused
            log.info("tpassrun cannot hand this DeepSpeed engine over: %s", self.refused)
            self.engine_state: Any = RefusedState(self.refused)
            self.zero_state: DeepSpeedZeroState | None = None
            if _distributed_ready():
                import torch.distributed as dist

                declare_replicas(sess, [dist.get_rank()], self.refused)
            register(sess, "deepspeed.engine", self.engine_state, heavy=True)
            sess.on_reconfigure(self.reconfigure)   # (a planned swap is refused: never called)
            return
        # ZeRO-1/2/3: the optimizer partition (ZeRO-3: and the parameters') is sharded state of its own (mirrored to
        # a buddy node), the rest of the engine is identical on every data-parallel rank
        track_sharded: Any = getattr(sess, "track_sharded", None)   # callable whenever self.zero_state is set
        sharded = zero_stage(engine) >= 1 and callable(track_sharded)
        self.engine_state = DeepSpeedEngineState(engine, optimizer=not sharded)
        self.zero_state = DeepSpeedZeroState(engine) if sharded else None
        if _distributed_ready():
            self.record_groups()   # local bookkeeping only: which groups the engine uses, and their members
            adopt_group_sockets()
            if zero_stage(engine) >= 1:   # nobody else holds this rank's partition (the mirror may: track_sharded)
                import torch.distributed as dist

                declare_replicas(sess, [dist.get_rank()], f"DeepSpeed ZeRO-{zero_stage(engine)} keeps each rank's "
                                                          "optimizer partition on that rank only")
        register(sess, "deepspeed.engine", self.engine_state, heavy=True)
        if self.zero_state is not None:
            track_sharded(**{"deepspeed.zero": self.zero_state})
        if data_loader is not None and hasattr(data_loader, "state_dict") and hasattr(data_loader, "load_state_dict"):
            register(sess, "deepspeed.data", data_loader, heavy=False)
        sess.on_reconfigure(self.reconfigure)

    @property
    def replicated(self) -> bool:
        """Whether another data-parallel rank holds everything this rank holds: only without ZeRO (stage 0)."""
        return self.engine_state.replicated and self.zero_state is None

    def _roots(self) -> list[Any]:
        roots: list[Any] = [self.engine]
        groups_module = sys.modules.get("deepspeed.utils.groups")
        if groups_module is not None:
            roots.append(vars(groups_module))   # module globals cache the world clone and the DP/MP/EP groups
        comm_module = sys.modules.get("deepspeed.comm.comm")
        backend = getattr(comm_module, "cdb", None)
        if backend is not None:
            roots.append(backend)               # deepspeed.comm's backend keeps the world group it was made with
        return roots

    def record_groups(self) -> GroupSnapshot:
        """Note the groups the engine uses while they are alive (call once the engine exists; the first
        :meth:`reconfigure` cannot, because by then the worker has destroyed the old world)."""
        self._groups = GroupSnapshot.of(self._roots())
        return self._groups

    def _mirror_zero3_init(self) -> None:
        """The collectives a joiner's ``deepspeed.initialize`` makes under ZeRO-3 (DeepSpeed 0.19.8), made by a
        survivor with throw-away buffers of the same sizes, results discarded: the engine's parameter broadcast
        (the joiner's module is not partitioned yet: every parameter whole), zero.Init's broadcast of each
        parameter from the partition group's first rank as it partitions it, the optimizer's three barriers
        (fp16 partitions, fp32 partitions, optimizer state) and its gradient hooks' all-gather of each trainable
        parameter. This rank's parameter coordinator goes back to a fresh one's state, as the joiner's is
        (:func:`reset_zero3_step`)."""
        import torch
        import torch.distributed as dist

        engine = self.engine
        from deepspeed.utils import groups as ds_groups

        def whole(p: Any) -> Any:
            return torch.empty(int(p.ds_numel) * p.element_size(), dtype=torch.uint8, device=p.ds_tensor.device)

        src = ds_groups._get_broadcast_src_rank()
        for _name, p in engine.module.named_parameters():
            dist.broadcast(whole(p), src, group=engine.seq_data_parallel_group)
        for p in engine.module.parameters(recurse=True):
            group = p.ds_process_group
            dist.broadcast(whole(p), 0 if group is None else dist.get_global_rank(group, 0), group=group)
        for _ in range(3):
            dist.barrier()
        reset_zero3_step(engine)     # every parameter partitioned, as the joiner's are here
        # the ZeRO-3 optimizer's gradient hooks: each trainable parameter gathered whole, then partitioned again
        # (a survivor's own partitions are left as they were: partition() of a gathered parameter only frees it)
        for group in engine.optimizer.fp16_groups:
            for p in group:
                if p.requires_grad:
                    p.all_gather()
                    p.partition()

    def reconfigure(self) -> int:
        """Re-create every group the engine cached, with the same members, in the order the joiner's engine
        creates them; re-point references; then mirror the joiner's parameter broadcast (result discarded)."""
        import torch

        if self._groups is None:
            raise RuntimeError("DeepSpeedAdapter.record_groups() was not called before the world was re-formed")
        mapping = self._groups.recreate()
        replaced = rebind_references(self._roots(), mapping)
        if zero_stage(self.engine) >= 3:
            # ZeRO-3 parameters keep their partition group as an attribute (ds_process_group), and the walk does
            # not enter parameters: their attribute dicts are walked instead
            replaced += rebind_references([vars(p) for p in self.engine.module.parameters()], mapping)
        self._groups = GroupSnapshot.of(self._roots())   # ready for the next swap
        if zero_stage(self.engine) >= 3:
            self._mirror_zero3_init()
        else:
            broadcast = _require(self.engine, "_broadcast_model")
            params = [p for p in self.engine.module.parameters()]
            kept = [p.detach().clone() for p in params]
            broadcast()
            with torch.no_grad():
                for p, k in zip(params, kept):
                    p.copy_(k)
        adopt_group_sockets()
        log.info("deepspeed: %d groups re-created, %d references re-pointed", len(mapping), replaced)
        return replaced


__all__ = ["DeepSpeedAdapter", "DeepSpeedEngineState", "DeepSpeedZeroState", "TESTED_VERSIONS", "zero3_partition",
           "zero_stage"]
