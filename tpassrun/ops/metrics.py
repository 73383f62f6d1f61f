"""``--metrics-port``: a Prometheus endpoint per agent, fed from the event stream (and the slots at scrape time).

Counters and histograms follow the events (:mod:`tpassrun.ops.events`) through the same :class:`Describer` the
console uses, so the metrics and the console never disagree; per-rank step and step time, free spares and the
goodput are read when Prometheus scrapes (no per-step cost). ``prometheus_client`` is an optional dependency
(``pip install 'tpassrun[metrics]'``); nothing here is imported unless the flag is given.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from tpassrun.ops.console import Describer
from tpassrun.ops.tui import RunProgress
from tpassrun.transfer import Throttle, held_note

if TYPE_CHECKING:
    from tpassrun.swapper import StatusHost

log = logging.getLogger("tpassrun.ops.metrics")

PAUSE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class AgentMetrics:
    """An event listener and a Prometheus collector. Constructing it does no I/O; :meth:`serve` listens."""

    def __init__(self, agent: "StatusHost") -> None:
        self.agent = agent
        self.registry = CollectorRegistry()
        self.describer = Describer()
        self._throttle = Throttle()
        r = self.registry
        self.swaps = Counter("tpassrun_swaps", "Swaps that resumed training, by kind (planned, unplanned)",
                             ["kind"], registry=r)
        self.pause = Histogram("tpassrun_swap_pause_seconds", "Training pause of each swap, by kind", ["kind"],
                               buckets=PAUSE_BUCKETS, registry=r)
        self.aborted = Counter("tpassrun_swaps_aborted", "Swaps given up", registry=r)
        self.bytes = Counter("tpassrun_state_bytes_moved", "Bytes of rank state received by joiners", registry=r)
        self.restarts = Counter("tpassrun_whole_group_restarts", "Falls back to torchrun's whole-group restart",
                                registry=r)
        self.hangs = Counter("tpassrun_hang_kills", "Hung workers killed by the watchdog", registry=r)
        self.deaths = Counter("tpassrun_worker_failures", "Worker failures, by kind", ["kind"], registry=r)
        self.taints = Counter("tpassrun_taints", "Taints received, by source", ["source"], registry=r)
        self.steps_redone = Counter("tpassrun_steps_redone", "Steps re-executed after unplanned recoveries",
                                    registry=r)
        self.flaps = Counter("tpassrun_link_flaps", "Link outages of this node ridden out (netwatch)", registry=r)
        self.link_extra_s = 0.0      # netwatch: step time added by this node's degraded link (0: not degraded)
        r.register(self)
        self._server: Any = None
        self.port = 0

    # --- event listener ---
    def __call__(self, ev: dict[str, Any]) -> None:
        name = ev.get("event")
        before = len(self.describer.tally.swaps), self.describer.tally.steps_redone
        self.describer.describe(ev)
        tally = self.describer.tally
        if len(tally.swaps) > before[0]:
            swap = tally.swaps[-1]
            self.swaps.labels(swap.kind).inc()
            self.pause.labels(swap.kind).observe(swap.pause_s)
            self.steps_redone.inc(tally.steps_redone - before[1])
        if name == "swap_transfer_end":
            self.bytes.inc(float(ev.get("nbytes") or 0))
        elif name == "swap_aborted_here":
            self.aborted.inc()
        elif name == "fallback":
            self.restarts.inc()
        elif name == "hang_detected":
            self.hangs.inc()
        elif name == "worker_died":
            self.deaths.labels(str(ev.get("kind") or "exit_code")).inc()
        elif name == "user_error":
            self.deaths.labels("user_error").inc()
        elif name in ("taint_received", "health_taint"):
            self.taints.labels(str(ev.get("source") or "health")).inc()
        elif name == "link_ridden_out":
            self.flaps.inc()
        elif name in ("link_degraded", "link_healthy"):
            self.link_extra_s = float(ev.get("extra_ms") or 0.0) / 1000.0 if name == "link_degraded" else 0.0

    # --- scrape-time gauges ---
    def describe(self) -> list[Any]:
        return []   # not known before the first scrape: the registry must not call collect() at register()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        slots = self.agent.slots
        rows = slots.table() if slots is not None else []
        step = GaugeMetricFamily("tpassrun_step", "Step each rank is executing", labels=["rank"])
        took = GaugeMetricFamily("tpassrun_step_seconds", "Duration of each rank's last step", labels=["rank"])
        for w in rows:    # records.WorkerRow
            if w.rank is not None and not w.spare:
                step.add_metric([str(w.rank)], float(w.step))
                took.add_metric([str(w.rank)], w.last_step_ms / 1000.0)
        yield step
        yield took
        progress = RunProgress.of([w.to_json() for w in rows])    # this node's ranks (the job's: tpassctl status)
        yield GaugeMetricFamily("tpassrun_total_steps", "The total steps sess.run() was given (0: not known)",
                                value=float(progress.total))
        eta = progress.eta_s
        yield GaugeMetricFamily("tpassrun_eta_seconds", "Time left at the slowest rank's step time (-1: not known)",
                                value=eta if eta is not None else -1.0)
        yield GaugeMetricFamily("tpassrun_spares_free", "Ready spare slots on this node",
                                value=float(sum(1 for w in rows if w.spare)))
        gen = self.agent.generation
        yield GaugeMetricFamily("tpassrun_generation", "Current generation number",
                                value=float(gen.number if gen is not None else -1))
        health = GaugeMetricFamily("tpassrun_health_verdict", "Latest health verdict per device (1 = this status)",
                                   labels=["device", "status"])
        for device, status in sorted(self.describer.health.items(), key=lambda x: str(x[0])):
            health.add_metric([str(device), str(status)], 1.0)
        yield health
        yield GaugeMetricFamily("tpassrun_link_degraded_extra_step_seconds", "Step time this node's degraded link "
                                "adds to every step (0: its link is not degraded)", value=self.link_extra_s)
        tally = self.describer.tally     # the summary's own reducer (tpassrun/ops/tally.py): -1 where it says unknown
        goodput, steps_lost = tally.goodput, tally.restart_redone
        yield GaugeMetricFamily("tpassrun_goodput_ratio", "Share of wall time that was useful training (not "
                                "swap pauses, restarts, or steps a restart ran again); -1: unknown (a restart of a "
                                "script without the worker API)", value=-1.0 if goodput is None else goodput / 100.0)
        yield GaugeMetricFamily("tpassrun_time_lost_seconds", "Wall time lost to swap pauses, restarts and the "
                                "steps restarts ran again (a lower bound while tpassrun_costs_known is 0)",
                                value=tally.lost)
        yield GaugeMetricFamily("tpassrun_costs_known", "1: every restart's steps run again are known; 0: a restart "
                                "of a script without the worker API (its steps are not seen)",
                                value=1.0 if tally.known else 0.0)
        yield GaugeMetricFamily("tpassrun_steps_lost", "Steps whole-group restarts ran again (progress since the "
                                "script's last checkpoint); -1: unknown",
                                value=-1.0 if steps_lost is None else float(steps_lost))
        yield GaugeMetricFamily("tpassrun_steps_redone", "In-flight steps live recoveries re-executed",
                                value=float(tally.steps_redone))
        yield GaugeMetricFamily("tpassrun_whole_group_restarts", "Whole-group restarts (torchrun's path)",
                                value=float(len(tally.restarts)))
        yield GaugeMetricFamily("tpassrun_fallbacks", "Failures no spare could take (fell back to a restart)",
                                value=float(tally.fallbacks))

    # --- lifecycle ---
    def serve(self, addr: str, port: int) -> int:
        server = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server[0] if isinstance(server, tuple) else None
        if self._server is not None:
            self._server.handle_error = self._connection_failed
        self.port = self._server.server_port if self._server is not None else port
        return self.port

    def _connection_failed(self, _request: Any, client_address: Any) -> None:
        """A request that failed (socketserver printed a traceback each: 133 under a port scan): a client that
        hung up is no news; anything else, one line per source per minute (:mod:`tpassrun.transfer.quiet`)."""
        exc = sys.exc_info()[1]
        source = str(client_address[0]) if isinstance(client_address, tuple) and client_address else "?"
        if isinstance(exc, ConnectionError):
            log.debug("metrics: %s hung up: %s", source, exc)
            return
        held = self._throttle.check(source)
        if held is not None:
            log.warning("metrics: a request from %s failed: %s: %s%s", source, type(exc).__name__, exc,
                        held_note(held, self._throttle.window))

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def serve_metrics(agent: "StatusHost", stack: contextlib.AsyncExitStack) -> tuple[str, int]:
    """--metrics-port: listen (closed by ``stack``) and follow ``agent``'s events from now on."""
    from tpassrun.rendezvous import RendezvousError

    metrics = AgentMetrics(agent)
    agent.events.add_listener(metrics)
    bind = "127.0.0.1" if agent.cfg.uses_embedded_etcd else "0.0.0.0"
    try:
        port = metrics.serve(bind, int(agent.cfg.metrics_port or 0))
    except OSError as exc:
        raise RendezvousError(f"--metrics-port {agent.cfg.metrics_port}: cannot listen: {exc}") from exc
    stack.callback(metrics.close)
    return bind, port
