"""torchrun-compatible command line -> one frozen :class:`LaunchConfig`.

Every torchrun 2.13 flag is accepted with both spellings (``--nproc-per-node`` and
``--nproc_per_node``), the same ``PET_*`` environment fallbacks, the same argparse abbreviation
behaviour (``--nproc`` is ambiguous, ``--max-re 2`` works) and the same defaults. tpassrun's own
flags use names torchrun does not.

Rendezvous backends. torchrun's ``static``, ``c10d``, ``etcd`` and ``etcd-v2`` are all accepted and
all run on tpassrun's etcd v3 rendezvous; the user's choice is recorded in ``rdzv_backend`` and only
decides which etcd is used (``etcd_endpoint``):

=====================  ==========================================  ===========================
backend                ``--rdzv-endpoint`` given                   omitted
=====================  ==========================================  ===========================
``etcd``/``etcd-v2``   that etcd (default port 2379)               ``localhost:2379``
``c10d``               taken as an etcd (default port 29400)       embedded private etcd if
                                                                   max nodes == 1, else
                                                                   :class:`ConfigError`
``static``             the workers' store (torchrun's); etcd on    ``--master-addr:--master-port``
                       its port + 1, embedded for one node         the same way
=====================  ==========================================  ===========================

``--standalone`` (explicit, or implicit like torchrun: ``static`` + no endpoint + no
``--master-port`` + max nodes == 1) forces ``c10d``/``localhost:0`` and a uuid4 run id, and always
uses the embedded private etcd.

The frozen result type, torchrun's defaults and ``Std`` are in :mod:`tpassrun.settings` (what the rest of
tpassrun imports, never this parser); the pure resolution rules in :mod:`tpassrun.launch.rules`. Both are
re-exported here.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from tpassrun.launch.rules import (
    _accelerator_count,
    check_endpoint,
    cpu_count,
    derived_omp,
    determine_local_world_size,
    parse_local_ranks_filter,
    parse_min_max_nnodes,
    parse_rdzv_conf,
    resolve_etcd_endpoint,
    static_etcd_endpoint,
    with_default_port,
)
from tpassrun.settings import (
    BACKENDS,
    C10D_DEFAULT_PORT,
    DEFAULT_LOGS_SPECS,
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT,
    DEFAULT_SIGNALS,
    ETCD_DEFAULT_PORT,
    EVENT_LOG_HANDLERS,
    IGNORED_BY_DYNAMIC,
    NUMA_MODES,
    STATIC_DEFAULT_MASTER_PORT,
    ConfigError,
    LaunchConfig,
    Std,
    StdSpec,
    parse_std,
    shard_interval,
    std_for,
)
from tpassrun.settings import envnames as E

# --------------------------------------------------------------------------------------------
# argparse with torchrun's env fallbacks, reading from an injected mapping
# --------------------------------------------------------------------------------------------


def _env_value_action(environ: Mapping[str, str], prefix: str) -> type[argparse.Action]:
    """torchrun's ``argparse_util.env``: ``<prefix><DEST>`` replaces the default."""

    class EnvValue(argparse.Action):
        def __init__(self, dest: str, default: Any = None, required: bool = False, **kw: Any):
            default = environ.get(f"{prefix}{dest.upper()}", default)
            if default:
                required = False
            super().__init__(dest=dest, default=default, required=required, **kw)

        def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
            setattr(namespace, self.dest, values)

    return EnvValue


def _env_flag_action(environ: Mapping[str, str], prefix: str) -> type[argparse.Action]:
    """torchrun's ``argparse_util.check_env``: a store_true whose default is ``int(<prefix><DEST>)``."""

    class EnvFlag(argparse.Action):
        def __init__(self, dest: str, default: bool = False, **kw: Any):
            name = f"{prefix}{dest.upper()}"
            raw = environ.get(name, "1" if default else "0")
            try:
                default = bool(int(raw))
            except ValueError:
                # torchrun dies with a ValueError traceback here; we say why on one line.
                raise ConfigError(f"{name} must be an integer (0 or 1), got {raw!r}") from None
            super().__init__(dest=dest, const=True, default=default, nargs=0, **kw)

        def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
            setattr(namespace, self.dest, self.const)

    return EnvFlag


