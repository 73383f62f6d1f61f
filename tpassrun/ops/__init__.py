"""tpassrun.ops: what the operator sees. Console lines and summary (``console``), the event log (``events``),
progress (``progress``), metrics (``metrics``), ``tpassctl`` (``ctl``), the live view (``tui``, ``tui_panel``),
the run registry (``registry``), clean text (``cleantext``).

The door imports what it names on first use (``metrics`` imports prometheus_client, the live view rich).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpassrun.ops.cleantext import clean
    from tpassrun.ops.console import WAITING_EVERY_S, ConsoleReporter, GlogFormatter
    from tpassrun.ops.ctl import read_snapshot
    from tpassrun.ops.events import EventLog
    from tpassrun.ops.metrics import serve_metrics
    from tpassrun.ops.progress import Progress, RankPosition
    from tpassrun.ops.registry import register_run
    from tpassrun.ops.tui_panel import run_panel
    from tpassrun.ops.waiting import WaitNote

# name -> the module that defines it
_LAZY = {
    "clean": "tpassrun.ops.cleantext",
    **dict.fromkeys(("WAITING_EVERY_S", "ConsoleReporter", "GlogFormatter"), "tpassrun.ops.console"),
    "read_snapshot": "tpassrun.ops.ctl",
    "EventLog": "tpassrun.ops.events",
    "serve_metrics": "tpassrun.ops.metrics",
    **dict.fromkeys(("Progress", "RankPosition"), "tpassrun.ops.progress"),
    "register_run": "tpassrun.ops.registry",
    "run_panel": "tpassrun.ops.tui_panel",
    "WaitNote": "tpassrun.ops.waiting",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["WAITING_EVERY_S", "ConsoleReporter", "EventLog", "GlogFormatter", "Progress", "RankPosition", "WaitNote",
           "clean", "read_snapshot", "register_run", "run_panel", "serve_metrics"]
