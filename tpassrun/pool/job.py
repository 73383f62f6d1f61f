"""A job's side of a spare pool (``--spare-pool NAME --priority N``): checked at start, drawn from by the leader.

The agent builds a :class:`JobPool` at start (:func:`job_pool`: no pool key, or a pool that does not exist or was
made with another key, is one line and exit 1, before anything runs). The leader's coordinator hands it a lost
node its own spares cannot cover (the triage's ``ClaimFromPool``); :meth:`JobPool.need` asks
:func:`~tpassrun.pool.plan.plan_job` and claims by compare-and-set, bound to the leader's own lease (the agent's
rendezvous lease: a leader that dies frees its claims). The claimed pool node starts the job's ``--spare-node``
from the claim's sealed :class:`~tpassrun.records.pool.JobSpec`; once its spares are up the node plan takes them
as it takes spares still starting. When the pool has nothing within ``--pool-wait``, the lost node is given up
to torchrun's restart (:attr:`JobPool.gave_up`; the triage then decides the restart as without a pool). A pool
node that runs a lower-priority job as a member is asked to give it up (a sealed pre-emption request under the
leader's lease, :class:`~tpassrun.records.pool.PreemptRequest`); once it is idle the claim takes it as any idle node.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping

from tpassrun.pool.ctl import pool_key_from
from tpassrun.pool.etcd import Pool, PoolError
from tpassrun.pool.plan import ClaimNode, JobNeed, PoolView, Preempt, Restart, UseOwn, WaitForPool, plan_job
from tpassrun.records import POOL_KEY_CONF, Claim, JobSpec, PoolKeys, PoolNode, PreemptRequest, box, pool_prefix, provenance
from tpassrun.rendezvous import DEFAULT_PREFIX, ETCD_PASSWORD_ENV, EtcdStore, RendezvousError, read_private_file
from tpassrun.settings import LaunchConfig
from tpassrun.settings import envnames as E

# secrets and what only makes sense on the host it was set on (a pool node brings its own)
_NOT_SHIPPED = {E.TPASSRUN_RUN_KEY, E.TPASSRUN_POOL_KEY, ETCD_PASSWORD_ENV, "CUDA_VISIBLE_DEVICES", "HOSTNAME", "PWD",
                "OLDPWD", "SHLVL", "_", "DISPLAY", "HOME", "USER", "LOGNAME", "TMPDIR"}
_NOT_SHIPPED_PREFIXES = ("SSH_", "XDG_", "TMUX", "TERM", "PYTEST_", "TORCHELASTIC_", "PET_")
_SECRET_CONF = ("password", "password_file", "credentials_file", "run_key", "run_key_file", POOL_KEY_CONF)


def shipped_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker environment a pool node gets: the job's, minus secrets and host-specific variables (pure)."""
    return {k: v for k, v in environ.items() if k not in _NOT_SHIPPED and not k.startswith(_NOT_SHIPPED_PREFIXES)}


def job_spec(cfg: LaunchConfig, endpoint: str, environ: Mapping[str, str], run_key_text: str | None,
             key: provenance.RunKey, cwd: str) -> JobSpec:
    conf = ",".join(f"{k}={v}" for k, v in (cfg.rdzv_conf or {}).items() if k not in _SECRET_CONF)
    nnodes = str(cfg.min_nodes) if cfg.min_nodes == cfg.max_nodes else f"{cfg.min_nodes}:{cfg.max_nodes}"
    script = cfg.training_script
    if not cfg.module and not cfg.no_python and not os.path.isabs(script):
        script = os.path.join(cwd, script)
    return JobSpec(run_id=cfg.rdzv_id, endpoint=endpoint, rdzv_conf=conf, nproc_per_node=cfg.nproc_per_node,
                   entrypoint=script, args=tuple(cfg.training_script_args), env=shipped_env(environ), cwd=cwd,
                   run_key_box=box(key, run_key_text) if run_key_text else "", nnodes=nnodes,
                   max_restarts=cfg.max_restarts)


def lost_what(need: str) -> str:
    """A lost node's id, or a dead rank's need (``triage.dead_rank_need``), as a claim's reason says it (pure)."""
    return need if need.startswith("rank ") else f"node {need} lost"


