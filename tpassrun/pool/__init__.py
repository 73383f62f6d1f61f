"""Floating spares: one named spare pool in etcd for many jobs (issue 24). The one door of ``tpassrun.pool``.

``records`` (sealed pool records and the key layout), ``plan`` (pure decisions: a job's own spares, the pool, a
restart; a pool node's idle loop), ``etcd`` (the claim by compare-and-set bound to the claimer's lease),
``node`` (the pool node's loop, ``tpassctl pool join``), ``ctl`` (``tpassctl pool ...``). See docs/pool.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tpassrun.pool.etcd import Pool, PoolError
from tpassrun.pool.plan import (
    ClaimNode,
    JobNeed,
    NodeState,
    Phase,
    PoolView,
    Preempt,
    Restart,
    Source,
    UseOwn,
    WaitForPool,
    plan_job,
    plan_node,
)
from tpassrun.records import (
    IDLE,
    POOL_KEY_CONF,
    SERVING,
    Claim,
    HistoryEntry,
    JobSpec,
    PoolInfo,
    PoolKeys,
    PoolNode,
    box,
    pool_prefix,
    unbox,
)

if TYPE_CHECKING:
    from tpassrun.pool.ctl import main as pool_main
    from tpassrun.pool.job import JobPool, job_pool
    from tpassrun.pool.members import start_members

# name -> (module, its name there), imported on first use: a job's draw from the pool and `tpassctl pool` are for the
# runs that use a pool
_LAZY = {"JobPool": ("tpassrun.pool.job", "JobPool"), "job_pool": ("tpassrun.pool.job", "job_pool"),
         "start_members": ("tpassrun.pool.members", "start_members"), "pool_main": ("tpassrun.pool.ctl", "main")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value

__all__ = ["Claim", "ClaimNode", "HistoryEntry", "IDLE", "JobNeed", "JobSpec", "NodeState", "POOL_KEY_CONF", "Phase",
           "Pool", "PoolError", "PoolInfo", "PoolKeys", "PoolNode", "PoolView", "Preempt", "Restart", "SERVING",
           "Source", "UseOwn", "WaitForPool", "box", "plan_job", "plan_node", "pool_prefix", "unbox",
           # a job's draw from the pool, its members, `tpassctl pool` (imported on first use)
           "JobPool", "job_pool", "pool_main", "start_members"]
