"""Floating spares: one named spare pool in etcd for many jobs (issue 24). The one door of ``tpassrun.pool``.

``records`` (sealed pool records and the key layout), ``plan`` (pure decisions: a job's own spares, the pool, a
restart; a pool node's idle loop), ``etcd`` (the claim by compare-and-set bound to the claimer's lease),
``node`` (the pool node's loop, ``tpassctl pool join``), ``ctl`` (``tpassctl pool ...``). See docs/pool.md.
"""

from __future__ import annotations

from tpassrun.pool.etcd import Pool, PoolError
from tpassrun.pool.plan import (ClaimNode, JobNeed, NodeState, Phase, PoolView, Preempt, Restart, Source, UseOwn, WaitForPool,
                   plan_job, plan_node)
from tpassrun.records.pool import (IDLE, POOL_KEY_CONF, SERVING, Claim, HistoryEntry, JobSpec, PoolInfo, PoolKeys, PoolNode, box,
                      pool_prefix, unbox)

__all__ = ["Claim", "ClaimNode", "HistoryEntry", "IDLE", "JobNeed", "JobSpec", "NodeState", "POOL_KEY_CONF", "Phase",
           "Pool", "PoolError", "PoolInfo", "PoolKeys", "PoolNode", "PoolView", "Preempt", "Restart", "SERVING",
           "Source", "UseOwn", "WaitForPool", "box", "plan_job", "plan_node", "pool_prefix", "unbox"]
