"""The per-node agent: rendezvous, workers, restarts, and (through :mod:`tpassrun.swapper`) live swaps.

One asyncio event loop (uvloop when available) per node. Everything that happens to the node becomes an
event on one queue (a worker exited, a worker said something, the rendezvous changed, a signal arrived) and
:meth:`Agent._supervise` handles them one at a time, so the agent's decisions never race each other.

Exit codes are torchrun's: 0 on success, 1 when workers failed beyond ``--max-restarts`` or the rendezvous
failed, 1 for a handled signal after workers started, ``128 + sig`` for one before.

This module is the agent's lifecycle and its generation loop (join, bootstrap the workers' store, run one
generation, restart or finish). The rest of :class:`Agent` is in mixins: :mod:`tpassrun.agent.supervise` (the
events of a generation, fencing), :mod:`tpassrun.agent.workers` (spawning and stopping workers),
:mod:`tpassrun.agent.tasks` (status, the ``--tui`` panel, the hang watchdog).
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
from typing import Any, Awaitable

# The agent forks workers (preexec_fn for PDEATHSIG) while gRPC threads exist; gRPC's fork handlers are
# for children that use gRPC, which ours never do, and only print noise.
_GRPC_QUIET = {"GRPC_ENABLE_FORK_SUPPORT": "false", "GRPC_VERBOSITY": "ERROR"}
_GRPC_ADDED = {k for k in _GRPC_QUIET if k not in os.environ}
for _k in _GRPC_ADDED:
    os.environ[_k] = _GRPC_QUIET[_k]

from tpassrun.settings import envnames as E  # noqa: E402
from tpassrun.agent.cause import CauseJudge  # noqa: E402
from tpassrun.agent.supervise import Outcome, Supervision  # noqa: E402
from tpassrun.agent.tasks import GenerationTasks  # noqa: E402
from tpassrun.agent.workers import WorkerSpawning  # noqa: E402
from tpassrun.settings import LaunchConfig  # noqa: E402
from tpassrun.ops.cleantext import clean  # noqa: E402
from tpassrun.ops.console import WAITING_EVERY_S, ConsoleReporter, GlogFormatter  # noqa: E402
from tpassrun.launch.elasticevents import ElasticEvents  # noqa: E402
from tpassrun.ops.events import EventLog  # noqa: E402
from tpassrun.ops.registry import register_run  # noqa: E402
from tpassrun.launch.procs import RunLogs  # noqa: E402
from tpassrun.ops.progress import Progress  # noqa: E402
from tpassrun.records import Keys, rendezvous_guard  # noqa: E402
from tpassrun.launch.report import ProcessFailure, copy_root_cause_error_file, format_failure_report  # noqa: E402
from tpassrun.rendezvous import (EmbeddedEtcd, EtcdConfig, EtcdRendezvous, Generation, NodeInfo,  # noqa: E402
                         RendezvousError, RendezvousSettings, ServerTls, find_etcd_binary, host_etcd_if_absent,
                         read_private_file, refuse_inline_secrets)
from tpassrun.swapper.agentport import AgentEvent, AgentPort, SignalReceived, SwapSettings  # noqa: E402
from tpassrun.records.provenance import (RUN_KEY_ENV, RUN_KEY_FILE_CONF, RunKey, RunKeyError, env_without_key,  # noqa: E402
                         register as register_run_key, run_key_from)
from tpassrun.swapper.mirrorplane import MirrorPlane  # noqa: E402
from tpassrun.channel.slots import LocalSlots, Slot  # noqa: E402
from tpassrun.swapper import Swapper  # noqa: E402
from tpassrun.launch.workerenv import check_encrypt_conf, elastic_entry_point, encrypt_requested, entrypoint_name  # noqa: E402
from tpassrun.transfer.auth import aead_unavailable_reason  # noqa: E402
from tpassrun.launch.rules import split_endpoint  # noqa: E402
from tpassrun.store import bind_host, derive_store_key, is_loopback  # noqa: E402

log = logging.getLogger("tpassrun.agent")
# torchrun's exit barrier (LocalElasticAgent's exit_barrier_timeout): how long the agent that hosts the run's
# etcd waits for the others to leave after success. Not the rendezvous's close_timeout (30 s): the rendezvous
# timeouts are parsed once, in RendezvousSettings.from_conf.
EXIT_BARRIER_TIMEOUT_S = 300.0


def _free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Agent(Supervision, CauseJudge, WorkerSpawning, GenerationTasks):
    """Construct with a resolved :class:`LaunchConfig`; ``await run()`` does everything and returns the exit code."""

    def __init__(self, cfg: LaunchConfig, *, environ: dict[str, str] | None = None) -> None:
        self.cfg = cfg
        self.environ = dict(os.environ if environ is None else environ)
        for k in _GRPC_ADDED:  # ours, not the user's: workers get the environment tpassrun was given
            self.environ.pop(k, None)
        # a scheduler's node name when there is one (the scheduler watcher maps node ids back to it)
        self.node_id = f"{cfg.node_name or socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.addr = cfg.local_addr or ("127.0.0.1" if cfg.uses_embedded_etcd else socket.getfqdn())
        self.remaining_restarts = cfg.max_restarts
        # A death a spare should have absorbed, whose live recovery turned out impossible, restarts the group
        # without spending --max-restarts (the user gave spares, not a restart budget), at most once per spare
        # of this node: a rank killed over and over still ends in torchrun's failure report.
        self.free_fallbacks = cfg.spares_per_node
        self.logs = RunLogs.from_config(cfg)
        self.events = EventLog(None, node_id=self.node_id)
        self.elastic = ElasticEvents(cfg.event_log_handler, cfg.rdzv_id, cfg.role, cfg.rdzv_backend,
                                     elastic_entry_point(cfg), cfg.max_restarts)
        self._started_at = time.monotonic()
        self.console = ConsoleReporter()         # one launcher line per event, and the exit summary
        self.rdzv: EtcdRendezvous | None = None
        self.slots: LocalSlots | None = None
        self.generation: Generation | None = None
        self.failures: list[ProcessFailure] = []
        self.progress = Progress()      # the steps its ranks run; what a whole-group restart redoes
        self.workers_started = False
        self.signal_received: int | None = None
        self._cut_by_signal: set[asyncio.Future[Any]] = set()   # etcd requests a signal cuts short
        self._queue: asyncio.Queue[AgentEvent] = asyncio.Queue()
        self._store_proc: asyncio.subprocess.Process | None = None
        self._store_port = 0
        self._standby: tuple[asyncio.subprocess.Process, int] | None = None   # a store ready to take over (port)
        self.swapper: Swapper | None = None
        self.mirror: MirrorPlane | None = None   # this node's mirror store and its light mirror (tpassrun/swapper/mirrorplane.py)
        self.health: Any = None                  # healthd.AgentHealth: one per agent, run in every generation
        self.scheduler: Any = None               # scheduler.SchedulerWatch in a Slurm step: run in every generation
        self.master: tuple[str, int] = ("", 0)
        self.store_host: str | None = None       # the node running the workers' store (group rank 0's, or a swap's)
        self.hosting_etcd = False        # c10d/static: this agent serves the run's etcd
        self.spawned_generation = 0      # the generation whose start spawned the current workers (swaps keep them)
        self.formed_generation = 0       # the run's last whole-group restart's (Generation.formed): port.epoch()
        self.devices: list[str] | None = None  # the node's GPUs in slot order (tpassrun/launch/devices.py); None: no GPU
        self._deaths_seen: list[tuple[int, int | None, str]] = []   # (generation, rank, why): tpassrun/agent/cause.py
        self._judging: set[asyncio.Future[None]] = set()            # workers waiting for their exception's cause

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
            if self.signal_received is not None and self._starting:
                return 128 + self.signal_received
            raise
        except RendezvousError as exc:
            print(clean(f"tpassrun: error: {exc}"), file=sys.stderr, flush=True)
            return 1
        finally:
            for name in handled:
                with contextlib.suppress(ValueError, AttributeError, RuntimeError):
                    loop.remove_signal_handler(getattr(signal, name))

    def _on_signal(self, sig: int) -> None:
        self.signal_received = sig
        self._queue.put_nowait(SignalReceived(sig))
        if self._starting and self._main_task is not None and not self._main_task.done():
            # still starting (an etcd that does not answer is retried for --rdzv-conf read_timeout): nothing
            # to drain yet, so stop now instead of after the retries
            self._main_task.cancel()
        if self._join_task is not None and not self._join_task.done():
            self._join_task.cancel()
        if self._closing is not None and not self._closing.done():
            self._closing.cancel()
        for task in list(self._cut_by_signal):
            task.cancel()

    async def until_signal(self, aw: Awaitable[Any]) -> bool:
        """Await an etcd request that may wait out an outage for as long as it lasts; a signal cuts it short
        (-> False). Every request the supervisor makes between a worker's event and the next one goes through
        here: a signal is obeyed in seconds even while etcd is gone."""
        if self.signal_received is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            return False
        task = asyncio.ensure_future(aw)
        self._cut_by_signal.add(task)
        try:
            await task
            return True
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and self.signal_received is not None and not (me and me.cancelling()):
                return False
            raise
        finally:
            self._cut_by_signal.discard(task)

    _join_task: asyncio.Task[Generation] | None = None
    _closing: asyncio.Future[None] | None = None    # the run's close after a failure (a signal cancels it)
    _main_task: asyncio.Task[Any] | None = None
    _starting = True      # until the rendezvous connection is up; a signal then cancels the start

    async def _run(self) -> int:
        cfg = self.cfg
        self.devices = await asyncio.to_thread(self._find_devices)
        async with contextlib.AsyncExitStack() as stack:
            endpoint = cfg.etcd_endpoint
            rdzv_conf = dict(cfg.rdzv_conf or {})
            refuse_inline_secrets(rdzv_conf)
            pool_environ = dict(self.environ)     # --spare-pool: its key and the run key's text (read below)
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
                self.credentials_file = etcd.credentials_file
                rdzv_conf["credentials_file"] = etcd.credentials_file
                if run_key is None:
                    run_key, self.run_key_file = await asyncio.to_thread(_private_run_key, etcd.data_dir)
            elif cfg.host_etcd:
                # torchrun's c10d/static: the agent on the endpoint's machine hosts the rendezvous there, with
                # authentication when the nodes were given a user and password (password_file / environment)
                given = EtcdConfig.from_endpoint(endpoint, rdzv_conf)
                creds = (given.user, given.password) if given.user and given.password else None
                tls = ServerTls.for_hosting(rdzv_conf, cacert=given.cacert, cert=given.cert, key=given.key,
                                            tls=given.tls)
                hosted = await host_etcd_if_absent(endpoint, find_etcd_binary(cfg.etcd_bin), stack,
                                                   credentials=creds, tls=tls)
                self.hosting_etcd = hosted is not None
            run_dir = self.logs.run_dir
            event_path = cfg.event_log or (os.path.join(run_dir, "events.jsonl") if run_dir else None)
            self.events = EventLog(event_path, node_id=self.node_id).open()
            self.events.add_listener(self.console)
            stack.callback(self.events.close)
            if self.hosting_etcd:
                self.events.write("etcd_hosted", endpoint=endpoint)
            etcd_cfg = EtcdConfig.from_endpoint(endpoint, rdzv_conf)
            if run_key is None and etcd_cfg.user is None and etcd_cfg.cert is None:
                self.events.write("plans_unauthenticated", reason=(
                    f"swap plans are not authenticated: anyone who can write to the etcd at {etcd_cfg.display} "
                    f"(no user/password, no client certificate) can steer swaps and the rendezvous; give every agent "
                    f"the same run key (${RUN_KEY_ENV} or --rdzv-conf {RUN_KEY_FILE_CONF}=PATH, a 0600 file)"))
            settings = RendezvousSettings.from_conf(cfg.rdzv_id, cfg.min_nodes, cfg.max_nodes, cfg.rdzv_conf)
            node = NodeInfo(node_id=self.node_id, addr=self.addr, nproc=cfg.nproc_per_node,
                            spares=cfg.spares_per_node, spare_node=cfg.spare_node, role=cfg.role)
            log.debug("connecting to etcd at %s", endpoint)
            if run_key is not None:   # before anything reads or writes a record: plans and reports are sealed
                stack.callback(register_run_key(settings.run_prefix, run_key))
            # the rendezvous's own records (generation, bootstrap, registrations, leader, closed) are sealed too
            self.rdzv = await stack.enter_async_context(EtcdRendezvous(etcd_cfg, settings, node,
                                                                       guard=rendezvous_guard(run_key)))
            self.rdzv.store.connection.listeners.append(self._on_etcd_link)
            self.rdzv.store.lease_listeners.append(
                lambda: self.events.write("lease_regranted", reason="the lease expired during the outage"))
            self.slots = await LocalSlots(cfg.nproc_per_node, cfg.spares_per_node, on_message=self._on_worker_message,
                                          on_nudge=lambda: self.mirror.nudge() if self.mirror else None).open()
            stack.push_async_callback(self.slots.close)
            stack.push_async_callback(self._stop_store)
            stack.push_async_callback(self._stop_file_timer)
            self.swapper = Swapper(self._port())
            if cfg.spare_pool:   # checked before anything runs: no pool, no pool key -> one line, exit 1
                from tpassrun.pool.job import job_pool

                self.swapper.coordinator.pool = await job_pool(cfg, self.rdzv.store, endpoint, pool_environ,
                                                               self.node_id)
            # the mirror store serves before this node registers: its port is part of the registration
            self.mirror = await stack.enter_async_context(MirrorPlane(self._port(), cfg.rdzv_id,
                                                                      max_bytes=cfg.mirror_max_bytes,
                                                                      encrypt=encrypt_requested(cfg.rdzv_conf)))
            self.rdzv.node = dataclasses.replace(self.rdzv.node, mirror_port=self.mirror.mirror_port)
            from tpassrun.agent.healthd import AgentHealth

            self.health = AgentHealth(self)
            if cfg.scheduler:
                from tpassrun.scheduler import watcher_for

                self.scheduler = watcher_for(self)
            metrics_at = None
            if cfg.metrics_port is not None:   # prometheus_client is optional: imported only when asked for
                from tpassrun.ops.metrics import serve_metrics

                metrics_at = serve_metrics(self, stack)
            # run_key: a fingerprint (safe to show) that tells agents given different run keys apart
            self.events.write("agent_started", endpoint=endpoint, run_id=cfg.rdzv_id, nproc=cfg.nproc_per_node,
                              spares=cfg.spares_per_node, event_log=event_path,
                              run_key=run_key.fingerprint if run_key is not None else None)
            if metrics_at is not None:
                self.events.write("metrics_serving", addr=metrics_at[0], port=metrics_at[1])
            register_run(self, stack, endpoint, event_path)   # tpassctl on this machine finds it without ids
            self._starting = False
            if self.signal_received is not None:
                return 128 + self.signal_received
            code = await self._generations()
            self.events.write("agent_exit", code=code, mirror=self.mirror.usage() if self.mirror else None)
            return code

    def _run_key(self, rdzv_conf: dict[str, str], *, embedded: bool) -> RunKey | None:
        """The key that seals this run's swap plans and reports (tpassrun/records/provenance.py): the one given to every
        agent (a 0600 file named in --rdzv-conf, or the environment), else, for the embedded etcd (this agent is
        the run's only one), None here: a fresh one is made beside the embedded etcd's password (``_private_run_key``).
        Workers never see it."""
        try:
            key = run_key_from(rdzv_conf, self.environ, read_private_file)
        except RunKeyError as exc:
            raise RendezvousError(str(exc)) from None
        self.environ = env_without_key(self.environ)
        return key

    run_key_file: str | None = None   # an embedded etcd's run key (0600, in its private dir): tpassctl verifies with it

    def _port(self) -> AgentPort:
        """What the swapper sees of this agent (see :mod:`tpassrun.swapper.agentport`)."""
        assert self.rdzv is not None and self.slots is not None
        cfg = self.cfg

        def set_generation(gen: Generation) -> None:
            self.generation = gen

        async def spawn_spare(slot: Slot) -> None:
            assert self.generation is not None
            await self.spawn(self.generation, slot, local_rank=slot.index, rank=-1, master=self.master, spare=True)

        def set_master(addr: tuple[str, int], host: str | None) -> None:
            self.master, self.store_host = (str(addr[0]), int(addr[1])), host

        return AgentPort(node_id=self.node_id, addr=self.addr, events=self.events, rdzv=self.rdzv, slots=self.slots,
                         settings=SwapSettings(nproc_per_node=cfg.nproc_per_node, spares_per_node=cfg.spares_per_node,
                                               migrate_back=cfg.migrate_back,
                                               pool_wait=cfg.pool_wait if cfg.spare_pool else 0.0),
                         generation=lambda: self.generation, spawned_generation=lambda: self.spawned_generation,
                         formed_generation=lambda: self.formed_generation,
                         master=lambda: self.master, set_generation=set_generation, spawn_spare=spawn_spare,
                         publish_status=self.publish_status, post=self._queue_put,
                         store_host=lambda: self.store_host, set_master=set_master, start_store=self._host_new_store,
                         store_ready=self._store_ready,
                         mirror=lambda: self.mirror)

    def _queue_put(self, event: AgentEvent) -> None:
        self._queue.put_nowait(event)   # the queue of the current generation (replaced by each one)

    async def _wait_for_other_agents(self, timeout: float) -> None:
        """The hosting agent keeps its etcd up until the other agents are gone (their registrations and status
        keys live under their leases), so a node that finishes first does not pull the rendezvous from under the
        rest. The registration counts, not only the status: an agent whose workers were quick had not published
        a status yet, and the other agent, its etcd gone, waited for it for ever."""
        assert self.rdzv is not None
        deadline = time.monotonic() + timeout
        status = Keys(self.rdzv.key("")).family("status")
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                others = [k.rsplit("/", 1)[-1] for k, _d, _r in await self.rdzv.store.get_prefix_json(status)]
                others += [info.node_id for info in await self.rdzv.registrations()]
                others = [node for node in others if node != self.node_id]
                if not others:
                    return
            await asyncio.sleep(0.5)

    async def _generations(self) -> int:
        assert self.rdzv is not None
        outcome_before: str | None = None
        while True:
            if self.signal_received is not None:      # between generations (a restart's request cut short)
                return 128 + self.signal_received
            log.debug("waiting in rendezvous (run %s)", self.cfg.rdzv_id)
            joining_since = time.monotonic()
            self._join_task = asyncio.ensure_future(self._join())   # a signal cancels it
            try:
                waited = 0.0
                while not (await asyncio.wait({self._join_task}, timeout=WAITING_EVERY_S))[0]:
                    waited += WAITING_EVERY_S
                    await self._say_waiting(waited)
                gen = self._join_task.result()
            except asyncio.CancelledError:
                if self.signal_received is not None:
                    return 128 + self.signal_received
                raise
            # torchrun records these before it stores the new group rank/size: the previous round's (None at first)
            self.elastic.rendezvous_done(self.generation, self.node_id, time.monotonic() - joining_since,
                                         self.remaining_restarts)
            self.generation = gen
            self.events.write("generation_joined", generation=gen.number, world_size=gen.world_size,
                              members=[m.node_id for m in gen.members])
            # a group of workers after a failed one (or a membership change) is a whole-group restart: its
            # first step says how much progress the restart threw away (tpassrun/ops/progress.py)
            self.progress.started(after_restart=outcome_before in (Outcome.FAILED, Outcome.MEMBERSHIP))
            outcome, reason = await self._run_generation(gen)
            self.progress.ended(self._rank_positions(ended=True))
            outcome_before = outcome
            self.events.write("generation_ended", generation=gen.number, outcome=outcome, reason=reason,
                              step=self.progress.high if self.progress.high >= 0 else None)
            log.debug("generation %d ended: %s (%s)", gen.number, outcome, reason)
            if outcome == Outcome.SUCCEEDED:
                with contextlib.suppress(RendezvousError):
                    await self.rdzv.close("succeeded")
                if self.hosting_etcd:
                    with contextlib.suppress(asyncio.TimeoutError, RendezvousError):
                        await self._wait_for_other_agents(EXIT_BARRIER_TIMEOUT_S)
                self._elastic_end("SUCCEEDED", "SUCCEEDED", gen)
                return 0
            if outcome == Outcome.SIGNALLED or (outcome in (Outcome.FAILED, Outcome.MEMBERSHIP)
                                                and self.signal_received is not None):
                # FAILED with a signal: the workers saw it first (Slurm's scancel signals every process of the
                # step at once); MEMBERSHIP with one: a fence's request cut short by it (etcd gone). torchrun's
                # launcher would have raised on it, as here
                self._elastic_end(None, "FAILED", gen)
                return 1
            if outcome == Outcome.CLOSED:
                self._report_failures()
                self._elastic_end(None, "FAILED", gen)
                return 1
            if outcome == Outcome.FAILED:
                if self.remaining_restarts > 0:
                    self.remaining_restarts -= 1
                    log.warning("Worker group FAILED. %d/%d attempts left; will restart worker group",
                                self.remaining_restarts, self.cfg.max_restarts)
                    self.events.write("restart", reason=reason, remaining=self.remaining_restarts)
                    with contextlib.suppress(RendezvousError):
                        await self.until_signal(self.rdzv.request_restart(self.generation or gen, reason))
                    continue
                self._report_failures()
                # torchrun's agent returns a FAILED result normally: the launcher records SUCCEEDED for itself
                self._elastic_end("FAILED", "SUCCEEDED", gen)
                await self._close_unless_signalled(f"workers failed: {reason}")
                return 1
            # MEMBERSHIP: a new generation without consuming a restart (torchrun's num_nodes_waiting rule).

    async def _close_unless_signalled(self, reason: str) -> None:
        """Close the run; a signal cuts it short (a scheduler's cancel signals the hosted etcd too: a close that
        retried a dead etcd outlived Slurm's KillWait and was SIGKILLed, leaving the etcd's data dir behind)."""
        assert self.rdzv is not None
        self._closing = asyncio.ensure_future(self.rdzv.close(reason))
        if self.signal_received is not None:
            self._closing.cancel()
        await asyncio.wait({self._closing})
        if not self._closing.cancelled() and isinstance(self._closing.exception(), Exception) and \
                not isinstance(self._closing.exception(), RendezvousError):
            raise self._closing.exception()  # type: ignore[misc]

    async def _say_waiting(self, waited: float) -> None:
        """Every 10 s without a generation: who has joined, how many are needed (never a silent wait)."""
        assert self.rdzv is not None
        try:   # the registrations the rendezvous accepts: one without the run's seal is nobody's
            nodes = sorted(info.node_id for info in await self.rdzv.registrations())
        except Exception as exc:  # noqa: BLE001 - etcd unreachable is itself worth saying
            self.events.write("waiting_for_nodes", seconds=waited, joined=0, needed=self.cfg.min_nodes,
                              missing=[f"etcd unreachable: {type(exc).__name__}"])
            return
        self.events.write("waiting_for_nodes", seconds=waited, joined=len(nodes), needed=self.cfg.min_nodes,
                          nodes=nodes, missing=[f"{max(0, self.cfg.min_nodes - len(nodes))} more node(s)"])

    def _elastic_end(self, workers: str | None, launcher: str, gen: Generation | None) -> None:
        """--event-log-handler: the per-worker end events of this node (``workers``: SUCCEEDED, or FAILED for
        FAILED/TERMINATED; None when torchrun's agent would have raised: a signal, a closed rendezvous) and the
        launcher's own event."""
        total = int(time.monotonic() - self._started_at)
        if workers is not None and gen is not None and self.slots is not None:
            self.elastic.workers(workers, gen, self.node_id, self.slots.slots, self.remaining_restarts,
                                 failures=self.failures if workers == "FAILED" else (), total_run_time=total)
        me = gen.member(self.node_id) if gen is not None else None
        self.elastic.agent(launcher, group_rank=me.group_rank if me else None,
                           group_world_size=len(gen.members) if gen is not None else None,
                           remaining_restarts=self.remaining_restarts, total_run_time=total,
                           raw_error="" if launcher == "FAILED" else None)

    @property
    def restart_count(self) -> int:
        return self.cfg.max_restarts - self.remaining_restarts

    def _report_failures(self) -> None:
        if not self.failures:
            return
        print(format_failure_report(entrypoint_name(self.cfg), self.failures), file=sys.stderr, flush=True)
        copy_root_cause_error_file(self.failures, self.environ)

    # ------------------------------------------------------------------ one generation
    async def _run_generation(self, gen: Generation) -> tuple[str, str]:
        assert self.rdzv is not None and self.slots is not None
        me = self._member(gen)
        self.failures = []
        self._queue = asyncio.Queue()
        if self.signal_received is not None:
            return Outcome.SIGNALLED, "signal"
        log.debug("generation %d: waiting for the workers' store (hosting: %s)", gen.number,
                  me is not None and me.group_rank == 0)
        master = await self._bootstrap(gen, me is not None and me.group_rank == 0)
        self.master = master
        self.store_host = next((m.node_id for m in gen.members if m.group_rank == 0), None)
        log.debug("generation %d: store at %s:%d; spawning workers", gen.number, *master)
        await self._start_file_timer()
        await self._spawn_generation(gen, master)
        self.elastic.workers("START", gen, self.node_id, self.slots.slots, self.remaining_restarts)
        log.debug("generation %d: workers spawned; supervising", gen.number)
        tasks = [asyncio.ensure_future(self._pump_rdzv_events(gen)),
                 asyncio.ensure_future(self.swapper.run(gen)),
                 asyncio.ensure_future(self._publish_status_loop()),
                 asyncio.ensure_future(self.health.run())]
        if self.mirror is not None:
            tasks.append(asyncio.ensure_future(self.mirror.run()))
        if self.cfg.hang_timeout > 0:
            tasks.append(asyncio.ensure_future(self._hang_watchdog()))
        tasks.append(asyncio.ensure_future(self._watch_lease(gen)))
        if self.scheduler is not None:
            tasks.append(asyncio.ensure_future(self.scheduler.run()))
        if self.cfg.tui:
            tasks.append(asyncio.ensure_future(self._status_panel()))
        try:
            outcome, reason = await self._supervise(gen)
        finally:
            if self.signal_received is not None:
                # torchrun forwards a signal to the workers at once; the tasks' teardown below must not delay it
                self._forward_signal(self.signal_received)
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
        sig = self.signal_received if outcome == Outcome.SIGNALLED else signal.SIGTERM
        grace = float(self.cfg.shutdown_timeout) if outcome == Outcome.SIGNALLED else 30.0
        await self._stop_file_timer()
        await self._stop_all(sig, grace)
        if outcome == Outcome.FAILED and self.failures:
            self._record_stopped()
        await self._stop_store()
        return outcome, reason

    async def _bootstrap(self, gen: Generation, host: bool) -> tuple[str, int]:
        """A fresh TCPStore per generation, hosted next to group rank 0 (never a previous attempt's keys)."""
        assert self.rdzv is not None
        if self._member(gen) is None:
            # a spare node: its spares join re-formed worlds at the swap's store; knowing this generation's
            # lets it lead a swap (the leader names the store). Not worth failing over.
            try:
                return await self.rdzv.wait_bootstrap(gen, timeout=min(60.0, self.rdzv.settings.join_timeout))
            except RendezvousError as exc:
                log.debug("spare node: no bootstrap address for generation %d: %s", gen.number, exc)
                return ("", 0)
        if host:
            # torchrun's RendezvousStoreInfo.build: the rank-0 node's --local-addr, else its FQDN ("localhost"
            # on a machine without a domain), even for one node: workers see the same MASTER_ADDR as under it
            # (a single node's store listens on loopback only: 127.0.0.1 when that name is not a loopback one)
            addr, port = self._store_addr(self.cfg.local_addr or socket.getfqdn()), 0
            if self.cfg.rdzv_backend == "static":
                # torchrun's static agent serves the workers' store on the endpoint (--rdzv-endpoint, else
                # --master-addr/--master-port) and hands workers that address, which scripts may tcp:// to; ours
                # serves each generation's new store there (a new process: never a previous attempt's keys)
                addr, static_port = split_endpoint(self.cfg.rdzv_endpoint)
                port = static_port or 0
            port = port or _free_port()
            await self._start_store(port, addr if self.cfg.rdzv_backend == "static" else None)
            await self.rdzv.publish_bootstrap(gen, addr, port)
            return addr, port
        return await self.rdzv.wait_bootstrap(gen, timeout=self.rdzv.settings.join_timeout)

    def _single_node(self) -> bool:
        return self.cfg.max_nodes == 1

    def _store_addr(self, advertised: str) -> str:
        """What workers are told to reach the store at: ``advertised``, or 127.0.0.1 for a single node whose
        name is not a loopback one (its store listens on loopback only)."""
        if self._single_node() and not is_loopback(bind_host(advertised, single_node=False)):
            return "127.0.0.1"
        return advertised

    def store_key(self) -> bytes | None:
        """The workers' store key (tpassrun.store): derived from the run's mirror key, given to this node's
        workers in their environment and to the store process on its stdin, never on a command line."""
        return derive_store_key(self.mirror.key) if self.mirror is not None and self.mirror.key else None

    async def _start_store(self, port: int, addr: str | None = None) -> None:
        self._store_proc, self._store_port = await self._spawn_store(port, addr), port

    async def _store_ready(self, timeout: float) -> bool:
        """Whether the workers' store this agent runs accepts connections (waiting up to ``timeout``): a store
        process just started imports torch first (seconds on a loaded host), and a worker that connects before
        it listens backs off for longer and longer, so a re-formed world would wait seconds past the store's start."""
        proc, port = self._store_proc, self._store_port
        deadline = time.monotonic() + timeout
        while proc is not None and proc.returncode is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                _r, w = await asyncio.wait_for(asyncio.open_connection(self._store_bind, port), 1.0)
                w.close()
                return True
            await asyncio.sleep(0.05)
        return False

    async def _spawn_store(self, port: int, addr: str | None = None) -> asyncio.subprocess.Process:
        """The store process, listening on ``addr`` (this node's advertised address by default) resolved, or
        on loopback for a single node (:func:`tpassrun.store.bind_host`); its key on stdin."""
        from tpassrun.launch.procs import die_with_parent  # the same pdeathsig hook the workers get

        advertised = addr or self.cfg.local_addr or socket.getfqdn()
        self._store_bind = host = bind_host(advertised, single_node=self._single_node()
                                            and self.cfg.rdzv_backend != "static",
                                            named=addr is not None or bool(self.cfg.local_addr))
        key = self.store_key() or secrets.token_bytes(32)   # no mirror (tests): a key no worker holds
        proc = await asyncio.create_subprocess_exec(
            self.cfg.python_exec, "-m", "tpassrun.launch.storeserver", host, str(port),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        assert proc.stdin is not None
        proc.stdin.write(key.hex().encode() + b"\n")
        with contextlib.suppress(OSError):
            await proc.stdin.drain()
        proc.stdin.close()
        return proc

    _store_bind = "127.0.0.1"

    async def _standby_store(self) -> None:
        """A worker here failed in a collective: if the node that died ran the workers' store, the re-formed world
        needs a new one, and starting a store process (it imports torch) takes seconds. Start it now, while the
        loss is being confirmed (the lease takes as long to expire): idle unless this node leads the recovery."""
        if self._standby is not None or self.store_host == self.node_id or self._store_proc is not None:
            return
        port = _free_port()
        self._standby = standby = (await self._spawn_store(port), port)
        asyncio.ensure_future(self._retire_standby(standby))

    async def _retire_standby(self, standby: tuple[Any, int]) -> None:
        """Stop an unused standby store once nothing is being recovered any more (it holds a process)."""
        from tpassrun.channel import WorkerPhase

        quiet = 0.0
        while self._standby is standby:
            await asyncio.sleep(1.0)
            failed = self.slots is not None and any(self.slots.phase(s) == WorkerPhase.FAILED
                                                    for s in self.slots.active())
            quiet = 0.0 if (failed or (self.swapper is not None and self.swapper.busy)) else quiet + 1.0
            if quiet >= 5.0 and self._standby is standby:
                self._standby = None
                with contextlib.suppress(ProcessLookupError):
                    standby[0].kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(standby[0].wait(), 5)

    async def _host_new_store(self) -> tuple[str, int]:
        """Run the workers' store here from now on (the node that ran it was lost): the standby if one is up."""
        standby, self._standby = self._standby, None
        if standby is not None and standby[0].returncode is None:
            self._store_proc, port = standby
            self._store_port = port
        else:
            port = _free_port()
            await self._start_store(port)
        return (self._store_addr(self.cfg.local_addr or socket.getfqdn()), port)

    async def _stop_store(self) -> None:
        procs = [self._store_proc, self._standby[0] if self._standby else None]
        self._store_proc, self._standby = None, None
        for proc in procs:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(proc.wait(), 5)


def run_launcher(cfg: LaunchConfig) -> int:
    """Run the agent for this node to completion and return torchrun's exit code."""
    level = os.environ.get(E.LOGLEVEL, "WARNING").upper()
    handler = logging.StreamHandler()
    handler.setFormatter(GlogFormatter())      # one format for every line the launcher prints
    logging.basicConfig(level=getattr(logging, level, logging.WARNING), handlers=[handler])
    agent = Agent(cfg)
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
