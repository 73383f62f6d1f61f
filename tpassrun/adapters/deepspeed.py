"""DeepSpeed: a Stateful view of a ``DeepSpeedEngine``, and re-created groups after a re-formed world.

    engine, optimizer, loader, scheduler = deepspeed.initialize(...)
    adapter = DeepSpeedAdapter(sess, engine, data_loader=loader)
    sess.run(step_fn, total_steps)

What travels (all heavy, i.e. only at a handoff, except the data loader's position):

* the module's ``state_dict()``;
* the optimizer through the engine's own objects: under ZeRO-1/2 ``engine.optimizer.state_dict()`` is *this
  rank's partition* (``base_optimizer_state``, ``single_partition_of_fp32_groups``, loss scaler, ...) and is loaded
  back with ``load_state_dict([...], load_from_fp32_weights=True)`` so the fp32 master shard is exact even under
  bf16/fp16; without ZeRO ``optimizer.state_dict()`` / ``load_state_dict()``;
* ``engine.lr_scheduler``; ``global_steps``, ``global_samples``, ``skipped_steps``, ``micro_steps``;
* light: the data loader's position when it has ``state_dict()`` (DeepSpeed's own loader does not).

ZeRO partitions are owned by DP index: a joiner must take the leaver's rank (tpassrun always does). Nobody else
holds a rank's partition, so an *unplanned* failure has no live replica under ZeRO >= 1 (:attr:`replicated` is
False); a planned swap (the leaver sends its own partition) is exact. ZeRO-3 parameter partitions are refused.
DeepSpeed does not save RNG; tpassrun's generic RNG capture moves the global generators (``deepspeed.checkpointing``'s
model-parallel CUDA tracker, used with activation checkpointing + MP, is not covered).

Not exercised here: DeepSpeed is a heavy install (CPU runs need ``DS_ACCELERATOR=cpu`` and a JIT build); the tests
use stand-ins with the same method names. deepspeed is imported lazily, only to find its cached groups.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ._common import GroupSnapshot, portable, rebind_references, register, restore_portable

log = logging.getLogger("tpassrun.adapters.deepspeed")

STATE_VERSION = 1
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def zero_stage(engine: Any) -> int:
    stage = getattr(engine, "zero_optimization_stage", None)
    return int(stage()) if callable(stage) else 0


class DeepSpeedEngineState:
    """Module, optimizer (this rank's ZeRO partition), scheduler and counters of one engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        engine = self.engine
        stage = zero_stage(engine)
        if stage >= 3:
            raise NotImplementedError("tpassrun: ZeRO-3 parameter partitions are not handed over (use ZeRO-1/2)")
        optimizer = getattr(engine, "optimizer", None)
        scheduler = getattr(engine, "lr_scheduler", None)
        return {
            "v": STATE_VERSION,
            "zero_stage": stage,
            "module": portable(engine.module.state_dict()),
            "optimizer": None if optimizer is None else portable(optimizer.state_dict()),
            "lr_scheduler": None if scheduler is None else portable(scheduler.state_dict()),
            "counters": {name: getattr(engine, name) for name in COUNTERS if hasattr(engine, name)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("v") != STATE_VERSION:
            raise ValueError(f"deepspeed engine state version {state.get('v')!r}, expected {STATE_VERSION}")
        engine = self.engine
        stage = zero_stage(engine)
        if state["zero_stage"] != stage:
            raise ValueError(f"received ZeRO stage {state['zero_stage']} state, this engine runs stage {stage}")
        engine.module.load_state_dict(restore_portable(state["module"], engine.module.state_dict()), strict=True)
        if state["optimizer"] is not None:
            self._load_optimizer(state["optimizer"], stage)
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


def _distributed_ready() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class DeepSpeedAdapter:
    """Registers a DeepSpeed engine with a tpassrun session and re-creates its groups after every swap.

    Args:
        sess: the session from ``tpassrun.init()``.
        engine: the ``DeepSpeedEngine`` from ``deepspeed.initialize``.
        data_loader: a loader (or sampler) with ``state_dict()``/``load_state_dict()``, carried per rank.
    """

    def __init__(self, sess: Any, engine: Any, *, data_loader: Any = None) -> None:
        self.sess = sess
        self.engine = engine
        self.data_loader = data_loader
        self.engine_state = DeepSpeedEngineState(engine)
        self._groups: GroupSnapshot | None = None
        if _distributed_ready():
            self.record_groups()   # local bookkeeping only: which groups the engine uses, and their members
        register(sess, "deepspeed.engine", self.engine_state, heavy=True)
        if data_loader is not None and hasattr(data_loader, "state_dict") and hasattr(data_loader, "load_state_dict"):
            register(sess, "deepspeed.data", data_loader, heavy=False)
        sess.on_reconfigure(self.reconfigure)

    @property
    def replicated(self) -> bool:
        """Whether another data-parallel rank holds everything this rank holds: only without ZeRO (stage 0).
        Under ZeRO-1/2 the optimizer partition is unique: only a planned swap (the leaver sends) is exact."""
        return zero_stage(self.engine) == 0

    def _roots(self) -> list[Any]:
        roots: list[Any] = [self.engine]
        groups_module = sys.modules.get("deepspeed.utils.groups")
        if groups_module is not None:
            roots.append(vars(groups_module))   # module globals cache the DP/MP/EP groups
        return roots

    def record_groups(self) -> GroupSnapshot:
        """Note the groups the engine uses while they are alive (call once the engine exists; the first
        :meth:`reconfigure` cannot, because by then the worker has destroyed the old world)."""
        self._groups = GroupSnapshot.of(self._roots())
        return self._groups

    def reconfigure(self) -> int:
        """Re-create every group the engine cached, with the same members, and re-point references to them."""
        if self._groups is None:
            raise RuntimeError("DeepSpeedAdapter.record_groups() was not called before the world was re-formed")
        mapping = self._groups.recreate()
        replaced = rebind_references(self._roots(), mapping)
        self._groups = GroupSnapshot.of(self._roots())   # ready for the next swap
        log.info("deepspeed: %d groups re-created, %d references re-pointed", len(mapping), replaced)
        return replaced


__all__ = ["DeepSpeedAdapter", "DeepSpeedEngineState", "zero_stage"]