def _comma_separated_list(value: str) -> list[str]:
    """torchrun's duplicate-filter list: ``,,`` escapes a comma."""
    placeholder = "<COMMA_PLACEHOLDER>"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]



def _byte_size(text: str) -> int:
    """``1073741824``, ``512M``, ``8G``, ``1.5T`` -> bytes (binary units); at least 1 MiB."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in units else ""
    try:
        value = int(float(raw[:len(raw) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a K/M/G/T suffix)") from None
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is less than 1M")
    return value

def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The argument parser: torchrun's flags in torchrun's order, then tpassrun's own."""
    env = _env_value_action(environ, E.PET_PREFIX)
    flag = _env_flag_action(environ, E.PET_PREFIX)
    p = argparse.ArgumentParser(
        prog="tpassrun",
        description="torchrun-compatible launcher that swaps a failing rank for a warm spare",
    )
    add = p.add_argument
    add("--nnodes", action=env, type=str, default="1:1",
        help="Number of nodes, or the range of nodes in form <minimum_nodes>:<maximum_nodes>.")
    add("--nproc-per-node", "--nproc_per_node", action=env, type=str, default="1",
        help="Number of workers per node; supported values: [auto, cpu, gpu, xpu, int].")
    add("--rdzv-backend", "--rdzv_backend", action=env, type=str, default="static",
        help="Rendezvous backend (static, c10d, etcd, etcd-v2: all run on tpassrun's etcd v3 rendezvous).")
    add("--rdzv-endpoint", "--rdzv_endpoint", action=env, type=str, default="",
        help="Rendezvous endpoint <host>:<port>; for tpassrun this is an etcd v3 server.")
    add("--rdzv-id", "--rdzv_id", action=env, type=str, default="none", help="User-defined group id.")
    add("--rdzv-conf", "--rdzv_conf", action=env, type=str, default="",
        help="Additional rendezvous configuration (<key1>=<value1>,<key2>=<value2>,...).")
    add("--standalone", action=flag,
        help="Single-node run on a private embedded etcd; --rdzv-backend/-endpoint/-id are ignored.")
    add("--max-restarts", "--max_restarts", action=env, type=int, default=0,
        help="Maximum number of worker group restarts before failing.")
    add("--monitor-interval", "--monitor_interval", action=env, type=float, default=0.1,
        help="Interval, in seconds, to monitor the state of workers.")
    add("--start-method", "--start_method", action=env, type=str, default="spawn",
        choices=["spawn", "fork", "forkserver"], help="Multiprocessing start method (accepted for parity).")
    add("--event-log-handler", "--event_log_handler", action=env, type=str, default="null",
        help="torchelastic event handler: null, console (JSON events on stderr, like torchrun) or "
             "dynamic_rendezvous (prints nothing). tpassrun's own event log: --event-log.")
    add("--role", action=env, type=str, default="default", help="User-defined role for the workers.")
    add("-m", "--module", action=flag, help="Run the script as a module, like 'python -m'.")
    add("--no-python", "--no_python", action=flag, help="Execute the training script directly.")
    add("--run-path", "--run_path", action=flag,
        help="Run the training script with runpy.run_path in a child interpreter. Takes precedence over --no-python.")
    add("--log-dir", "--log_dir", action=env, type=str, default=None, help="Base directory for log files.")
    add("-r", "--redirects", action=env, type=str, default="0",
        help="Redirect std streams into log files (e.g. -r 3, or -r 0:1,1:2).")
    add("-t", "--tee", action=env, type=str, default="0",
        help="Tee std streams into log files and to the console (see --redirects for format).")
    add("--local-ranks-filter", "--local_ranks_filter", action=env, type=str, default="",
        help="Only show the console output of these local ranks (e.g. 0,1).")
    add("--duplicate-stdout-filters", "--duplicate_stdout_filters", action=env, type=_comma_separated_list,
        default=[], help="Also copy tee'd stdout lines containing any of these to filtered_stdout.log.")
    add("--duplicate-stderr-filters", "--duplicate_stderr_filters", action=env, type=_comma_separated_list,
        default=[], help="Same for stderr.")
    add("--node-rank", "--node_rank", type=int, action=env, default=0, help="Node rank (static backend only).")
    add("--master-addr", "--master_addr", default="127.0.0.1", type=str, action=env,
        help="Address of the rank-0 node (static backend only).")
    add("--master-port", "--master_port", default=None, type=int, action=env,
        help="Port on the rank-0 node (static backend only). Defaults to 29500.")
    add("--local-addr", "--local_addr", default=None, type=str, action=env, help="Address of this node.")
    add("--logs-specs", "--logs_specs", default=None, type=str,
        help="torchrun.logs_specs entry point (not supported by tpassrun).")
    add("--numa-binding", "--numa_binding", type=str, choices=list(NUMA_MODES), default=None,
        help="Bind workers to CPUs near their GPU (accepted for parity).")
    add("--signals-to-handle", "--signals_to_handle", action=env, type=str, default=DEFAULT_SIGNALS,
        help="Comma-separated signals the launcher traps and forwards to workers.")
    add("--shutdown-timeout", "--shutdown_timeout", action=env, type=int, default=None,
        help="Seconds between the forwarded signal and SIGKILL (default TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).")
    add("--virtual-local-rank", "--virtual_local_rank", action=flag,
        help="LOCAL_RANK=0 for every worker, CUDA_VISIBLE_DEVICES = its own GPU.")

    ours = p.add_argument_group("tpassrun")
    ours.add_argument("--spares-per-node", "--spares_per_node", type=int, default=0,
                      help="Warm spare workers kept ready on this node.")
    ours.add_argument("--spare-node", "--spare_node", action="store_true",
                      help="This agent joins as a spare node.")
    ours.add_argument("--spare-nodes", "--spare_nodes", type=int, default=int(environ.get(E.TPASSRUN_SPARE_NODES) or 0),
                      help="Inside a Slurm step (srun): the last K nodes of the step are spare nodes.")
    ours.add_argument("--scheduler", choices=["auto", "slurm", "none"], default="auto",
                      help="auto: read a Slurm step's allocation when there is one (run id, nodes, etcd host, "
                           "spare nodes; the flags given win) and watch its nodes; none: ignore Slurm.")
    ours.add_argument("--spare-pool", "--spare_pool", type=str, default=None,
                      help="Draw a node from this spare pool (tpassctl pool) when a node is lost and no own spare is "
                           "ready; the pool key: --rdzv-conf pool_key_file=PATH or $TPASSRUN_POOL_KEY.")
    ours.add_argument("--priority", type=int, default=0,
                      help="This job's priority in its spare pool (a higher one may pre-empt a lower one's pool node).")
    ours.add_argument("--pool-wait", "--pool_wait", type=float, default=60.0,
                      help="Seconds a lost node's recovery waits for a pool node before torchrun's restart.")
    ours.add_argument("--pool-members", "--pool_members", type=int, default=0,
                      help="An elastic job (--nnodes MIN:MAX) started with --spare-pool: claim up to N idle pool nodes "
                           "at start as members (lower-priority work: a higher --priority job may take them back, "
                           "and this job then shrinks as torchrun's elastic membership change does).")
    ours.add_argument("--hang-timeout", "--hang_timeout", type=float, default=0.0,
                      help="Seconds without a step heartbeat before a worker counts as hung (0 = off).")
    ours.add_argument("--metrics-port", "--metrics_port", type=int, default=None,
                      help="Serve Prometheus metrics of this agent on this port (0: a free one; needs prometheus_client).")
    ours.add_argument("--event-log", "--event_log", type=str, default=None,
                      help="JSON-lines event log (default <run log dir>/events.jsonl).")
    ours.add_argument("--tui", dest="tui", action="store_true", default=None,
                      help="Show the live status view as a panel under the workers' output (stdout a terminal).")
    ours.add_argument("--no-tui", "--no_tui", dest="tui", action="store_false", help="No status panel (the default).")
    ours.add_argument("--etcd-bin", "--etcd_bin", type=str, default=environ.get(E.TPASSRUN_ETCD_BIN),
                      help="etcd binary for the embedded private etcd.")
    ours.add_argument("--health-config", "--health_config", type=str, default=None,
                      help="Health policy file.")
    ours.add_argument("--health-file", "--health_file", type=str, default=environ.get(E.TPASSRUN_HEALTH_FILE),
                      help="JSON readings file written by a site health tool (see tpassrun.health.FileSensor).")
    ours.add_argument("--health-interval", "--health_interval", type=float, default=1.0,
                      help="Seconds between health checks.")
    ours.add_argument("--straggler-factor", "--straggler_factor", type=float, default=0.0,
                      help="Swap a rank whose step time exceeds F x the median (0 = off).")
    ours.add_argument("--migrate-back", "--migrate_back", action="store_true",
                      help="Move work back to a repaired node when it returns.")
    ours.add_argument("--mirror-max-bytes", "--mirror_max_bytes", type=_byte_size, default=1 << 30,
                      help="Host memory this agent's mirror store may hold for other nodes' ranks (bytes, or with a "
                           "K/M/G/T suffix; default 1G): 2 x each mirrored rank's shard, see the README.")
    ours.add_argument("--snapshot-interval", "--snapshot_interval", type=float, default=0.0,
                      help="The transparent mode, for scripts that do not use the worker API: a whole-job process "
                           "snapshot (CRIU >= 4.2, root) every S seconds; a rank's death restores every rank from the "
                           "last one, a taint moves the rank to a spare slot with no step lost (docs/transparent.md). "
                           "0 (the default): off. Without a usable CRIU, one line says why and the job runs as under "
                           "torchrun.")
    ours.add_argument("--shard-mirror-interval", "--shard_mirror_interval", type=str, default="auto",
                      help="Refresh the in-memory copies of sharded state (sess.track_sharded: ZeRO, FSDP) every K "
                           "steps (an unplanned failure then recomputes up to K-1 steps; 0 = off). Default 'auto': "
                           "the ranks measure a refresh's background CPU against the step time and agree on the "
                           "smallest K (<= 16) that keeps it within 1%% of a step."),

    add("training_script", type=str, help="The training script (or module, or binary) and its arguments.")
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def parse_args(
    argv: list[str],
    environ: Mapping[str, str] | None = None,
    *,
    new_run_id: Callable[[], str] = lambda: str(uuid.uuid4()),
    accelerator_count: Callable[[str], int] = _accelerator_count,
    address_of: Callable[[str], str] | None = None,
) -> LaunchConfig:
    """Parse a torchrun command line (without the program name) into a :class:`LaunchConfig`.

    Args:
        argv: the arguments, e.g. ``["--nproc-per-node", "2", "train.py", "--lr", "0.1"]``.
        environ: the launcher's environment (``PET_*``, ``PYTHON_EXEC``, ``OMP_NUM_THREADS``...);
            defaults to ``os.environ``. Only read, never written.
        new_run_id: source of the run id for ``--standalone``.
        accelerator_count: device counter for ``--nproc-per-node gpu|xpu|auto``.
        address_of: a Slurm node name -> its address (default: ``scontrol show node``'s NodeAddr).

    Raises:
        ConfigError: on invalid values (one-line message).
        SystemExit: from argparse on unknown flags or bad types (usage line, code 2), like torchrun.
    """
    env = os.environ if environ is None else environ
    ns = build_parser(env).parse_args(argv)
    node_name, may_host = _from_scheduler(ns, env, address_of)

    backend, endpoint, run_id = ns.rdzv_backend, ns.rdzv_endpoint, ns.rdzv_id
    min_nodes, max_nodes = parse_min_max_nnodes(ns.nnodes)
    standalone = bool(ns.standalone)
    if not standalone and backend == "static" and not endpoint and ns.master_port is None and max_nodes == 1:
        standalone = True  # torchrun's implicit standalone (run.py `run`)
    if standalone:
        backend, endpoint, run_id = "c10d", "localhost:0", new_run_id()
    if backend not in BACKENDS:
        raise ConfigError(f"--rdzv-backend={backend}: unknown backend (choose from {', '.join(BACKENDS)})")
    master_port = STATIC_DEFAULT_MASTER_PORT if ns.master_port is None else ns.master_port
    check_endpoint(endpoint, backend)
    if backend == "static":
        # torchrun's static agent of node rank 0 serves the workers' store on the endpoint (MASTER_ADDR/PORT);
        # ours does too, and the etcd of a multi-node run sits next to it
        endpoint = endpoint or f"{ns.master_addr}:{master_port}"  # torchrun's get_rdzv_endpoint
        check_endpoint(endpoint, backend)
        etcd_endpoint = static_etcd_endpoint(endpoint) if max_nodes > 1 else None
    else:
        etcd_endpoint = resolve_etcd_endpoint(backend, endpoint, max_nodes, standalone)

    if ns.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0 (got {ns.max_restarts})")
    if ns.pool_members and not (ns.spare_pool and 0 < ns.pool_members < max_nodes and min_nodes < max_nodes):
        raise ConfigError(f"--pool-members {ns.pool_members}: needs --spare-pool and an elastic --nnodes MIN:MAX with "
                          f"0 < N < MAX (got --nnodes {ns.nnodes})")
    if not ns.monitor_interval > 0:
        raise ConfigError(f"--monitor-interval must be > 0 (got {ns.monitor_interval})")
    if ns.no_python and ns.module and not ns.run_path:
        raise ConfigError("Don't use both the '--no-python' flag and the '--module' flag at the same time.")
    if ns.logs_specs not in (None, DEFAULT_LOGS_SPECS):
        # torchrun: ValueError "Could not find entrypoint under 'torchrun.logs_specs[...]'" and exit 1
        raise ConfigError(f"--logs-specs={ns.logs_specs}: no such logs specs (tpassrun knows only "
                          f"{DEFAULT_LOGS_SPECS!r}, torchrun's built-in one)")
    if ns.event_log_handler not in EVENT_LOG_HANDLERS:
        # torchrun: KeyError from events/handlers.py get_logging_handler, exit 1
        raise ConfigError(f"--event-log-handler={ns.event_log_handler}: unknown handler (choose from "
                          f"{', '.join(EVENT_LOG_HANDLERS)})")
    if not standalone and "/" in run_id:
        # torchrun: a FileNotFoundError traceback from mkdtemp(prefix=f"{run_id}_") for the log dir
        raise ConfigError(f"--rdzv-id={run_id}: a run id cannot contain '/' (it names the run's log directory)")
    if ns.log_dir and ns.log_dir != os.devnull and os.path.isfile(ns.log_dir):
        raise ConfigError(f"--log-dir={ns.log_dir} is a file")
    if ns.spares_per_node < 0:
        raise ConfigError(f"--spares-per-node must be >= 0 (got {ns.spares_per_node})")
    try:
        shard_interval.parse(ns.shard_mirror_interval)
    except ValueError:
        raise ConfigError(f"--shard-mirror-interval must be an integer >= 0 or 'auto' (got "
                          f"{ns.shard_mirror_interval!r})") from None
    if not ns.snapshot_interval >= 0 or ns.snapshot_interval == float("inf"):   # NaN fails the first test
        raise ConfigError(f"--snapshot-interval must be a number of seconds >= 0 (got {ns.snapshot_interval})")
    if ns.metrics_port is not None and not 0 <= ns.metrics_port <= 65535:
        raise ConfigError(f"--metrics-port must be a port number (0-65535), not {ns.metrics_port}")
    if ns.metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:
            raise ConfigError("--metrics-port needs prometheus_client: pip install 'tpassrun[metrics]'") from None
    if ns.hang_timeout < 0 or ns.straggler_factor < 0 or ns.health_interval <= 0:
        raise ConfigError("--hang-timeout and --straggler-factor must be >= 0, --health-interval > 0")

    rdzv_conf = parse_rdzv_conf(ns.rdzv_conf)
    if backend in ("c10d", "etcd-v2"):
        for key in IGNORED_BY_DYNAMIC:
            rdzv_conf.pop(key, None)
    else:
        rdzv_conf.setdefault("timeout", DEFAULT_RDZV_TIMEOUT)
    if backend == "static":
        rdzv_conf["rank"] = str(ns.node_rank)

    nproc = determine_local_world_size(ns.nproc_per_node, accelerator_count)
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1 (got {nproc})")

    shutdown_timeout = ns.shutdown_timeout
    if shutdown_timeout is None:
        raw = env.get(E.TORCH_ELASTIC_SHUTDOWN_TIMEOUT, str(DEFAULT_SHUTDOWN_TIMEOUT))
        try:
            shutdown_timeout = int(raw)
        except ValueError:
            raise ConfigError(f"{E.TORCH_ELASTIC_SHUTDOWN_TIMEOUT} must be an integer, got {raw!r}") from None
    if shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 (got {shutdown_timeout})")

    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_id=run_id,
        rdzv_conf=rdzv_conf,
        standalone=standalone,
        max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        start_method=ns.start_method,
        event_log_handler=ns.event_log_handler,
        role=ns.role,
        module=ns.module,
        no_python=ns.no_python,
        run_path=ns.run_path,
        log_dir=ns.log_dir,
        redirects=parse_std(ns.redirects),
        tee=parse_std(ns.tee),
        local_ranks_filter=parse_local_ranks_filter(ns.local_ranks_filter),
        duplicate_stdout_filters=tuple(ns.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(ns.duplicate_stderr_filters),
        node_rank=ns.node_rank,
        master_addr=ns.master_addr,
        master_port=master_port,
        local_addr=ns.local_addr,
        logs_specs=ns.logs_specs,
        numa_binding=ns.numa_binding,
        signals_to_handle=ns.signals_to_handle,
        shutdown_timeout=shutdown_timeout,
        virtual_local_rank=ns.virtual_local_rank,
        training_script=ns.training_script,
        training_script_args=tuple(ns.training_script_args),
        python_exec=env.get(E.PYTHON_EXEC, sys.executable),
        log_line_prefix_template=env.get(E.TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE),
        omp_num_threads=derived_omp(nproc, env),
        etcd_endpoint=etcd_endpoint,
        host_etcd=etcd_endpoint is not None and backend in ("c10d", "static") and may_host,
        spares_per_node=ns.spares_per_node,
        spare_node=ns.spare_node,
        scheduler="slurm" if node_name else "",
        node_name=node_name,
        spare_pool=ns.spare_pool,
        priority=ns.priority,
        pool_wait=ns.pool_wait,
        pool_members=ns.pool_members,
        hang_timeout=ns.hang_timeout,
        event_log=ns.event_log,
        tui=ns.tui,
        etcd_bin=ns.etcd_bin,
        health_config=ns.health_config,
        health_file=ns.health_file,
        health_interval=ns.health_interval,
        straggler_factor=ns.straggler_factor,
        migrate_back=ns.migrate_back,
        metrics_port=ns.metrics_port,
        shard_mirror_interval=shard_interval.parse(ns.shard_mirror_interval),
        mirror_max_bytes=ns.mirror_max_bytes,
        snapshot_interval=ns.snapshot_interval,
    )


