"""What the kernel already knows about this host's link, read without sending anything.

* the interface toward etcd: its operstate and carrier-down counter (``/sys/class/net``);
* the share of TCP segments sent again (``/proc/net/snmp``: ``RetransSegs`` / ``OutSegs``, host-wide, i.e. the
  agent's network namespace);
* the smoothed RTT of this host's established connections to etcd (``ss -tin``: sock_diag, the kernel's own
  per-socket figures; the agent's etcd client keeps such a connection open all the time).
"""

from __future__ import annotations

import re
import statistics
import subprocess
from dataclasses import dataclass

_RTT = re.compile(r"\brtt:([0-9.]+)/")


def route_dev(addr: str) -> str | None:
    """The interface the kernel sends to ``addr`` through (None: no route, no iproute2)."""
    try:
        out = subprocess.run(["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    words = out.split()
    return words[words.index("dev") + 1] if "dev" in words[:-1] else None


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class IfaceState:
    up: bool
    downs: int          # carrier_down_count (a flap between two samples shows as a change)


def iface_state(dev: str) -> IfaceState | None:
    state = _read(f"/sys/class/net/{dev}/operstate")
    if state is None:
        return None
    downs = _read(f"/sys/class/net/{dev}/carrier_down_count")
    # veths and most NICs say "up"; "unknown" is what interfaces without carrier reporting say (lo, tun)
    return IfaceState(state in ("up", "unknown"), int(downs) if downs and downs.isdigit() else 0)


def tcp_counters() -> tuple[int, int] | None:
    """(OutSegs, RetransSegs) of this network namespace."""
    text = _read("/proc/net/snmp")
    if text is None:
        return None
    rows = [line.split()[1:] for line in text.splitlines() if line.startswith("Tcp:")]
    if len(rows) < 2:
        return None
    tcp = dict(zip(rows[0], rows[1]))
    try:
        return int(tcp["OutSegs"]), int(tcp["RetransSegs"])
    except (KeyError, ValueError):
        return None


def retrans_pct(before: tuple[int, int] | None, after: tuple[int, int] | None, min_segs: int = 50) -> float | None:
    """Percent of segments sent again between two readings (None: too few segments to say)."""
    if before is None or after is None:
        return None
    out, again = after[0] - before[0], after[1] - before[1]
    if out < min_segs or again < 0:
        return None
    return 100.0 * again / out


def rtt_ms(addr: str, port: int) -> float | None:
    """Median smoothed RTT (ms) of this host's established TCP connections to ``addr:port``."""
    host = f"[{addr}]" if ":" in addr else addr
    try:
        out = subprocess.run(["ss", "-tinH", "state", "established", "dst", f"{host}:{port}"], capture_output=True,
                             text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rtts = [float(m.group(1)) for m in _RTT.finditer(out)]
    return statistics.median(rtts) if rtts else None