def silent_pool_node(record: PoolNode | None, job_lost: Collection[str], known_agent: str = "") -> str:
    """Why a claimed pool node will not serve (pure): it left the pool (its lease expired: dead, or stopped), or the
    job lost its spare node (``known_agent``: the one it had before it came back), before or after its ranks came;
    "" while it may still serve."""
    if record is None:
        return "left the pool (its lease expired: it died or stopped answering)"
    for agent in (record.agent, known_agent):
        if agent and agent in job_lost:
            return f"stopped answering the job (its spare node {agent} was lost)"
    return ""


#: a job waiting for its pool says how long and why this often (the console's and the live view's line)
WAITING_SAY_EVERY_S = 5.0


@dataclass
class JobPool:
    pool: Pool
    cfg: LaunchConfig
    spec: JobSpec
    node_id: str
    clock: Callable[[], float] = time.time
    since: dict[str, float] = field(default_factory=dict)       # lost node -> when the pool was first asked
    held: dict[str, str] = field(default_factory=dict)          # lost node -> the pool node claimed for it
    gave_up: set[str] = field(default_factory=set)              # lost nodes left to torchrun's restart
    said: set[tuple[str, str]] = field(default_factory=set)
    used: dict[str, tuple[int, ...]] = field(default_factory=dict)    # a pool node (the job's id for it) -> the ranks
                                                                      # it ran (plan.giveback)
    agent_of: dict[str, str] = field(default_factory=dict)      # a pool node claimed -> its spare node's id in the job
    given_back: dict[str, str] = field(default_factory=dict)    # the spare node's id of a pool node given back -> the
                                                                # pool node (its leaving is expected: not a loss)
    said_at: dict[str, float] = field(default_factory=dict)     # lost node -> when a waiting line was last said
    claimed_at: dict[str, float] = field(default_factory=dict)  # lost node -> when its pool node was claimed

    @property
    def name(self) -> str:
        return self.pool.name

    async def need(self, lost: tuple[str, ...], own_starting: int, say: Callable[..., object],
                   job_lost: Collection[str] = ()) -> None:
        """Lost nodes (or dead ranks, named by ``triage.dead_rank_need``) no own spare covers: claim a pool node for
        each, or wait for one, or give them up. ``job_lost``: the nodes the job lost (a claimed pool node's spare node
        among them stopped answering: another pool node is asked for)."""
        now = self.clock()
        for node in lost:
            if node in self.gave_up:
                continue
            since = self.since.setdefault(node, now)
            view, revs, _ = await self.pool.read()
            dropped = await self._drop_silent(view, job_lost)
            if dropped:
                view, revs, _ = await self.pool.read()
                for pool_node, why in dropped.items():
                    if (node, pool_node) not in self.said:
                        self.said.add((node, pool_node))
                        say("pool_waiting", lost_node=node, pool=self.name,
                            reason=f"pool node {pool_node} {why}: asking the pool for another")
            if node in self.held:
                mine = view.claims.get(self.held[node])
                if mine is not None and mine.job == self.cfg.rdzv_id:
                    if now - since < self.cfg.pool_wait:
                        # its spare node is starting: the node plan takes it when it is up; said every few seconds
                        if self._due(node, now):
                            say("pool_waiting", lost_node=node, pool=self.name, waited=round(now - since, 1),
                                wait_limit=self.cfg.pool_wait,
                                reason=f"pool node {self.held[node]} claimed "
                                       f"{now - self.claimed_at.get(node, since):.0f} s ago; its spares are "
                                       "starting (a joiner from cold: the script's imports and tpassrun.init())")
                        continue
                    await self.pool.release(self.held.pop(node), self.cfg.rdzv_id, "its spares never came up")
                    self.gave_up.add(node)
                    say("pool_gave_up", lost_node=node, pool=self.name,
                        reason=f"the pool node's spares did not come up within {self.cfg.pool_wait:g} s")
                    continue
                else:   # the claim is gone (the pool node refused it, or died): ask the pool again
                    say("pool_waiting", lost_node=node, pool=self.name,
                        reason=f"pool node {self.held.pop(node)} dropped the claim")
            covering = self._room_for(node, lost, view)
            if covering is not None:        # a pool node claimed for another loss has a slot left for this one
                self.held[node] = covering
                say("pool_waiting", lost_node=node, pool=self.name,
                    reason=f"pool node {covering}, claimed for another loss, has a slot for it too")
                continue
            need = JobNeed(job=self.cfg.rdzv_id, priority=self.cfg.priority, nproc=self.cfg.nproc_per_node,
                           own_starting=own_starting, since=since, wait_limit=self.cfg.pool_wait)
            action = plan_job(need, view, now)
            if isinstance(action, ClaimNode):
                claim = Claim(node_id=action.node_id, job=self.cfg.rdzv_id, claimer=self.node_id,
                              priority=self.cfg.priority, since=now, reason=lost_what(node), spec=self.spec,
                              waited=now - since)
                if await self.pool.claim(claim, revs[action.node_id]):
                    self.held[node] = action.node_id
                    self.claimed_at[node] = now
                    self.said_at[node] = now
                    self.agent_of.pop(action.node_id, None)
                    if action.node_id in view.preempts:     # the node we pre-empted (it drops the request itself)
                        await self.pool.drop_preempt(action.node_id)
                    say("pool_claimed", lost_node=node, pool=self.name, pool_node=action.node_id,
                        reason=action.reason, waited=round(now - since, 3))
                # a lost race: the next tick reads the pool again
            elif isinstance(action, Preempt):
                await self._preempt(node, action, view, now, say)
            elif isinstance(action, (WaitForPool, UseOwn)):
                first = (node, type(action).__name__) not in self.said
                if first or self._due(node, now):      # how long and why, again every few seconds
                    self.said.add((node, type(action).__name__))
                    self.said_at[node] = now
                    say("pool_waiting", lost_node=node, pool=self.name, reason=action.reason,
                        waited=round(now - since, 1), wait_limit=self.cfg.pool_wait)
            elif isinstance(action, Restart):
                self.gave_up.add(node)
                say("pool_gave_up", lost_node=node, pool=self.name, reason=action.reason)

    def _due(self, node: str, now: float) -> bool:
        """A waiting line for ``node`` is due (the last one was WAITING_SAY_EVERY_S ago); notes it said."""
        if now - self.said_at.get(node, float("-inf")) < WAITING_SAY_EVERY_S:
            return False
        self.said_at[node] = now
        return True

    async def _drop_silent(self, view: PoolView, job_lost: Collection[str]) -> dict[str, str]:
        """Release this job's claims on pool nodes that will not serve it any more (:func:`silent_pool_node`: one
        that died, whether its ranks had come or not, or came back to serve an old claim), and forget what they were
        held for: the pool node, once back and idle, is claimed afresh like any other. -> pool node: why."""
        out: dict[str, str] = {}
        for pool_node, claim in sorted(view.claims.items()):
            if claim.job != self.cfg.rdzv_id or claim.released:     # given back: its spare node leaves as planned
                continue
            record = view.nodes.get(pool_node)
            why = silent_pool_node(record, job_lost, self.agent_of.get(pool_node, ""))
            if not why:
                if record is not None and record.job == self.cfg.rdzv_id and record.agent:
                    self.agent_of[pool_node] = record.agent
                continue
            if await self.pool.release(pool_node, self.cfg.rdzv_id, why):
                out[pool_node] = why
                self.agent_of.pop(pool_node, None)
                for need in [n for n, p in self.held.items() if p == pool_node]:
                    del self.held[need]
        return out

    async def _preempt(self, lost: str, action: Preempt, view: PoolView, now: float,
                       say: Callable[..., object]) -> None:
        """Ask ``action.node_id`` to give up its lower-priority member (once: the request stands under our lease
        until the node acted on it); the claim follows when it is idle."""
        asked = view.preempts.get(action.node_id)
        if asked is not None and asked.job == self.cfg.rdzv_id:
            return
        await self.pool.request_preempt(PreemptRequest(node_id=action.node_id, job=self.cfg.rdzv_id,
                                                       requester=self.node_id, priority=self.cfg.priority, since=now,
                                                       reason=lost_what(lost)))
        say("pool_preempting", lost_node=lost, pool=self.name, pool_node=action.node_id, victim=action.victim,
            victim_priority=action.victim_priority, priority=self.cfg.priority, reason=action.reason)

    def _room_for(self, need: str, batch: Collection[str], view: PoolView) -> str | None:
        """A pool node claimed for another loss of the same ``batch`` (losses seen at once) with slots left for
        ``need``: a dead rank takes one slot, a lost node all of them."""
        def slots(n: str) -> int:
            return 1 if n.startswith("rank ") else self.cfg.nproc_per_node
        for pool_node in sorted({p for n, p in self.held.items() if n in batch}):
            claim = view.claims.get(pool_node)
            if claim is None or claim.job != self.cfg.rdzv_id or claim.released:
                continue
            taken = sum(slots(n) for n, p in self.held.items() if p == pool_node)
            if taken + slots(need) <= self.cfg.nproc_per_node:
                return pool_node
        return None

    @property
    def waiting(self) -> bool:
        """Lost nodes the pool still works on (claimed nodes starting count: the claim is watched until planned)."""
        return any(n not in self.gave_up for n in self.since)

    @property
    def pool_nodes(self) -> tuple[str, ...]:
        """The pool nodes this job holds."""
        return tuple(sorted(set(self.held.values())))

    async def agents(self) -> dict[str, str]:
        """The node id in this job of each pool node it holds whose spare node joined -> the pool node's id."""
        if not self.held:
            return {}
        view, _, _ = await self.pool.read()
        nodes = [view.nodes.get(p) for p in self.pool_nodes]
        out = {n.agent: n.node_id for n in nodes if n is not None and n.agent and n.job == self.cfg.rdzv_id}
        self.agent_of.update({p: a for a, p in out.items()})
        return out

    async def give_back(self, pool_node: str, why: str, say: Callable[..., object]) -> bool:
        """Give ``pool_node`` back to the pool (its ranks went home, ``tpassrun.plan.giveback``): its claim is marked
        released, the pool node stops this job's spare node there and is idle again. False: the claim is not ours
        any more (nothing to give back; the node returns when its spare node exits)."""
        view, _, _ = await self.pool.read()
        claim = view.claims.get(pool_node)
        agent = self.agent_of.get(pool_node)
        if agent:                               # before the release: the pool node stops its spare node on it
            self.given_back[agent] = pool_node
        done = claim is not None and claim.job == self.cfg.rdzv_id and await self.pool.give_back(claim, why)
        if not done and agent:
            del self.given_back[agent]
        for need in [n for n, p in self.held.items() if p == pool_node]:
            del self.held[need]
            self.since.pop(need, None)
        if done:
            say("pool_released", pool=self.name, pool_node=pool_node, reason=why)
        return done

    async def release_all(self, why: str) -> None:
        for node, pool_node in list(self.held.items()):
            await self.pool.release(pool_node, self.cfg.rdzv_id, why)
            del self.held[node]


