"""``tpassctl events [--follow]``: a local run's event log, as the launcher's console lines (or raw JSON)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from tpassrun.ops.cleantext import clean
from tpassrun.ops.console import Describer, format_line, summary_lines
from tpassrun.ops.ctl_width import columns, wrap
from tpassrun.ops.registry import CtlError, RunEntry
from tpassrun.rendezvous import pid_alive

POLL_S = 0.2


def _line(d: Describer, ev: dict[str, Any], pid: int) -> list[str]:
    text = d.describe(ev)
    lines = summary_lines(d.tally, ev.get("code")) if ev.get("event") == "agent_exit" else ([text] if text else [])
    return [format_line(ev, x, pid, name=d.name) for x in lines]


def print_events(entry: RunEntry, *, follow: bool, raw: bool, out: Any = None) -> int:
    out = out or sys.stdout
    if not entry.event_log:
        raise CtlError(f"run {entry.run_id!r} keeps no event log (--log-dir {os.devnull})")
    try:
        fh = open(entry.event_log)
    except OSError as exc:
        raise CtlError(f"cannot read the event log of run {entry.run_id!r}: {exc}") from exc
    d = Describer()
    width = None if raw else columns(out)    # raw JSON lines stay whole
    partial = ""
    with fh:
        while True:
            chunk = fh.readline()
            if chunk:
                partial += chunk
                if not partial.endswith("\n"):
                    continue   # the launcher is writing this line right now
                line, partial = partial.strip(), ""
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                rows = [clean(line)] if raw else _line(d, ev, entry.pid)
                for r in rows:
                    out.write("\n".join(wrap(r, width)) + "\n")
                out.flush()
                continue
            if not follow or not pid_alive(entry.pid):
                return 0
            time.sleep(POLL_S)
