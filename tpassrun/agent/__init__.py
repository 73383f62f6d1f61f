"""The per-node agent: rendezvous, workers, restarts, and (through :mod:`tpassrun.swapper`) live swaps.

One asyncio event loop (uvloop when available) per node. Everything that happens to the node becomes an
event on one queue (a worker exited, a worker said something, the rendezvous changed, a signal arrived) and
:meth:`tpassrun.agent.supervise.Supervision.supervise` handles them one at a time, so the agent's decisions never
race each other.

Exit codes are torchrun's: 0 on success, 1 when workers failed beyond ``--max-restarts`` or the rendezvous
failed, 1 for a handled signal after workers started, ``128 + sig`` for one before.

This module is the agent's lifecycle and its generation loop (join, bootstrap the workers' store, run one
generation, restart or finish). The rest of :class:`Agent` is in parts sharing one
:class:`~tpassrun.agent.state.AgentState`: :mod:`tpassrun.agent.supervise` (the events of a generation, fencing),
:mod:`tpassrun.agent.workers` (spawning and stopping workers), :mod:`tpassrun.agent.tasks` (status, the ``--tui``
panel, the hang watchdog), :mod:`tpassrun.agent.cause` (whose fault a worker's exception is),
:mod:`tpassrun.agent.store` (the workers' store).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

from tpassrun.agent.cause import CauseJudge
from tpassrun.agent.state import AgentState, Started
from tpassrun.agent.store import WorkersStore
from tpassrun.agent.supervise import Outcome, Supervision, etcd_link_said
from tpassrun.agent.tasks import GenerationTasks
from tpassrun.agent.transparent import Transparent
from tpassrun.agent.workers import WorkerSpawning, find_devices, watch_exit
from tpassrun.channel import LocalSlots, Slot, SlotState
from tpassrun.launch import (
    ElasticEvents,
    RunLogs,
    check_encrypt_conf,
    copy_root_cause_error_file,
    elastic_entry_point,
    encrypt_requested,
    entrypoint_name,
    format_failure_report,
)
from tpassrun.ops import WAITING_EVERY_S, ConsoleReporter, EventLog, GlogFormatter, clean, register_run
from tpassrun.records import (
    RUN_KEY_ENV,
    RUN_KEY_FILE_CONF,
    AddressLoopback,
    AgentExit,
    AgentStarted,
    EtcdHosted,
    GenerationEnded,
    GenerationJoined,
    Keys,
    LeaseRegranted,
    MetricsServing,
    PlansUnauthenticated,
    PoolGivenBack,
    Restart,
    RunKey,
    RunKeyError,
    WaitingForNodes,
    emit,
    env_without_key,
    rendezvous_guard,
    run_key_from,
)
from tpassrun.records import register as register_run_key
from tpassrun.rendezvous import (
    EmbeddedEtcd,
    EtcdConfig,
    EtcdRendezvous,
    Generation,
    NodeInfo,
    RendezvousError,
    RendezvousSettings,
    ServerTls,
    find_etcd_binary,
    host_etcd_if_absent,
    read_private_file,
    refuse_inline_secrets,
)
from tpassrun.settings import LaunchConfig
from tpassrun.settings import envnames as E
from tpassrun.swapper import AgentEvent, AgentPort, MirrorPlane, SignalReceived, Swapper, SwapSettings
from tpassrun.transfer import aead_unavailable_reason

if TYPE_CHECKING:
    from tpassrun.scheduler import SchedulerWatch

log = logging.getLogger("tpassrun.agent")
# torchrun's exit barrier (LocalElasticAgent's exit_barrier_timeout): how long the agent that hosts the run's
# etcd waits for the others to leave after success. Not the rendezvous's close_timeout (30 s): the rendezvous
# timeouts are parsed once, in RendezvousSettings.from_conf.
EXIT_BARRIER_TIMEOUT_S = 300.0


class Agent:
    """Construct with a resolved :class:`LaunchConfig`; ``await run()`` does everything and returns the exit code.

    Composed of parts that share one :class:`~tpassrun.agent.state.AgentState` (each holds it and the parts it
    calls), wired once here (their constructors do no I/O): the workers' store (store.py), the generation's
    background tasks (tasks.py), the workers (workers.py), the cause of a worker's exception (cause.py), supervision
    and fencing (supervise.py). This class is the lifecycle and the generation loop."""

    def __init__(self, cfg: LaunchConfig, *, environ: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        env = dict(os.environ if environ is None else environ)   # (tpassrun.cli: as tpassrun was given it)
        # a scheduler's node name when there is one (the scheduler watcher maps node ids back to it)
        node_id = f"{cfg.node_name or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self._state = AgentState(
            cfg=cfg, environ=env, node_id=node_id,
            addr=cfg.local_addr or ("127.0.0.1" if cfg.uses_embedded_etcd else socket.getfqdn()),
            logs=RunLogs.from_config(cfg), events=EventLog(None, node_id=node_id),
            remaining_restarts=cfg.max_restarts, free_fallbacks=cfg.spares_per_node)
        self._elastic = ElasticEvents(cfg.event_log_handler, cfg.rdzv_id, cfg.role, cfg.rdzv_backend,
                                      elastic_entry_point(cfg), cfg.max_restarts)
        self._started_at = time.monotonic()
        self._console = ConsoleReporter()         # one launcher line per event, and the exit summary
        self._scheduler: SchedulerWatch | None = None   # in a Slurm step: run in every generation
        self._hosting_etcd = False        # c10d/static: this agent serves the run's etcd
        # what the agent has once started, and its parts, made then (_start_parts: what they read is never None);
        # the swapper's port calls the parts only while a generation runs
        self._node: Started | None = None
        self._store: WorkersStore
        self._tasks: GenerationTasks
        self._transparent: Transparent
        self._workers: WorkerSpawning
        self._cause: CauseJudge
        self._supervision: Supervision
        self._join_task: asyncio.Task[Generation] | None = None
        self._closing: asyncio.Future[None] | None = None    # the run's close after a failure (a signal cancels it)
        self._main_task: asyncio.Task[Any] | None = None
        self._starting = True      # until the rendezvous connection is up; a signal then cancels the start

    # ------------------------------------------------------------------ lifecycle
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        handled = [s.strip() for s in self.cfg.signals_to_handle.split(",") if s.strip()]
        for name in handled:
            with contextlib.suppress(ValueError, AttributeError, RuntimeError):
                loop.add_signal_handler(getattr(signal, name), self._on_signal, getattr(signal, name))
        self._main_task = asyncio.current_task()
        try:
            return await self._run()
        except asyncio.CancelledError:
            # a signal while connecting to etcd or starting it (see _on_signal): torchrun's code for it
            if self._state.signal_received is not None and self._starting:
                return 128 + self._state.signal_received
            raise
        except RendezvousError as exc:
            print(clean(f"tpassrun: error: {exc}"), file=sys.stderr, flush=True)
            return 1
        finally:
            for name in handled:
                with contextlib.suppress(ValueError, AttributeError, RuntimeError):
                    loop.remove_signal_handler(getattr(signal, name))

    def _on_signal(self, sig: int) -> None:
        st = self._state
        if sig == signal.SIGTERM and st.signal_received is None:
            st.given_back = given_back_reason(st.environ.get(E.TPASSRUN_POOL_GIVEN_BACK, ""), holds_rank=bool(
                self._node is not None and any(s.state == SlotState.RUNNING and s.rank is not None
                                               for s in self._node.slots.slots)))
        self._state.signal_received = sig
        self._state.queue.put_nowait(SignalReceived(sig))
        if self._starting and self._main_task is not None and not self._main_task.done():
            # still starting (an etcd that does not answer is retried for --rdzv-conf read_timeout): nothing
            # to drain yet, so stop now instead of after the retries
            self._main_task.cancel()
        if self._join_task is not None and not self._join_task.done():
            self._join_task.cancel()
        if self._closing is not None and not self._closing.done():
            self._closing.cancel()
        for task in list(self._state.cut_by_signal):
            task.cancel()

    async def _run(self) -> int:
        st = self._state
        cfg = self.cfg
        st.devices = await asyncio.to_thread(find_devices, st)
        async with contextlib.AsyncExitStack() as stack:
            endpoint = cfg.etcd_endpoint
            rdzv_conf = dict(cfg.rdzv_conf or {})
            refuse_inline_secrets(rdzv_conf)
            pool_environ = dict(st.environ)     # --spare-pool: its key and the run key's text (read below)
            bad_encrypt = check_encrypt_conf(rdzv_conf, aead_unavailable_reason() if encrypt_requested(rdzv_conf)
                                             else None)
            if bad_encrypt is not None:
                raise RendezvousError(bad_encrypt)
            run_key = self._run_key(rdzv_conf, embedded=endpoint is None)
            if endpoint is None:
                log.debug("waiting for the embedded etcd to start")
                # only this job may read or write it: a fresh root password, in a 0600 file
                etcd = await stack.enter_async_context(EmbeddedEtcd(find_etcd_binary(cfg.etcd_bin), auth=True))
                endpoint = etcd.endpoint
                st.credentials_file = etcd.credentials_file
                assert st.credentials_file is not None          # auth=True: its root password is in a file
                rdzv_conf["credentials_file"] = st.credentials_file
                if run_key is None:
                    run_key, st.run_key_file = await asyncio.to_thread(_private_run_key, etcd.data_dir)
            elif cfg.host_etcd:
                # torchrun's c10d/static: the agent on the endpoint's machine hosts the rendezvous there, with
                # authentication when the nodes were given a user and password (password_file / environment)
                given = EtcdConfig.from_endpoint(endpoint, rdzv_conf)
                creds = (given.user, given.password) if given.user and given.password else None
                tls = ServerTls.for_hosting(rdzv_conf, cacert=given.cacert, cert=given.cert, key=given.key,
                                            tls=given.tls)
                hosted = await host_etcd_if_absent(endpoint, find_etcd_binary(cfg.etcd_bin), stack,
                                                   credentials=creds, tls=tls)
                self._hosting_etcd = hosted is not None
            run_dir = st.logs.run_dir
            event_path = cfg.event_log or (os.path.join(run_dir, "events.jsonl") if run_dir else None)
            st.events = EventLog(event_path, node_id=st.node_id).open()
            st.events.add_listener(self._console)
            stack.callback(st.events.close)
            if self._hosting_etcd:
                emit(st.events, EtcdHosted(endpoint=endpoint))
            etcd_cfg = EtcdConfig.from_endpoint(endpoint, rdzv_conf)
            if run_key is None and etcd_cfg.user is None and etcd_cfg.cert is None:
                emit(st.events, PlansUnauthenticated(
                    reason=f"swap plans are not authenticated: anyone who can write to the etcd at {etcd_cfg.display} "
                    f"(no user/password, no client certificate) can steer swaps and the rendezvous; give every agent "
                    f"the same run key (${RUN_KEY_ENV} or --rdzv-conf {RUN_KEY_FILE_CONF}=PATH, a 0600 file)"))
            settings = RendezvousSettings.from_conf(cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes, cfg.rdzv_conf)
            node = NodeInfo(node_id=st.node_id, addr=st.addr, nproc=cfg.nproc_per_node,
                            spares=cfg.spares_per_node, spare_node=cfg.spare_node, role=cfg.role)
            log.debug("connecting to etcd at %s", endpoint)
            if run_key is not None:   # before anything reads or writes a record: plans and reports are sealed
                stack.callback(register_run_key(settings.run_prefix, run_key))
            # the rendezvous's own records (generation, bootstrap, registrations, leader, closed) are sealed too
            rdzv = await stack.enter_async_context(EtcdRendezvous(etcd_cfg, settings, node,
                                                                  guard=rendezvous_guard(run_key)))
            rdzv.store.connection.listeners.append(etcd_link_said(st, rdzv))
            rdzv.store.lease_listeners.append(self._lease_regranted)
            # (a worker says something only once workers run, after the parts are made)
            slots = await LocalSlots(cfg.nproc_per_node, cfg.spares_per_node,
                                     on_message=lambda slot, msg: self._workers.on_worker_message(slot, msg),
                                     on_nudge=lambda: self._node.mirror.nudge() if self._node else None).open()
            stack.push_async_callback(slots.close)
            stack.push_async_callback(self._stop_store)
            stack.push_async_callback(self._stop_file_timer)
            swapper = Swapper(self._port(rdzv, slots))
            if cfg.spare_pool:   # checked before anything runs: no pool, no pool key -> one line, exit 1
                from tpassrun.pool import job_pool

                jobpool = await job_pool(cfg, rdzv.store, endpoint, pool_environ, st.node_id)
                if cfg.pool_members:    # lower-priority work on idle pool nodes: members, never spares from the pool
                    from tpassrun.pool import start_members

                    stack.callback(start_members(jobpool, cfg.pool_members, st.events.write,
                                                 lambda: len(st.generation.members) if st.generation else 0))
                else:
                    swapper.coordinator.pool = jobpool
            # the mirror store serves before this node registers: its port is part of the registration
            mirror = await stack.enter_async_context(MirrorPlane(self._port(rdzv, slots), cfg.rdzv_id,
                                                                 max_bytes=cfg.mirror_max_bytes,
                                                                 encrypt=encrypt_requested(cfg.rdzv_conf)))
            rdzv.node = dataclasses.replace(rdzv.node, mirror_port=mirror.mirror_port)
            from tpassrun.agent.healthd import AgentHealth

            health = AgentHealth(st.host(rdzv, slots))
            if cfg.scheduler:
                from tpassrun.scheduler import watcher_for

                self._scheduler = watcher_for(st.host(rdzv, slots))
            self._node = started = Started(rdzv=rdzv, slots=slots, swapper=swapper, mirror=mirror, health=health)
            self._start_parts(started)
            await self._transparent.start()        # --snapshot-interval: criu check decides, once (one line if not)
            stack.callback(self._transparent.close)
            metrics_at = None
            if cfg.metrics_port is not None:   # prometheus_client is optional: imported only when asked for
                from tpassrun.ops import serve_metrics

                metrics_at = serve_metrics(st.status(slots), stack)
            # run_key: a fingerprint (safe to show) that tells agents given different run keys apart
            emit(st.events, AgentStarted(endpoint=endpoint, run_id=cfg.rdzv_id, nproc=cfg.nproc_per_node,
                                         spares=cfg.spares_per_node, event_log=event_path,
                                         run_key=run_key.fingerprint if run_key is not None else None))
            if metrics_at is not None:
                emit(st.events, MetricsServing(addr=metrics_at[0], port=metrics_at[1]))
            from tpassrun.agent.netwatch import advertised_check  # several hosts: one line if they cannot reach us

            if (loopback := await asyncio.to_thread(advertised_check, st.addr, cfg.max_nodes)) is not None:
                emit(st.events, AddressLoopback(addr=st.addr, line=loopback))
            register_run(st.status(slots), stack, endpoint, event_path)   # tpassctl on this machine finds it without ids
            self._starting = False
            if st.signal_received is not None:
                return 128 + st.signal_received
            code = await self._generations(started)
            emit(st.events, AgentExit(code=code, mirror=mirror.usage()))
            return code

    def _start_parts(self, node: Started) -> None:
        """The agent's parts, once it has started (their constructors do no I/O)."""
        st = self._state
        self._store = WorkersStore(st, node)
        self._tasks = GenerationTasks(st, node, self._store)
        # --snapshot-interval: process snapshots (transparent.py); a restored worker's exit is watched as a spawned one's
        self._transparent = Transparent(st, node.slots,
                                        watch=lambda slot, proc: asyncio.ensure_future(watch_exit(st, slot, proc)))
        self._workers = WorkerSpawning(st, node, self._store, self._tasks, self._transparent)
        self._cause = CauseJudge(st, node)
        self._supervision = Supervision(st, node, self._cause, self._workers, self._store, self._transparent)

    async def _stop_store(self) -> None:
        if self._node is not None:
            await self._store.stop()

    async def _stop_file_timer(self) -> None:
        if self._node is not None:
            await self._workers.stop_file_timer()

    def _lease_regranted(self) -> None:
        emit(self._state.events, LeaseRegranted(reason="the lease expired during the outage"))

    def _run_key(self, rdzv_conf: dict[str, str], *, embedded: bool) -> RunKey | None:
        """The key that seals this run's swap plans and reports (tpassrun/records/provenance.py): the one given to every
        agent (a 0600 file named in --rdzv-conf, or the environment), else, for the embedded etcd (this agent is
        the run's only one), None here: a fresh one is made beside the embedded etcd's password (``_private_run_key``).
        Workers never see it."""
        try:
            key = run_key_from(rdzv_conf, self._state.environ, read_private_file)
        except RunKeyError as exc:
            raise RendezvousError(str(exc)) from None
        self._state.environ = env_without_key(self._state.environ)
        return key

    def _port(self, rdzv: EtcdRendezvous, slots: LocalSlots) -> AgentPort:
        """What the swapper sees of this agent (see :mod:`tpassrun.swapper.agentport`): called while a generation
        runs, when the parts exist."""
        st = self._state
        cfg = self.cfg

        def set_generation(gen: Generation) -> None:
            st.generation = gen

        async def spawn_spare(slot: Slot) -> None:
            assert st.generation is not None
            await self._workers.spawn(st.generation, slot, local_rank=slot.index, rank=-1, master=st.master, spare=True)

        def set_master(addr: tuple[str, int], host: str | None) -> None:
            st.master, st.store_host = (str(addr[0]), int(addr[1])), host

        async def publish_status() -> None:
            await self._tasks.publish_status()

        async def start_store() -> tuple[str, int]:
            return await self._store.host_new()

        async def store_ready(timeout: float) -> bool:
            return await self._store.ready(timeout)

        return AgentPort(node_id=st.node_id, addr=st.addr, events=st.events, rdzv=rdzv, slots=slots,
                         settings=SwapSettings(nproc_per_node=cfg.nproc_per_node, spares_per_node=cfg.spares_per_node,
                                               migrate_back=cfg.migrate_back,
                                               pool_wait=cfg.pool_wait if cfg.spare_pool else 0.0),
                         generation=lambda: st.generation, spawned_generation=lambda: st.spawned_generation,
                         formed_generation=lambda: st.formed_generation,
                         master=lambda: st.master, set_generation=set_generation, spawn_spare=spawn_spare,
                         publish_status=publish_status, post=self._queue_put,
                         store_host=lambda: st.store_host, set_master=set_master, start_store=start_store,
                         store_ready=store_ready, mirror=lambda: self._node.mirror if self._node else None)

    def _queue_put(self, event: AgentEvent) -> None:
        self._state.queue.put_nowait(event)   # the queue of the current generation (replaced by each one)

    async def _wait_for_other_agents(self, rdzv: EtcdRendezvous, timeout: float) -> None:
        """The hosting agent keeps its etcd up until the other agents are gone (their registrations and status
        keys live under their leases), so a node that finishes first does not pull the rendezvous from under the
        rest. The registration counts, not only the status: an agent whose workers were quick had not published
        a status yet, and the other agent, its etcd gone, waited for it for ever."""
        st = self._state
        deadline = time.monotonic() + timeout
        status = Keys(rdzv.key("")).family("status")
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                others = [k.rsplit("/", 1)[-1] for k, _d, _r in await rdzv.store.get_prefix_json(status)]
                others += [info.node_id for info in await rdzv.registrations()]
                others = [node for node in others if node != st.node_id]
                if not others:
                    return
            await asyncio.sleep(0.5)

    async def _generations(self, node: Started) -> int:
        st, rdzv = self._state, node.rdzv
        outcome_before: str | None = None
        while True:
            if st.signal_received is not None:      # between generations (a restart's request cut short)
                return 128 + st.signal_received
            log.debug("waiting in rendezvous (run %s)", self.cfg.rdzv_id)
            joining_since = time.monotonic()
            self._join_task = asyncio.ensure_future(self._supervision.join())   # a signal cancels it
            try:
                waited = 0.0
                while not (await asyncio.wait({self._join_task}, timeout=WAITING_EVERY_S))[0]:
                    waited += WAITING_EVERY_S
                    await self._say_waiting(rdzv, waited)
                gen = self._join_task.result()
            except asyncio.CancelledError:
                if st.signal_received is not None:
                    return 128 + st.signal_received
                raise
            # torchrun records these before it stores the new group rank/size: the previous round's (None at first)
            self._elastic.rendezvous_done(st.generation, st.node_id, time.monotonic() - joining_since,
                                          st.remaining_restarts)
            st.generation = gen
            emit(st.events, GenerationJoined(generation=gen.number, world_size=gen.world_size,
                                             members=[m.node_id for m in gen.members]))
            # a group of workers after a failed one (or a membership change) is a whole-group restart: its
            # first step says how much progress the restart threw away (tpassrun/ops/progress.py)
            st.progress.started(after_restart=outcome_before in (Outcome.FAILED, Outcome.MEMBERSHIP))
            outcome, reason = await self._run_generation(gen, node)
            st.progress.ended(self._tasks.rank_positions(ended=True))
            outcome_before = outcome
            emit(st.events, GenerationEnded(generation=gen.number, outcome=outcome, reason=reason,
                                            step=st.progress.high if st.progress.high >= 0 else None))
            log.debug("generation %d ended: %s (%s)", gen.number, outcome, reason)
            if outcome == Outcome.SUCCEEDED:
                with contextlib.suppress(RendezvousError):
                    await rdzv.close("succeeded")
                if self._hosting_etcd:
                    with contextlib.suppress(asyncio.TimeoutError, RendezvousError):
                        await self._wait_for_other_agents(rdzv, EXIT_BARRIER_TIMEOUT_S)
                self._elastic_end("SUCCEEDED", "SUCCEEDED", gen)
                return 0
            if outcome == Outcome.SIGNALLED or (outcome in (Outcome.FAILED, Outcome.MEMBERSHIP)
                                                and st.signal_received is not None):
                # FAILED with a signal: the workers saw it first (Slurm's scancel signals every process of the
                # step at once); MEMBERSHIP with one: a fence's request cut short by it (etcd gone). torchrun's
                # launcher would have raised on it, as here
                if st.handed_back:   # planned: the leader handed this node back to the scheduler, holding no rank
                    self._elastic_end(None, "SUCCEEDED", gen)
                    return 0
                if st.given_back:    # planned: a pool node's spare node, holding no rank, leaves the job
                    emit(st.events, PoolGivenBack(reason=st.given_back))
                    self._elastic_end(None, "SUCCEEDED", gen)
                    return 0
                self._elastic_end(None, "FAILED", gen)
                return 1
            if outcome == Outcome.CLOSED:
                self._report_failures()
                self._elastic_end(None, "FAILED", gen)
                return 1
            if outcome == Outcome.FAILED:
                if st.remaining_restarts > 0:
                    st.remaining_restarts -= 1
                    log.warning("Worker group FAILED. %d/%d attempts left; will restart worker group",
                                st.remaining_restarts, self.cfg.max_restarts)
                    emit(st.events, Restart(reason=reason, remaining=st.remaining_restarts))
                    with contextlib.suppress(RendezvousError):
                        await st.until_signal(rdzv.request_restart(st.generation or gen, reason))
                    continue
                self._report_failures()
                # torchrun's agent returns a FAILED result normally: the launcher records SUCCEEDED for itself
                self._elastic_end("FAILED", "SUCCEEDED", gen)
                await self._close_unless_signalled(rdzv, f"workers failed: {reason}")
                return 1
            # MEMBERSHIP: a new generation without consuming a restart (torchrun's num_nodes_waiting rule).

    async def _close_unless_signalled(self, rdzv: EtcdRendezvous, reason: str) -> None:
        """Close the run; a signal cuts it short (a scheduler's cancel signals the hosted etcd too: a close that
        retried a dead etcd outlived Slurm's KillWait and was SIGKILLed, leaving the etcd's data dir behind)."""
        self._closing = asyncio.ensure_future(rdzv.close(reason))
        if self._state.signal_received is not None:
            self._closing.cancel()
        await asyncio.wait({self._closing})
        if not self._closing.cancelled() and isinstance(self._closing.exception(), Exception) and \
                not isinstance(self._closing.exception(), RendezvousError):
            raise self._closing.exception()  # type: ignore[misc]

    async def _say_waiting(self, rdzv: EtcdRendezvous, waited: float) -> None:
        """Every 10 s without a generation: who has joined, how many are needed (never a silent wait)."""
        st = self._state
        try:   # the registrations the rendezvous accepts: one without the run's seal is nobody's
            nodes = sorted(info.node_id for info in await rdzv.registrations())
        except Exception as exc:  # noqa: BLE001 - etcd unreachable is itself worth saying
            emit(st.events, WaitingForNodes(seconds=waited, joined=0, needed=self.cfg.min_nodes,
                                            missing=[f"etcd unreachable: {type(exc).__name__}"]))
            return
        emit(st.events, WaitingForNodes(seconds=waited, joined=len(nodes), needed=self.cfg.min_nodes, nodes=nodes,
                                        missing=[f"{max(0, self.cfg.min_nodes - len(nodes))} more node(s)"]))

    def _elastic_end(self, workers: str | None, launcher: str, gen: Generation | None) -> None:
        """--event-log-handler: the per-worker end events of this node (``workers``: SUCCEEDED, or FAILED for
        FAILED/TERMINATED; None when torchrun's agent would have raised: a signal, a closed rendezvous) and the
        launcher's own event."""
        st = self._state
        total = int(time.monotonic() - self._started_at)
        if workers is not None and gen is not None and self._node is not None:
            self._elastic.workers(workers, gen, st.node_id, self._node.slots.slots, st.remaining_restarts,
                                  failures=st.failures if workers == "FAILED" else (), total_run_time=total)
        me = gen.member(st.node_id) if gen is not None else None
        self._elastic.agent(launcher, group_rank=me.group_rank if me else None,
                            group_world_size=len(gen.members) if gen is not None else None,
                            remaining_restarts=st.remaining_restarts, total_run_time=total,
                            raw_error="" if launcher == "FAILED" else None)

    @property
    def restart_count(self) -> int:
        return self._state.restart_count

    def _report_failures(self) -> None:
        if not self._state.failures:
            return
        print(format_failure_report(entrypoint_name(self.cfg), self._state.failures), file=sys.stderr, flush=True)
        copy_root_cause_error_file(self._state.failures, self._state.environ)

    # ------------------------------------------------------------------ one generation
    async def _run_generation(self, gen: Generation, node: Started) -> tuple[str, str]:
        st = self._state
        me = st.member(gen)
        st.failures = []
        st.queue = asyncio.Queue()
        if st.signal_received is not None:
            return Outcome.SIGNALLED, "signal"
        log.debug("generation %d: waiting for the workers' store (hosting: %s)", gen.number,
                  me is not None and me.group_rank == 0)
        master = await self._store.bootstrap(gen, me is not None and me.group_rank == 0)
        st.master = master
        st.store_host = next((m.node_id for m in gen.members if m.group_rank == 0), None)
        log.debug("generation %d: store at %s:%d; spawning workers", gen.number, *master)
        await self._workers.start_file_timer()
        await self._workers.spawn_generation(gen, master)
        self._transparent.generation_started()
        await self._store.standby()       # ready to serve the re-formed world should the store's node be lost
        self._elastic.workers("START", gen, st.node_id, node.slots.slots, st.remaining_restarts)
        log.debug("generation %d: workers spawned; supervising", gen.number)
        tasks = [asyncio.ensure_future(self._tasks.pump_rdzv_events(gen)),
                 asyncio.ensure_future(node.swapper.run(gen)),
                 asyncio.ensure_future(self._tasks.publish_status_loop()),
                 asyncio.ensure_future(node.health.run()),
                 asyncio.ensure_future(node.mirror.run())]
        if self.cfg.hang_timeout > 0:
            tasks.append(asyncio.ensure_future(self._tasks.hang_watchdog()))
        if self._transparent.active:
            tasks.append(asyncio.ensure_future(self._transparent.run()))
        tasks.append(asyncio.ensure_future(self._supervision.watch_lease(gen)))
        if self._scheduler is not None:
            tasks.append(asyncio.ensure_future(self._scheduler.run()))
        if self.cfg.tui:
            tasks.append(asyncio.ensure_future(self._tasks.status_panel()))
        try:
            outcome, reason = await self._supervision.supervise(gen)
        finally:
            if st.signal_received is not None:
                # torchrun forwards a signal to the workers at once; the tasks' teardown below must not delay it
                self._workers.forward_signal(st.signal_received)
            log.debug("generation %d: supervision over; stopping the generation's tasks", gen.number)
            for t in tasks:
                t.cancel()
            # Bounded: a task that swallows its cancel (see rendezvous.etcd_link.raise_if_cancelling) must not
            # hang the agent; it is named so the bug can be found.
            _done, stuck = await asyncio.wait(tasks, timeout=10)
            for t in stuck:
                log.warning("generation task %r did not stop within 10 s of its cancel; leaving it", t)
            await asyncio.gather(*(t for t in tasks if t.done()), return_exceptions=True)
            log.debug("generation %d: tasks stopped; stopping workers and store", gen.number)
        sig = st.signal_received if outcome == Outcome.SIGNALLED and st.signal_received is not None else signal.SIGTERM
        grace = float(self.cfg.shutdown_timeout) if outcome == Outcome.SIGNALLED else 30.0
        await self._workers.stop_file_timer()
        await self._workers.stop_all(sig, grace)
        if outcome == Outcome.FAILED and st.failures:
            self._supervision.record_stopped()
        await self._store.stop()
        return outcome, reason