def _from_scheduler(ns: argparse.Namespace, env: Mapping[str, str],
                    address_of: Callable[[str], str] | None) -> tuple[str, bool]:
    """Inside a Slurm step, the rendezvous settings the command line left alone come from the allocation
    (``tpassrun/scheduler/slurm.py``); ``ns`` is updated. Returns this node's Slurm name ("" outside Slurm) and
    whether this agent may host the run's etcd (False on every node but the first when Slurm named it)."""
    if ns.spare_nodes < 0:
        raise ConfigError(f"--spare-nodes must be >= 0 (got {ns.spare_nodes})")
    if ns.scheduler == "none":
        if ns.spare_nodes:
            raise ConfigError("--spare-nodes needs the Slurm allocation (not with --scheduler none)")
        return "", True
    from tpassrun.scheduler import slurm

    given = slurm.Given(rdzv_id=ns.rdzv_id, nnodes=ns.nnodes, backend=ns.rdzv_backend, endpoint=ns.rdzv_endpoint,
                        spare_node=ns.spare_node, standalone=bool(ns.standalone), master_port=ns.master_port)
    try:
        got, node_name = slurm.resolve(given, slurm.allocation_from_env(env), ns.spare_nodes,
                                       forced=ns.scheduler == "slurm", address_of=address_of or slurm.node_address)
    except ValueError as exc:
        raise ConfigError(f"Slurm: {exc}") from None
    ns.rdzv_id, ns.nnodes, ns.rdzv_backend, ns.rdzv_endpoint, ns.spare_node = (
        got.rdzv_id, got.nnodes, got.backend, got.endpoint, got.spare_node)
    return node_name, got.hosts_etcd


