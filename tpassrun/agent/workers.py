"""The agent's workers: the devices of the node, each worker's assignment and environment, spawning a
generation's actives and spares, watching their exits and hellos, stopping them. A part of
:class:`tpassrun.agent.Agent`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
import uuid
from typing import TYPE_CHECKING, Any

from tpassrun.agent.state import AgentState, Started
from tpassrun.agent.store import WorkersStore
from tpassrun.channel import Done, Failed, Hello, MirrorInfoRequest, Raised, ReplicasChecked, Reply, Slot, SlotState
from tpassrun.launch import (
    FileTimerServer,
    TimerRequest,
    WorkerAssignment,
    encrypt_requested,
    node_devices,
    role_ranks,
    signal_name,
    slot_env,
    spawn_worker,
    stop_workers,
    visible_devices,
    worker_argv,
    worker_env,
)
from tpassrun.records import (
    HANDLED_RESTART,
    Keys,
    ReplicasCheckedNoted,
    SlotQuarantined,
    SpareReady,
    Taint,
    TimerExpired,
    WorkersStarted,
    emit,
    load,
)
from tpassrun.rendezvous import Generation, RendezvousError
from tpassrun.settings import envnames as E
from tpassrun.swapper import FallbackRequested, SpawnFailed, WorkerExited, WorkerSaid

if TYPE_CHECKING:
    from tpassrun.agent.tasks import GenerationTasks
    from tpassrun.agent.transparent import Transparent

log = logging.getLogger("tpassrun.agent")


def find_devices(st: AgentState) -> list[str] | None:
    """The node's GPUs in slot order (None: no GPU), found before the agent starts."""
    try:
        return node_devices(st.environ, slots=st.cfg.nproc_per_node + st.cfg.spares_per_node)
    except Exception as exc:  # noqa: BLE001 - a broken NVML: fall back to CUDA_VISIBLE_DEVICES alone
        log.warning("cannot count GPUs through NVML (%s); using CUDA_VISIBLE_DEVICES only", exc)
        return visible_devices(st.environ.get(E.CUDA_VISIBLE_DEVICES), None)


