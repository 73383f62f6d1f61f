"""``tpassrun --tui``: the live view as a panel at the bottom of the launcher's terminal, under the workers'
scrolling output.

Workers keep writing straight to the terminal (no pipe through the agent, so no cost per line or per step):
the panel sets the terminal's scroll region (DECSTBM) to the lines above it, so their output scrolls there,
and redraws the bottom lines once a second from the run's status in etcd (one range read per second by the
agent; workers do nothing for it). Each redraw is one ``write()`` that saves the cursor, draws and restores
it, so it never lands in the middle of a worker's line. On exit the scroll region is reset.

Off by default: a torchrun command line prints what torchrun prints. ``--tui`` turns it on when stdout is a
terminal (``--tui`` on a pipe is ignored with a warning).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import time
from typing import Any, Awaitable, Callable

from rich.console import Console

from tpassrun.ops.tui import render_status

log = logging.getLogger(__name__)

__all__ = ["panel_height", "panel_bytes", "run_panel"]

SAVE, RESTORE = "\x1b7", "\x1b8"


def panel_height(rows: int) -> int:
    """Lines given to the panel on a terminal of ``rows`` lines: a third, at least 6, leaving workers >= 5."""
    return max(0, min(max(6, rows // 3), rows - 5))


def panel_bytes(doc: dict[str, Any], columns: int, rows: int, now: float, *, color: bool = True) -> bytes:
    """The escape sequence that (re)draws the panel in the bottom ``panel_height(rows)`` lines (pure); without
    ``color`` (``NO_COLOR``) only cursor movements, no colour or style."""
    height = panel_height(rows)
    if height == 0:
        return b""
    console = Console(file=io.StringIO(), width=columns, height=height, force_terminal=True,
                      color_system="standard" if color else None, no_color=not color, legacy_windows=False,
                      _environ={})
    with console.capture() as capture:
        console.print(render_status(doc, now=now, width=columns, height=height, keys=False))
    lines = capture.get().split("\n")[:height]
    top = rows - height + 1
    out = [SAVE, f"\x1b[1;{top - 1}r"]  # workers scroll in lines 1..top-1
    for i in range(height):
        out.append(f"\x1b[{top + i};1H\x1b[2K")
        if i < len(lines):
            out.append(lines[i])
    out.append(RESTORE)
    return "".join(out).encode()


async def run_panel(fetch: Callable[[], Awaitable[dict[str, Any]]], *, fd: int = 1, interval: float = 1.0,
                    clock: Callable[[], float] = time.time, color: bool = True) -> None:
    """Redraw the panel every ``interval`` seconds until cancelled; then give the terminal back."""
    if not os.isatty(fd):
        log.warning("--tui needs a terminal on stdout; running without the status panel")
        return
    drawn_rows = 0
    try:
        while True:
            try:
                columns, rows = os.get_terminal_size(fd)
                doc = await fetch()
                if rows != drawn_rows and drawn_rows:
                    os.write(fd, b"\x1b7\x1b[r\x1b8")   # resized: forget the old region first
                os.write(fd, panel_bytes(doc, columns, rows, clock(), color=color))
                drawn_rows = rows
            except (OSError, ValueError) as exc:
                log.debug("status panel: %s", exc)
            except Exception as exc:  # noqa: BLE001 - the panel must never take the agent down
                log.debug("status panel: cannot read the run's status: %s", exc)
            await asyncio.sleep(interval)
    finally:
        if drawn_rows:
            height = panel_height(drawn_rows)
            clear = "".join(f"\x1b[{drawn_rows - height + 1 + i};1H\x1b[2K" for i in range(height))
            try:
                # Reset the region, wipe the panel, and leave the cursor where workers' output continues.
                os.write(fd, f"{SAVE}\x1b[r{clear}{RESTORE}".encode())
            except OSError:
                pass
