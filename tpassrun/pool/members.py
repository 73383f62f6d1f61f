"""Lower-priority work on idle pool nodes: an elastic job's members borrowed from the pool (``--pool-members N``).

The agent given ``--spare-pool NAME --pool-members N`` (an elastic ``--nnodes MIN:MAX`` job) claims up to N idle
pool nodes at start, before it joins its rendezvous, with claims of kind ``member`` bound to its own lease; each
pool node starts one of the job's member nodes (the job's launch line without ``--spare-node``) and it joins the
rendezvous within the last call, as the job's own nodes do. Such a job never draws spares from the pool: its
lost node is torchrun's elastic membership change (the survivors re-form with >= MIN nodes, the workers restart
from their checkpoint), so a node a higher-priority job took back is never claimed back.

The claimer watches the pool's pre-emption requests for the nodes it holds: a request the pool node will act on
(:func:`tpassrun.pool.plan.preempt_refusal`, the pool node's own rule) is said once, in one line
(``pool node P taken back by job H (priority b): shrinking to N nodes``); the pool node stops the member, the
rendezvous re-forms without it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from tpassrun.pool.job import JobPool
from tpassrun.pool.plan import plan_members, preempt_refusal
from tpassrun.records import MEMBER, Claim


@dataclass
class PoolMembers:
    jobpool: JobPool
    held: list[str] = field(default_factory=list)
    said: set[tuple[str, str]] = field(default_factory=set)

    @property
    def job(self) -> str:
        return self.jobpool.cfg.rdzv_id

    async def take(self, want: int, say: Callable[..., object]) -> list[str]:
        """Claim up to ``want`` idle pool nodes as members (compare-and-set each, bound to this agent's lease)."""
        pool, cfg = self.jobpool.pool, self.jobpool.cfg
        view, revs, _ = await pool.read()
        picks, why = plan_members(view, want, cfg.nproc_per_node)
        now = time.time()
        for node in picks:
            claim = Claim(node_id=node, job=self.job, claimer=self.jobpool.node_id, priority=cfg.priority, since=now,
                          reason=f"lower-priority work: a member of the elastic job {self.job}",
                          spec=self.jobpool.spec, kind=MEMBER)
            if await pool.claim(claim, revs[node]):
                self.held.append(node)
        say("pool_members_claimed", pool=pool.name, pool_nodes=list(self.held), wanted=want,
            priority=cfg.priority, reason=why if len(self.held) == len(picks) else f"{why}; some were claimed first")
        return list(self.held)

    async def watch(self, say: Callable[..., object], nodes_now: Callable[[], int]) -> None:
        """Say once per (node, requester) that a pool node of ours is taken back; ``nodes_now``: the job's nodes in
        its current generation (the shrink leaves one fewer)."""
        pool = self.jobpool.pool
        prefix = pool.keys.preempts
        items, header = await pool.store.read_prefix_json(prefix)
        for key, doc, _mod, _create in items:
            self._seen(key, doc, say, nodes_now)
        async for ev in pool.store.watch_prefix(prefix, header + 1):
            if ev.kind == "put":
                self._seen(ev.key, ev.value, say, nodes_now)

    def _seen(self, key: str, doc: object, say: Callable[..., object], nodes_now: Callable[[], int]) -> None:
        req, _problem = self.jobpool.pool.decode_preempt(key, doc)
        if req is None or req.node_id not in self.held or (req.node_id, req.job) in self.said:
            return
        if preempt_refusal(self.job, MEMBER, self.jobpool.cfg.priority, req):
            return
        self.said.add((req.node_id, req.job))
        left = max(nodes_now() - 1, self.jobpool.cfg.min_nodes)
        say("pool_taken_back", pool=self.jobpool.name, pool_node=req.node_id, by=req.job, by_priority=req.priority,
            priority=self.jobpool.cfg.priority, nodes=left,
            reason=f"pool node {req.node_id} taken back by job {req.job} (priority {req.priority}): shrinking to "
                   f"{left} nodes")


def start_members(jobpool: JobPool, want: int, say: Callable[..., object],
                  nodes_now: Callable[[], int]) -> Callable[[], None]:
    """The agent's one call (a coroutine's effects are started here): claim, then watch; returns the stopper."""
    members = PoolMembers(jobpool)

    async def run() -> None:
        try:
            await members.take(want, say)
            await members.watch(say, nodes_now)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # noqa: BLE001 - the job runs on without (more) members; said, not raised
            say("pool_members_failed", pool=jobpool.name, reason=f"{type(exc).__name__}: {exc}")

    task = asyncio.get_running_loop().create_task(run(), name="pool-members")

    def stop() -> None:
        task.cancel()
    return stop
