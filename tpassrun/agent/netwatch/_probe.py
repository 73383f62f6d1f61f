"""What the kernel already knows about this host's link, read without sending anything.

* the interface toward etcd: its operstate and carrier-down counter (``/sys/class/net``);
* per remote address, the bytes this host sent and sent again (``ss -tin``: ``bytes_sent``, ``bytes_retrans`` of
  every established connection): what is lost on the way *to* a node shows in what its peers send it again;
* per remote address, the share of the time its busiest connection had data waiting to be sent or acknowledged
  (``busy`` less ``rwnd_limited``: the kernel's ``tcpi_busy_time``, less the time the *receiver* held it back): a
  link at its rate limit keeps its sender's queue full (busy ~90% of the time at 20 mbit/s against 3-10% healthy);
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
_BUSY = re.compile(r"\bbusy:(\d+)ms")
_RWND = re.compile(r"\brwnd_limited:(\d+)ms")

Conn = tuple[str, str]     # (local address:port, remote address:port) of one connection


def _peer_addr(header: str) -> str | None:
    cols = header.split()
    if len(cols) < 4:
        return None
    host = cols[3].rsplit(":", 1)[0].strip("[]")
    return host[7:] if host.startswith("::ffff:") else host


def parse_conns(text: str) -> dict[Conn, tuple[str, int, int, int]]:
    """``ss -tinH`` output -> per connection: (remote address, bytes sent, bytes sent again, ms busy sending that the
    receiver did not hold back: ``busy`` less ``rwnd_limited``), each counted since the connection opened."""
    out: dict[Conn, tuple[str, int, int, int]] = {}
    lines = text.splitlines()
    for header, info in zip(lines[::2], lines[1::2]):
        addr = _peer_addr(header)
        sent, again = _SENT.search(info), _AGAIN.search(info)
        cols = header.split()
        if addr is None or sent is None:
            continue
        busy, rwnd = _BUSY.search(info), _RWND.search(info)
        held = int(busy.group(1)) - (int(rwnd.group(1)) if rwnd else 0) if busy else 0
        out[(cols[2], cols[3])] = (addr, int(sent.group(1)), int(again.group(1)) if again else 0, max(0, held))
    return out


def conns() -> dict[Conn, tuple[str, int, int, int]]:
    """This host's established TCP connections now (``parse_conns``)."""
    try:
        text = subprocess.run(["ss", "-tinH", "state", "established"], capture_output=True, text=True,
                              timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return parse_conns(text)


def conn_delta(before: dict[Conn, tuple[str, int, int, int]], after: dict[Conn, tuple[str, int, int, int]],
               span_ms: float) -> tuple[dict[str, tuple[int, int]], dict[str, float]]:
    """Between two readings ``span_ms`` apart: per remote address (bytes sent, sent again), summed over its
    connections, and the busy share (0-1) of its busiest connection. A connection opened or closed in between is left
    out (what it did before opening within the interval is not known)."""
    sent: dict[str, tuple[int, int]] = {}
    busy: dict[str, float] = {}
    for key, (addr, s1, a1, b1) in after.items():
        _addr, s0, a0, b0 = before.get(key, (addr, 0, 0, 0))
        if key not in before or s1 < s0 or a1 < a0 or b1 < b0 or s1 == s0:
            continue
        t0, r0 = sent.get(addr, (0, 0))
        sent[addr] = (t0 + s1 - s0, r0 + a1 - a0)
        if span_ms > 0:
            busy[addr] = max(busy.get(addr, 0.0), min(1.0, (b1 - b0) / span_ms))
    return sent, busy


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
