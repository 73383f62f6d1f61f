"""tpassrun.launch: torchrun's command line (``config``), worker environment and argv (``workerenv``), processes
(``procs``), failure report (``report``), the file timer (``filetimer``), torchelastic's events (``elasticevents``),
device layout (``devices``).

The door holds what other packages use to start a child of their own (``procs``, imported at once) and, imported on
first use, what the command line and the agent use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tpassrun.launch.procs import RunLogs, StdioSpec, adopt_worker, die_with_parent, inherit_only, spawn_worker, stop_workers

if TYPE_CHECKING:
    from tpassrun.launch.config import parse_args, preflight
    from tpassrun.launch.devices import check_layout, node_devices, slot_env, visible_devices
    from tpassrun.launch.elasticevents import ElasticEvents
    from tpassrun.launch.filetimer import FileTimerServer, TimerRequest, signal_name
    from tpassrun.launch.report import ProcessFailure, copy_root_cause_error_file, format_failure_report
    from tpassrun.launch.workerenv import (
        WorkerAssignment,
        check_encrypt_conf,
        elastic_entry_point,
        encrypt_requested,
        entrypoint_name,
        role_ranks,
        worker_argv,
        worker_env,
    )

# name -> the module that defines it
_LAZY = {
    **dict.fromkeys(("parse_args", "preflight"), "tpassrun.launch.config"),
    **dict.fromkeys(("check_layout", "node_devices", "slot_env", "visible_devices"), "tpassrun.launch.devices"),
    "ElasticEvents": "tpassrun.launch.elasticevents",
    **dict.fromkeys(("FileTimerServer", "TimerRequest", "signal_name"), "tpassrun.launch.filetimer"),
    **dict.fromkeys(("ProcessFailure", "copy_root_cause_error_file", "format_failure_report"), "tpassrun.launch.report"),
    **dict.fromkeys(("WorkerAssignment", "check_encrypt_conf", "elastic_entry_point", "encrypt_requested",
                     "entrypoint_name", "role_ranks", "worker_argv", "worker_env"), "tpassrun.launch.workerenv"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["ElasticEvents", "FileTimerServer", "ProcessFailure", "RunLogs", "StdioSpec", "TimerRequest",
           "WorkerAssignment", "adopt_worker", "check_encrypt_conf", "check_layout", "copy_root_cause_error_file",
           "die_with_parent", "elastic_entry_point", "encrypt_requested", "entrypoint_name", "format_failure_report",
           "inherit_only", "node_devices", "parse_args", "preflight", "role_ranks", "signal_name", "slot_env",
           "spawn_worker", "stop_workers", "visible_devices", "worker_argv", "worker_env"]