def given_back_reason(marker: str, holds_rank: bool) -> str:
    """Why a SIGTERM is this spare node's give-back to its spare pool, or "" when it is torchrun's SIGTERM: only a
    node started by a pool node (``marker``: the file it writes before that SIGTERM) that holds no rank."""
    if not marker or holds_rank:
        return ""
    try:
        with open(marker) as fh:
            return fh.read().strip() or "given back"
    except OSError:
        return ""


def run_launcher(cfg: LaunchConfig, *, environ: dict[str, str] | None = None) -> int:
    """Run the agent for this node to completion and return torchrun's exit code (``environ``: what workers are
    given, the process's own environment when None)."""
    level = os.environ.get(E.LOGLEVEL, "WARNING").upper()
    handler = logging.StreamHandler()
    handler.setFormatter(GlogFormatter())      # one format for every line the launcher prints
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), handlers=[handler])
    agent = Agent(cfg, environ=environ)
    try:
        import uvloop

        return uvloop.run(agent.run())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(agent.run())
    except KeyboardInterrupt:
        return 130


def _private_run_key(private_dir: str | None) -> tuple[RunKey, str | None]:
    """A fresh run key for a run on its own embedded etcd, written 0600 beside that etcd's password (the same
    0700 directory, removed with it), so that a local ``tpassctl`` finds it through the run registry and shows
    the run's records as verified; whoever could read it could already read the etcd's password."""
    text = secrets.token_hex(32)
    if private_dir is None:
        return RunKey.from_text(text), None
    path = os.path.join(private_dir, "run_key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return RunKey.from_text(text), path
