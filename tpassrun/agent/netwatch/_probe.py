"""What the kernel already knows about this host's link, read without sending anything.

* the interface toward etcd: its operstate and carrier-down counter (``/sys/class/net``);
* per remote address, the bytes this host sent and sent again (``ss -tin``: ``bytes_sent``, ``bytes_retrans`` of
  every established connection): what is lost on the way *to* a node shows in what its peers send it again;
* the smoothed RTT of this host's established connections to etcd (``ss -tin``: sock_diag, the kernel's own
  per-socket figures; the agent's etcd client keeps such a connection open all the time).
"""

from __future__ import annotations

import re
import statistics
import subprocess
from dataclasses import dataclass

_RTT = re.compile(r"\brtt:([0-9.]+)/")


def route(addr: str) -> tuple[str | None, str | None]:
    """(interface, source address) the kernel sends to ``addr`` with (None: no route, no iproute2)."""
    try:
        out = subprocess.run(["ip", "-o", "route", "get", addr], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None, None
    words = out.split()

    def after(word: str) -> str | None:
        return words[words.index(word) + 1] if word in words[:-1] else None

    return after("dev"), after("src")


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


_SENT = re.compile(r"\bbytes_sent:(\d+)")
_AGAIN = re.compile(r"\bbytes_retrans:(\d+)")


def _peer_addr(header: str) -> str | None:
    cols = header.split()
    if len(cols) < 4:
        return None
    host = cols[3].rsplit(":", 1)[0].strip("[]")
    return host[7:] if host.startswith("::ffff:") else host


def parse_sent(text: str) -> dict[str, tuple[int, int]]:
    """``ss -tinH`` output -> remote address -> (bytes sent, bytes sent again), summed over its connections."""
    out: dict[str, tuple[int, int]] = {}
    lines = text.splitlines()
    for header, info in zip(lines[::2], lines[1::2]):
        addr = _peer_addr(header)
        sent, again = _SENT.search(info), _AGAIN.search(info)
        if addr is None or sent is None:
            continue
        before = out.get(addr, (0, 0))
        out[addr] = (before[0] + int(sent.group(1)), before[1] + (int(again.group(1)) if again else 0))
    return out


def sent_by_peer() -> dict[str, tuple[int, int]]:
    """Remote address -> (bytes sent, bytes sent again) of this host's established TCP connections, now."""
    try:
        text = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True,
                              timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_sent(text)


def sent_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """What was sent (and sent again) to each address between two readings. A connection that closed meanwhile
    makes a sum go down: that address's figures start over (no negative amounts)."""
    out = {}
    for addr, (sent, again) in after.items():
        s0, a0 = before.get(addr, (0, 0))
        if sent >= s0 and again >= a0 and sent > s0:
            out[addr] = (sent - s0, again - a0)
    return out


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