async def job_pool(cfg: LaunchConfig, store: EtcdStore, endpoint: str, environ: Mapping[str, str],
                   node_id: str, cwd: str | None = None) -> JobPool:
    """The job's pool, checked (one-line :class:`RendezvousError` when it cannot be used)."""
    assert cfg.spare_pool is not None
    conf = dict(cfg.rdzv_conf or {})
    try:
        key = pool_key_from(conf, dict(environ))
    except (provenance.RunKeyError, RendezvousError) as exc:
        raise RendezvousError(f"--spare-pool {cfg.spare_pool}: {exc}") from None
    if key is None:
        raise RendezvousError(f"--spare-pool {cfg.spare_pool}: no pool key (give --rdzv-conf {POOL_KEY_CONF}=PATH, a "
                              f"file only you can read, or ${E.TPASSRUN_POOL_KEY})")
    try:
        keys = PoolKeys(pool_prefix(conf.get("etcd_prefix") or DEFAULT_PREFIX, cfg.spare_pool))
    except ValueError as exc:
        raise RendezvousError(f"--spare-pool: {exc}") from None
    pool = Pool(store, keys, key, cfg.spare_pool)
    try:
        await pool.check()
    except PoolError as exc:
        raise RendezvousError(str(exc)) from None
    run_key_text = _run_key_text(conf, environ)
    spec = job_spec(cfg, endpoint, environ, run_key_text, key, cwd or os.getcwd())
    return JobPool(pool=pool, cfg=cfg, spec=spec, node_id=node_id)


def _run_key_text(conf: Mapping[str, str], environ: Mapping[str, str]) -> str | None:
    path = conf.get(provenance.RUN_KEY_FILE_CONF)
    if path:
        return read_private_file(path, "run key file").strip()
    return environ.get(E.TPASSRUN_RUN_KEY) or None

