"""A pool node's loop (``tpassctl pool join NAME``): idle in the pool until a job claims it, then that job's
``--spare-node``, then idle again.

Effects only; every decision is :func:`tpassrun.pool.plan.plan_node`. The node's record is bound to its lease
(a pool node that dies leaves the pool). A claim is acted on only with a good pool-key MAC (a job that did not
prove the pool key never runs here). The claimed job's spare node is a child ``python -m tpassrun --spare-node``
built from the claim's sealed :class:`~tpassrun.records.pool.JobSpec`, dying with this process (PDEATHSIG: a pool
node that dies takes its spare node with it, as a host would); it is "joined" once its event log says
its workers started (from then on the job holds it as its own node: a claimer's death no longer stops it), and
the node is idle again when that child exits (the job ended, or released it). A ``member`` claim starts one of the
job's member nodes instead (the same line without ``--spare-node``); a sealed pre-emption request of a strictly
higher priority stops it (SIGTERM, SIGKILL after ``PREEMPT_GRACE_S``), and once it exited the node drops the
victim's claim and the request and is idle, for the requester's claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import replace
from typing import Callable

from tpassrun.launch import inherit_only
from tpassrun.pool.etcd import Pool
from tpassrun.pool.plan import (
    PREEMPT_GRACE_S,
    BecomeIdle,
    ChildExited,
    ChildJoined,
    ChildStarted,
    ClaimGone,
    ClaimSeen,
    Evict,
    Keep,
    NodeEvent,
    NodeState,
    Phase,
    PreemptSeen,
    Refuse,
    StartSpare,
    StopSpare,
    plan_node,
)
from tpassrun.records import IDLE, MEMBER, SERVING, JobSpec, PoolNode, RecordError, unbox
from tpassrun.settings import envnames as E

STOP_GRACE_S = 10.0


# PR_SET_PDEATHSIG set in the child itself before it execs tpassrun (kept across exec): no preexec_fn, which is not
# safe in this process (gRPC's threads; a child forked with one crashed with SIGSEGV before its exec)
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0); "
                    "os.getppid() == int(sys.argv[1]) or os._exit(137); "
                    "os.execv(sys.argv[2], sys.argv[2:])")


def spare_node_argv(spec: JobSpec, event_log: str, python: str = sys.executable, parent: int | None = None,
                    member: bool = False, local_addr: str | None = None) -> list[str]:
    """The job's ``--spare-node`` launch line (pure), or with ``member`` one of its member nodes' (the same line
    without ``--spare-node``, as the job's own nodes run it); with ``parent``, it dies with that process; with
    ``local_addr`` (``tpassctl pool join --local-addr``), it advertises that address."""
    wrap = [python, "-c", _DIE_WITH_PARENT, str(parent), python] if parent is not None else [python]
    role = [] if member else ["--spare-node"]
    argv = [*wrap, "-m", "tpassrun", *role, "--nnodes", spec.nnodes, "--nproc-per-node",
            str(spec.nproc_per_node), "--rdzv-backend", "etcd", "--rdzv-endpoint", spec.endpoint,
            "--rdzv-id", spec.run_id, "--max-restarts", str(spec.max_restarts), "--event-log", event_log]
    if spec.rdzv_conf:
        argv += ["--rdzv-conf", spec.rdzv_conf]
    if local_addr:
        argv += ["--local-addr", local_addr]
    return argv + [spec.entrypoint, *spec.args]


# What names this host's own devices and links: a value the pool node has wins over the one the job shipped (a job's
# GLOO_SOCKET_IFNAME names its hosts' NIC, which this host may not have); one the pool node lacks comes from the job
HOST_LOCAL = frozenset({E.CUDA_VISIBLE_DEVICES, "NVIDIA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                        "NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_TOPO_FILE", "UCX_NET_DEVICES"})
HOST_LOCAL_SUFFIXES = ("_SOCKET_IFNAME",)       # GLOO_, NCCL_, TP_ (tensorpipe), NVSHMEM_BOOTSTRAP_UID_, ...


def host_local(name: str) -> bool:
    return name in HOST_LOCAL or name.endswith(HOST_LOCAL_SUFFIXES)


def spare_node_env(spec: JobSpec, base: dict[str, str], run_key: str | None,
                   given_back_file: str = "") -> dict[str, str]:
    """The node's own environment (paths, devices), the job's worker environment over it except the host-local
    variables the node sets itself (:func:`host_local`), the job's run key (opened from the claim's box), the file
    that tells the spare node a SIGTERM is a give-back; never the pool key."""
    env = {k: v for k, v in base.items() if k != E.TPASSRUN_POOL_KEY}
    env.update({k: v for k, v in spec.env.items() if not (host_local(k) and k in base)})
    env.pop(E.TPASSRUN_RUN_KEY, None)
    if run_key:
        env[E.TPASSRUN_RUN_KEY] = run_key
    env.pop(E.TPASSRUN_POOL_GIVEN_BACK, None)
    if given_back_file:
        env[E.TPASSRUN_POOL_GIVEN_BACK] = given_back_file
    return env


class PoolNodeLoop:
    def __init__(self, pool: Pool, node: PoolNode, *, say: Callable[[str], None] = print,
                 base_env: dict[str, str] | None = None, python: str = sys.executable,
                 preempt_grace: float = PREEMPT_GRACE_S, local_addr: str | None = None) -> None:
        self.pool, self.say, self.python, self.local_addr = pool, say, python, local_addr
        self.preempt_grace = preempt_grace
        self.record = node
        self.state = NodeState(node.node_id, node.nproc)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.child: asyncio.subprocess.Process | None = None
        self.events: asyncio.Queue[NodeEvent] = asyncio.Queue()
        self.served: list[str] = []           # the jobs served, in order (tests, status)
        self._tmp = tempfile.mkdtemp(prefix="tpassrun-pool-")
        self._given_back_file = ""      # the current child's (see spare_node_env)
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self, stop: asyncio.Event) -> None:
        await self.pool.check()
        await self._register(IDLE, None)
        self.say(f"pool node {self.record.node_id}: idle in pool {self.pool.name!r} ({self.record.nproc} slots)")
        self._tasks.append(asyncio.create_task(self._watch_claim(), name="pool-claim-watch"))
        self._tasks.append(asyncio.create_task(self._watch_preempt(), name="pool-preempt-watch"))
        stopper = asyncio.create_task(stop.wait())
        try:
            while True:
                getter = asyncio.create_task(self.events.get())
                done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                await self._apply(getter.result())
        finally:
            stopper.cancel()
            for t in self._tasks:
                t.cancel()
            await self._stop_child("the pool node stops")
            shutil.rmtree(self._tmp, ignore_errors=True)
            with contextlib.suppress(Exception):
                await self.pool.store.delete(self.pool.keys.node(self.record.node_id))

    async def _apply(self, event: NodeEvent) -> None:
        self.state, action = plan_node(self.state, event, time.time())
        if isinstance(action, StartSpare):
            await self._start(action)
        elif isinstance(action, StopSpare):
            self.say(f"pool node {self.record.node_id}: {action.reason}")
            if action.given_back and self._given_back_file:     # written before the SIGTERM it explains
                with contextlib.suppress(OSError), open(self._given_back_file, "w") as fh:
                    fh.write(action.given_back)
            await self._stop_child(action.reason)
        elif isinstance(action, Evict):
            self.say(f"pool node {self.record.node_id}: {action.reason}")
            await self.pool.note(self.record.node_id, "preempted", action.victim,
                                 f"by {action.request.job} (priority {action.victim_priority} < "
                                 f"{action.request.priority}): {action.request.reason}")
            await self._stop_child(action.reason, self.preempt_grace)
        elif isinstance(action, BecomeIdle):
            self.say(f"pool node {self.record.node_id}: {action.reason}")
            job = self.served[-1] if self.served else None
            with contextlib.suppress(Exception):
                await self.pool.drop_claim(self.record.node_id)
            if action.preempted_by:
                with contextlib.suppress(Exception):
                    await self.pool.drop_preempt(self.record.node_id)
            await self.pool.note(self.record.node_id, "idle", job, action.reason)
            await self._register(IDLE, None)
        elif isinstance(action, Refuse):
            self.say(f"pool node {self.record.node_id}: refusing a claim: {action.reason}")
        elif isinstance(action, Keep) and isinstance(event, ChildStarted) and self.state.phase is Phase.SERVING:
            await self._register(SERVING, self.state.job, event.agent)       # the job's name for it, at once
        elif isinstance(action, Keep) and isinstance(event, ChildJoined):
            await self._register(SERVING, self.state.job, event.agent or self.record.agent)
            await self.pool.note(self.record.node_id, "joined", self.state.job, action.reason)

    async def _register(self, state: str, job: str | None, agent: str | None = None) -> None:
        self.record = replace(self.record, state=state, job=job, agent=agent, since=time.time())
        await self.pool.register(self.record)

    async def _watch_claim(self) -> None:
        key = self.pool.keys.claim(self.record.node_id)
        doc, _, header = await self.pool.store.read_json(key)
        if doc is not None:
            self._on_claim(key, doc)
        async for ev in self.pool.store.watch_key(key, header + 1):
            if ev.kind == "put":
                self._on_claim(key, ev.value)
            elif ev.kind == "delete":
                self.events.put_nowait(ClaimGone("released, or its claimer's lease expired"))

    async def _watch_preempt(self) -> None:
        key = self.pool.keys.preempt(self.record.node_id)
        doc, _, header = await self.pool.store.read_json(key)
        if doc is not None:
            self.events.put_nowait(PreemptSeen(*self.pool.decode_preempt(key, doc)))
        async for ev in self.pool.store.watch_key(key, header + 1):
            if ev.kind == "put":
                self.events.put_nowait(PreemptSeen(*self.pool.decode_preempt(key, ev.value)))

    def _on_claim(self, key: str, doc: object) -> None:
        claim = self.pool.decode_claim(key, doc)
        if claim is None:
            self.say(f"pool node {self.record.node_id}: refusing a claim without the pool key's seal")
            return
        self.events.put_nowait(ClaimSeen(claim))

    async def _start(self, action: StartSpare) -> None:
        spec = action.claim.spec
        assert spec is not None
        what = "member" if action.claim.kind == MEMBER else "spare"
        self.say(f"pool node {self.record.node_id}: {action.reason}: starting its {what} node")
        try:
            run_key = unbox(self.pool.key, spec.run_key_box) if spec.run_key_box else None
        except RecordError as exc:     # an older job's box, or one this pool key did not seal: nothing is started
            self.say(f"pool node {self.record.node_id}: cannot start {spec.run_id!r}: {exc}")
            self.events.put_nowait(ChildExited(1))          # back to idle, the claim dropped, as a spare that failed
            return
        event_log = os.path.join(self._tmp, f"{spec.run_id}-{len(self.served)}.jsonl")
        self._given_back_file = os.path.join(self._tmp, f"{spec.run_id}-{len(self.served)}.given-back")
        self.served.append(spec.run_id)
        await self._register(SERVING, spec.run_id)
        inherit_only()                                  # uvloop ignores close_fds
        self.child = await asyncio.create_subprocess_exec(
            *spare_node_argv(spec, event_log, self.python, os.getpid(), member=action.claim.kind == MEMBER,
                             local_addr=self.local_addr),
            env=spare_node_env(spec, self.base_env, run_key, self._given_back_file), cwd=spec.cwd or None,
            start_new_session=True)
        self._tasks.append(asyncio.create_task(self._follow(self.child, event_log), name="pool-spare-node"))

    async def _follow(self, child: asyncio.subprocess.Process, event_log: str) -> None:
        joined, named = False, False
        while child.returncode is None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.wait(), 0.2)
            if joined:
                continue
            agent, started = _progress(event_log)
            if agent and not named:
                named = True
                self.events.put_nowait(ChildStarted(agent))
            if started:
                joined = True
                self.events.put_nowait(ChildJoined(agent))
        self.events.put_nowait(ChildExited(child.returncode or 0))

    async def _stop_child(self, why: str, grace: float = STOP_GRACE_S) -> None:
        child = self.child
        if child is None or child.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(child.wait(), grace)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            await child.wait()

    @property
    def phase(self) -> Phase:
        return self.state.phase


def _progress(event_log: str) -> tuple[str, bool]:
    """The spare node's node id in the job ("" before its first event), and whether its workers started."""
    agent = ""
    try:
        with open(event_log) as fh:
            for line in fh:
                with contextlib.suppress(ValueError, AttributeError):
                    ev = json.loads(line)
                    agent = str(ev.get("node") or agent)
                    if ev.get("event") == "workers_started":
                        return agent, True
    except OSError:
        pass
    return agent, False