# --------------------------------------------------------------------------------------------
# preflight: the checks that touch the file system, done once before the agent starts
# --------------------------------------------------------------------------------------------

_CERT_KEYS = ("cacert", "ca_cert", "cert", "ssl_cert", "key", "ssl_cert_key")


def preflight(cfg: LaunchConfig) -> None:
    """Everything the command line names on disk exists and is usable, else one :class:`ConfigError` line
    (these were tracebacks, or a health policy silently switched off, deep inside the agent).

    Creates ``--log-dir`` and the ``--event-log``'s directory, as the agent would a moment later.
    """
    for key in _CERT_KEYS:
        path = cfg.rdzv_conf.get(key)
        if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise ConfigError(f"--rdzv-conf {key}={path}: no such readable file")
    if cfg.log_dir and cfg.log_dir != os.devnull:
        _ensure_dir(cfg.log_dir, "--log-dir")
    if cfg.event_log:
        parent = os.path.dirname(os.path.abspath(cfg.event_log))
        _ensure_dir(parent, "--event-log")
        if os.path.isdir(cfg.event_log):
            raise ConfigError(f"--event-log={cfg.event_log} is a directory")
        try:
            with open(cfg.event_log, "a"):
                pass
        except OSError as exc:
            raise ConfigError(f"--event-log={cfg.event_log}: cannot write: {exc.strerror or exc}") from None
    if cfg.health_config:
        from tpassrun.health import Policy  # only when asked for

        try:
            Policy.load(cfg.health_config)
        except ValueError as exc:
            raise ConfigError(f"--health-config: {exc}") from None


def _ensure_dir(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{flag}={path}: cannot create the directory: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}={path}: the directory is not writable")


__all__ = ["BACKENDS", "C10D_DEFAULT_PORT", "DEFAULT_LOGS_SPECS", "DEFAULT_RDZV_TIMEOUT", "DEFAULT_SHUTDOWN_TIMEOUT",
           "DEFAULT_SIGNALS", "ETCD_DEFAULT_PORT", "EVENT_LOG_HANDLERS", "NUMA_MODES", "STATIC_DEFAULT_MASTER_PORT",
           "ConfigError", "LaunchConfig", "Std", "StdSpec", "build_parser", "check_endpoint", "cpu_count",
           "derived_omp", "determine_local_world_size", "parse_args", "parse_local_ranks_filter",
           "parse_min_max_nnodes", "parse_rdzv_conf", "parse_std", "preflight", "resolve_etcd_endpoint",
           "static_etcd_endpoint", "std_for", "with_default_port"]
