"""The launcher's settings, resolved: one frozen :class:`LaunchConfig`, apart from argparse.

:mod:`tpassrun.launch.config` builds it from a torchrun command line; everything else (the agent, ``procs``,
``workerenv``) reads it from here and never imports the parser. Also here: torchrun's defaults, its ``Std``
redirect/tee specs, and :class:`ConfigError` (one user-facing line).
"""

from __future__ import annotations

import enum
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field


class ConfigError(Exception):
    """A bad command line or environment; the message is one user-facing line."""


# --------------------------------------------------------------------------------------------
# stdio redirect/tee specs (torchrun's ``Std``)
# --------------------------------------------------------------------------------------------


class Std(enum.IntFlag):
    """Which standard streams of a worker go to files: torchrun's ``Std``."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


StdSpec = Std | Mapping[int, Std]

# Same regexes as torchrun (multiprocessing/api.py): single-digit local ranks only.
_STD_VALUE = re.compile(r"^[0123]$")
_STD_MAPPING = re.compile(r"^(\d:[0123],)*(\d:[0123])$")


def parse_std(text: str) -> StdSpec:
    """Parse ``-r``/``-t``: ``"3"`` -> Std.ALL, ``"0:3,1:1"`` -> {0: ALL, 1: OUT}."""
    if _STD_VALUE.match(text):
        return Std(int(text))
    if _STD_MAPPING.match(text):
        return {int(k): Std(int(v)) for k, v in (item.split(":") for item in text.split(","))}
    raise ConfigError(f"{text} does not match: <{_STD_VALUE.pattern}> or <{_STD_MAPPING.pattern}>")


def std_for(spec: StdSpec, local_rank: int) -> Std:
    """The setting that applies to one local rank (ranks missing from a mapping get NONE)."""
    if isinstance(spec, Std):
        return spec
    return spec.get(local_rank, Std.NONE)


# --------------------------------------------------------------------------------------------
# the resolved configuration
# --------------------------------------------------------------------------------------------

ETCD_DEFAULT_PORT = 2379
C10D_DEFAULT_PORT = 29400
STATIC_DEFAULT_MASTER_PORT = 29500
DEFAULT_RDZV_TIMEOUT = "900"
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
DEFAULT_SHUTDOWN_TIMEOUT = 30
BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")  # torchrun's events/handlers.py
DEFAULT_LOGS_SPECS = "default"  # torchrun's entry point name for DefaultLogsSpecs
# --rdzv-conf keys torchrun's c10d/etcd-v2 handler never reads (dynamic_rendezvous.py create_handler reads
# join_timeout, last_call_timeout, close_timeout, heartbeat_timeout, keep_alive_*): whatever their value,
# torchrun runs and its join timeout stays 600 s. They are dropped, so the rendezvous, which takes "timeout"
# as the join timeout of the legacy etcd and static handlers, never sees them under c10d/etcd-v2.
IGNORED_BY_DYNAMIC = ("timeout",)
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


@dataclass(frozen=True)
class LaunchConfig:
    """Everything the launcher needs, resolved. Field names follow torchrun's argparse dests.

    ``rdzv_backend``/``rdzv_endpoint``/``rdzv_id`` hold what torchrun itself would use after
    ``--standalone`` resolution; ``etcd_endpoint`` is the etcd v3 server tpassrun talks to
    (``None`` = start the embedded private etcd).
    """

    # --- torchrun's options ---
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    event_log_handler: str = "null"
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str | None = None
    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = STATIC_DEFAULT_MASTER_PORT
    local_addr: str | None = None
    logs_specs: str | None = None
    numa_binding: str | None = None
    signals_to_handle: str = DEFAULT_SIGNALS
    shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT
    virtual_local_rank: bool = False
    training_script: str = ""
    training_script_args: tuple[str, ...] = ()
    # --- read from the launcher's environment, like torchrun ---
    python_exec: str = sys.executable
    log_line_prefix_template: str | None = None
    omp_num_threads: str | None = None  # value the launcher sets for workers (None: leave alone)
    # --- where tpassrun's etcd is ---
    etcd_endpoint: str | None = None
    # c10d/static: like torchrun's store host, the agent on the endpoint's machine serves the etcd there if
    # nothing does yet (torchrun users need no etcd of their own)
    host_etcd: bool = False
    # --- tpassrun's own ---
    spares_per_node: int = 0
    spare_node: bool = False
    scheduler: str = ""     # "slurm": the agent runs in a Slurm step and watches its nodes (tpassrun/scheduler/)
    node_name: str = ""     # this node's name in the scheduler (the agent's node id starts with it)
    spare_pool: str | None = None   # draw from this spare pool (tpassrun.pool) when no own spare is ready
    priority: int = 0               # in the pool: a higher priority may pre-empt a lower one's pool node
    pool_wait: float = 60.0         # how long a lost node's recovery waits for a pool node before a restart
    pool_members: int = 0           # an elastic job's idle pool nodes claimed at start as members (lower-priority work)
    hang_timeout: float = 0.0
    event_log: str | None = None  # None: <run log dir>/events.jsonl
    tui: bool | None = None  # None/False: no panel (torchrun's console); True: --tui, the status panel
    etcd_bin: str | None = None
    health_config: str | None = None
    health_file: str | None = None  # JSON readings a site tool writes (FileSensor); env TPASSRUN_HEALTH_FILE
    health_interval: float = 1.0
    straggler_factor: float = 0.0
    migrate_back: bool = False
    metrics_port: int | None = None  # Prometheus endpoint of this agent (0: any free port; None: off)
    shard_mirror_interval: int | None = None  # sharded state (sess.track_sharded): local copy + buddy mirror every
                                              # K steps; None: auto (measured and agreed, tpassrun/settings/shard_interval.py)
    mirror_max_bytes: int = 1 << 30  # what this agent's mirror store may hold for other nodes' ranks
    snapshot_interval: float = 0.0   # the transparent mode (CRIU process snapshots) every S seconds; 0: off

    @property
    def uses_embedded_etcd(self) -> bool:
        return self.etcd_endpoint is None