class WorkerSpawning:
    """Agent's workers on this node."""

    def __init__(self, state: AgentState, node: Started, store: WorkersStore, tasks: GenerationTasks,
                 transparent: Transparent | None = None) -> None:
        self._state = state
        self._node = node
        self._transparent = transparent
        self._store = store
        self._tasks = tasks
        self.timer_file: str | None = None          # TORCHELASTIC_TIMER_FILE of the current workers
        self._file_timer: FileTimerServer | None = None
        self._forwarded: int | None = None          # the signal already sent to every worker's group (forward_signal)
        self.workers_started = False

    def assignment(self, gen: Generation, local_rank: int, rank: int, master: tuple[str, int],
                   slot: Slot, spare: bool) -> WorkerAssignment:
        st = self._state
        me = gen.member(st.node_id)
        assert (me is not None or spare)
        extra = {
            E.TPASSRUN_CHANNEL: self._node.slots.channel_path, E.TPASSRUN_SLOT: str(slot.index),
            E.TPASSRUN_AGENT_SOCK: self._node.slots.sock_path, E.TPASSRUN_GENERATION: str(gen.number),
            E.TPASSRUN_NODE_ID: st.node_id,
            E.TPASSRUN_SHARD_MIRROR_INTERVAL: "auto" if st.cfg.shard_mirror_interval is None
            else str(st.cfg.shard_mirror_interval),
        }
        if spare:
            extra[E.TPASSRUN_SPARE] = "1"
        if encrypt_requested(st.cfg.rdzv_conf):   # both ends of every transfer read it: they agree
            extra[E.TPASSRUN_ENCRYPT] = "1"
        store_key = self._store.key()
        if store_key is not None:    # the workers' store's authenticated door (tpassrun.store)
            extra[E.TPASSRUN_STORE_KEY] = store_key.hex()
        # Each slot owns its GPU: a spare sees only its own, a rank moved off a tainted slot is steered to
        # its new slot's GPU (tpassrun/launch/devices.py); on a CPU node this adds nothing.
        extra.update(slot_env(slot.index, local_rank, st.devices, spare=spare,
                              virtual_local_rank=st.cfg.virtual_local_rank))
        attempt_dir = st.logs.attempt_dir(st.restart_count)
        err = os.path.join(attempt_dir, str(slot.index if spare else local_rank), "error.json") if attempt_dir else ""
        role_rank, role_world_size = role_ranks(gen.members, rank, gen.world_size)
        return WorkerAssignment(
            local_rank=local_rank, rank=rank, group_rank=me.group_rank if me is not None else -1, role_rank=role_rank,
            role_world_size=role_world_size, local_world_size=st.cfg.nproc_per_node, world_size=gen.world_size,
            group_world_size=len(gen.members), master_addr=master[0], master_port=master[1],
            restart_count=st.restart_count, error_file=err, use_agent_store=True,
            timer_file=self.timer_file, extra=extra)

    async def start_file_timer(self) -> None:
        """torchrun's watchdog: with ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` a timer server (on the agent's
        ``TORCHELASTIC_TIMER_FILE``, else a new ``<tmp>/watchdog_timer_<uuid4>``) for each group of workers started,
        stopped with them; the workers get its path. Given a path but not enabled, torchrun passes the path on
        (the workers inherit it) and serves nothing."""
        st = self._state
        await self.stop_file_timer()
        given = st.environ.get(E.TORCHELASTIC_TIMER_FILE)
        if st.environ.get(E.TORCHELASTIC_ENABLE_FILE_TIMER) != "1":
            return
        path = given or os.path.join(tempfile.gettempdir(), f"watchdog_timer_{uuid.uuid4()}")
        self._file_timer = FileTimerServer(path, allowed=lambda pid: self._slot_of_session(pid) is not None,
                                           on_expired=self._timer_expired).start()
        self.timer_file = path

    async def stop_file_timer(self) -> None:
        server, self._file_timer, self.timer_file = self._file_timer, None, None
        if server is not None:
            await server.stop()

    def _slot_of_session(self, pid: int) -> Slot | None:
        """The slot whose worker's session ``pid`` is in (workers start their own session: sid == worker pid)."""
        try:
            sid = os.getsid(pid)
        except OSError:
            return None
        return next((s for s in self._node.slots.slots if s.proc is not None and s.proc.pid == sid), None)

    def _timer_expired(self, request: TimerRequest, sent: bool) -> None:
        slot = self._slot_of_session(request.pid)
        emit(self._state.events, TimerExpired(rank=slot.rank if slot else None, slot=slot.index if slot else None,
                                              pid=request.pid, scope=request.scope_id, signal=signal_name(request.signal),
                                              sent=sent))

    async def spawn_generation(self, gen: Generation, master: tuple[str, int]) -> None:
        st = self._state
        me = st.member(gen)
        self._node.mirror.store.drop(below_epoch=gen.formed)   # copies from before this (re)start: never this one's
        if me is None:
            await self._spawn_spare_node(gen, master)
            return
        st.logs.start_attempt(st.restart_count)
        await self._quarantine_restart_taints()
        usable = self._node.slots.usable_for_start()
        if len(usable) < st.cfg.nproc_per_node:
            usable = list(self._node.slots.slots)  # more quarantined slots than spares: reuse rather than not run
            for s in usable:
                s.state = SlotState.IDLE
        for s in self._node.slots.slots:
            if s.state != SlotState.QUARANTINED:
                s.state = SlotState.IDLE
                s.rank = None
        actives, spares = usable[: st.cfg.nproc_per_node], usable[st.cfg.nproc_per_node:]
        for local_rank, slot in enumerate(actives):
            await self.spawn(gen, slot, local_rank=local_rank, rank=me.rank_offset + local_rank, master=master)
        for slot in spares:
            await self.spawn(gen, slot, local_rank=slot.index, rank=-1, master=master, spare=True)
        self.workers_started = True
        st.spawned_generation, st.formed_generation = gen.number, gen.formed
        emit(st.events, WorkersStarted(generation=gen.number,
                                       slots=[{"slot": s.index, "rank": s.rank, "pid": s.pid, "state": s.state}
                                 for s in actives + spares]))

    async def _spawn_spare_node(self, gen: Generation, master: tuple[str, int]) -> None:
        """A node of the generation that is not a member (a --spare-node agent, or one more node than
        --nnodes allows): every slot runs a warm spare, so a lost node's ranks (or any single rank) can move
        here live, without starting a process."""
        st = self._state
        if not gen.includes(st.node_id):
            return
        st.logs.start_attempt(st.restart_count)
        await self._quarantine_restart_taints()
        for s in self._node.slots.slots:
            if s.state != SlotState.QUARANTINED:
                s.state, s.rank = SlotState.IDLE, None
        spares = self._node.slots.usable_for_start()
        for slot in spares:
            await self.spawn(gen, slot, local_rank=slot.index, rank=-1, master=master, spare=True)
        self.workers_started = True
        st.spawned_generation, st.formed_generation = gen.number, gen.formed
        emit(st.events, WorkersStarted(generation=gen.number, spare_node=True,
                                       slots=[{"slot": s.index, "rank": s.rank, "pid": s.pid, "state": s.state} for s in spares]))

    async def _quarantine_restart_taints(self) -> None:
        """Slots of this node whose taint was answered by a health-aware restart sit this generation out
        (until ``tpassctl untaint`` returns them to the spare pool)."""
        st = self._state
        try:
            taints = await self._node.rdzv.store.get_prefix_json(Keys(self._node.rdzv.key("")).family("taints"))
        except RendezvousError as exc:
            log.warning("cannot read taints before starting workers: %s", exc)
            return
        for key, doc, rev in taints:
            taint = load(Taint.from_json, key, doc, rev)
            if (taint is None or taint.handled_by != HANDLED_RESTART or taint.node_id != st.node_id
                    or taint.slot is None):
                continue
            slot = self._node.slots.slots[taint.slot] if taint.slot < len(self._node.slots.slots) else None
            if slot is not None and slot.state != SlotState.QUARANTINED:
                slot.state = SlotState.QUARANTINED
                slot.quarantine_reason = taint.reason or "tainted"
                emit(st.events, SlotQuarantined(slot=slot.index, reason=slot.quarantine_reason, taint=taint.id))

    async def spawn(self, gen: Generation, slot: Slot, *, local_rank: int, rank: int, master: tuple[str, int],
                    spare: bool = False) -> None:
        st = self._state
        self._node.slots.reset(slot)
        a = self.assignment(gen, local_rank, rank, master, slot, spare)
        env = worker_env(st.cfg, a, st.environ)
        transparent = self._transparent is not None and self._transparent.active
        if self._transparent is not None and not spare:   # CRIU cannot dump torch's libuv store (io_uring)
            env.update(self._transparent.worker_env())
        argv = worker_argv(st.cfg, local_rank, spare=spare)
        stdio = st.logs.stdio(st.restart_count, local_rank, rank=rank if rank >= 0 else None,
                              dir_name=str(slot.index) if spare else None)
        slot.rank = None if spare else rank
        slot.local_rank = local_rank
        slot.state = SlotState.SPARE if spare else SlotState.RUNNING
        slot.exit_code = None
        slot.started_at = time.monotonic()
        try:
            slot.proc = await spawn_worker(argv, env, stdio, local_rank=local_rank, role=st.cfg.role,
                                           piped=transparent)
        except OSError as exc:
            slot.proc = None
            slot.state = SlotState.DEAD
            st.queue.put_nowait(SpawnFailed(slot, exc))
            return
        proc = slot.proc
        asyncio.ensure_future(watch_exit(st, slot, proc))

    def on_worker_message(self, slot: Slot, msg: Reply) -> None:
        st = self._state
        if isinstance(msg, Hello):
            if msg.spare:
                emit(st.events, SpareReady(slot=slot.index, pid=msg.pid))
            # The planners see a spare once this node's status says it is warm, and a rank as managed (it can be
            # swapped) once the status says it said hello: say so now, not at the next periodic publication (up
            # to a second later: a node lost meanwhile found no spare to take its ranks; a taint meanwhile took
            # the rank for a script without tpassrun.init() and restarted the whole group, losing its steps).
            asyncio.ensure_future(self._tasks.publish_status())
        if isinstance(msg, MirrorInfoRequest):
            asyncio.ensure_future(self._node.mirror.answer_current(slot))
        if isinstance(msg, (Hello, Done, Failed, Raised)):
            st.queue.put_nowait(WorkerSaid(slot, msg))
        if isinstance(msg, ReplicasChecked):
            self._replicas_checked(slot, msg)

    def _replicas_checked(self, slot: Slot, msg: ReplicasChecked) -> None:
        """Rank 0's word on the replica check after a swap or recovery (tpassrun/worker/replicas.py): an event (and
        its console line); replicas that disagree with none to trust: torchrun's whole-group restart, which spends
        a restart as the failure that led here would have under torchrun."""
        st = self._state
        emit(st.events, ReplicasCheckedNoted(reported_by=slot.rank, step=msg.step, ok=msg.ok, action=msg.action, ranks=msg.ranks,
                                             groups=msg.groups, nbytes=msg.nbytes, seconds=msg.seconds, differ=msg.differ,
                                             detail=msg.detail, recheck=msg.recheck))
        if msg.action == "restart":
            st.queue.put_nowait(FallbackRequested(f"replicas disagree after a recovery at step {msg.step}: "
                                                  f"{msg.detail}"[:600], slot))

    def forward_signal(self, sig: int) -> None:
        """Send ``sig`` to every live worker's process group now (``stop_all`` then waits and escalates)."""
        for s in self._node.slots.slots:
            if s.proc is not None and s.proc.returncode is None:
                s.proc.signal_group(sig)
        self._forwarded = sig

    async def stop_all(self, sig: int, grace: float) -> None:
        every = [s.proc for s in self._node.slots.slots if s.proc is not None]
        procs = [p for p in every if p.returncode is None]
        if procs:
            await stop_workers(procs, sig, grace, signalled=self._forwarded == sig)
        self._forwarded = None
        for p in every:
            # a worker that already ended (rank done, exit 0) may have left processes it forked in its own session
            # (no pdeathsig: they were reparented to init): they go with the job, as torchrun's close() signals
            # every worker's process group, finished or not
            p.kill_leftovers()
        for s in self._node.slots.slots:
            if s.state in (SlotState.RUNNING, SlotState.SPARE, SlotState.LEAVING):
                s.state = SlotState.IDLE


async def watch_exit(state: AgentState, slot: Slot, proc: Any) -> None:
    """Queue the worker's exit for the supervisor (one per worker process: spawned, or restored from a snapshot)."""
    code = await proc.wait()
    log.debug("slot %d (pid %d) exited with %s", slot.index, proc.pid, code)
    state.queue.put_nowait(WorkerExited(slot, proc, code))
