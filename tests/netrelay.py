"""A userspace delay relay for one host's link (tests and benches; root only).

This kernel has no ``netem``: added delay needs a program that holds each frame for a while. :class:`DelayRelay`
takes host ``i`` of a :class:`faults.NetLab` off its bridge and puts this relay between them: an L2 forwarder on
two raw sockets (``AF_PACKET``) that sends every frame on after ``delay_ms``, both ways, so everything on that
link (etcd, gloo, the agents' own traffic) takes the delay, as behind a slow hop. Offloads are turned off on the
relayed interfaces (frames stay within the MTU). ``close`` puts the link back as it was.

    python tests/netrelay.py DEV_A DEV_B DELAY_MS      # the forwarder itself (what DelayRelay runs)
"""

from __future__ import annotations

import heapq
import os
import select
import signal
import socket
import subprocess
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4


def forward(dev_a: str, dev_b: str, delay_s: float) -> None:
    socks = {}
    for dev in (dev_a, dev_b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((dev, 0))
        s.setblocking(False)
        socks[dev] = s
    other = {socks[dev_a]: socks[dev_b], socks[dev_b]: socks[dev_a]}
    held: list[tuple[float, int, socket.socket, bytes]] = []
    n = 0
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 1.0
        ready, _, _ = select.select(list(other), [], [], timeout)
        for s in ready:
            while True:
                try:
                    frame, addr = s.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING:     # what we sent ourselves on this interface
                    continue
                n += 1
                heapq.heappush(held, (time.monotonic() + delay_s, n, other[s], frame))
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, dst, frame = heapq.heappop(held)
            try:
                dst.send(frame)
            except OSError:
                pass


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def pump(src: socket.socket, dst: socket.socket, record=None) -> None:  # type: ignore[no-untyped-def]
    """Forward what ``src`` sends to ``dst`` until either side closes or fails (``record``, if given, sees every
    chunk: a capture for tests looking for plaintext on the wire), then shut both down."""
    try:
        while data := src.recv(1 << 16):
            if record is not None:
                record(data)
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class DelayRelay:
    """``delay_ms`` added each way on host ``i``'s link of ``lab`` until :meth:`close`."""

    def __init__(self, lab, i: int, delay_ms: float) -> None:  # type: ignore[no-untyped-def]
        self.lab, self.i = lab, i
        ns, outer, inner, _addr = lab.hosts[i]
        self.outer, self.a, self.b = outer, f"tp{lab.tag}r{i}", f"tp{lab.tag}b{i}"
        _run("ip", "link", "add", self.a, "type", "veth", "peer", "name", self.b)
        for dev in (self.a, self.b, outer):
            subprocess.run(["ethtool", "-K", dev, "tso", "off", "gso", "off", "gro", "off", "tx", "off"],
                           capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", inner, "tso", "off", "gso", "off", "gro", "off",
                        "tx", "off"], capture_output=True, timeout=30)
        _run("ip", "link", "set", self.b, "master", lab.bridge)
        for dev in (self.a, self.b):
            _run("ip", "link", "set", dev, "up")
        _run("ip", "link", "set", outer, "nomaster")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), outer, self.a, str(delay_ms)],
                                     start_new_session=True)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        subprocess.run(["ip", "link", "set", self.outer, "master", self.lab.bridge], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.a], capture_output=True, timeout=30)


def lossy(lab, i: int, probability: float) -> None:  # type: ignore[no-untyped-def]
    """Random loss of ``probability`` on everything host ``i`` receives on its link (iptables' statistic match in its
    netns, ``-i <its veth>``: its loopback traffic is left alone, as a lossy link would).

    INPUT, not OUTPUT: a packet OUTPUT drops never left, and the local TCP stack is told so at once and sends it
    again without any timeout (no retransmission counted, hardly a slowdown): not what a lossy link does. One
    dropped on the way in is lost as on a wire: its sender finds out by the missing ACK."""
    _run(*lab.argv(i), "iptables", *_loss_rule("-A", lab.hosts[i][2], probability))


def _loss_rule(op: str, dev: str, probability: float) -> list[str]:
    return [op, "INPUT", "-i", dev, "-m", "statistic", "--mode", "random", "--probability", str(probability), "-j",
            "DROP"]


def unlossy(lab, i: int, probability: float) -> None:  # type: ignore[no-untyped-def]
    """Remove ``lossy``'s rule (by its spec: nothing else in the chain is touched)."""
    subprocess.run([*lab.argv(i), "iptables", *_loss_rule("-D", lab.hosts[i][2], probability)], capture_output=True,
                   timeout=30)


def _table(lab, i: int) -> str:  # type: ignore[no-untyped-def]
    return f"tp{lab.tag}loss{i}"


def lossy_both_ways(lab, i: int, probability: float) -> None:  # type: ignore[no-untyped-def]
    """Random loss of ``probability`` on host ``i``'s link, both ways: frames to and from its veth dropped on the
    bridge (an nftables table of the bridge family in the root namespace, named for this lab and host, matching
    that veth only), so what the host sends is lost on the wire too. (iptables OUTPUT in the host would not do:
    see ``lossy``.) ``unlossy_both_ways`` deletes the table."""
    outer, table = lab.hosts[i][1], _table(lab, i)
    per_mille = str(max(1, round(probability * 1000)))
    _run("nft", "add", "table", "bridge", table)
    for chain, hook in (("cf", "forward"), ("ci", "input"), ("co", "output")):
        _run("nft", "add", "chain", "bridge", table, chain, f"{{ type filter hook {hook} priority 0 ; }}")
    for chain, match in (("cf", "iifname"), ("cf", "oifname"), ("ci", "iifname"), ("co", "oifname")):
        _run("nft", "add", "rule", "bridge", table, chain, match, outer, "numgen", "random", "mod", "1000", "<",
             per_mille, "drop")


def unlossy_both_ways(lab, i: int) -> None:  # type: ignore[no-untyped-def]
    subprocess.run(["nft", "delete", "table", "bridge", _table(lab, i)], capture_output=True, timeout=30)


def rate_limit(lab, i: int, rate: str) -> None:  # type: ignore[no-untyped-def]
    """What host ``i`` sends goes out at ``rate`` at most (tbf on its own end of the link)."""
    _run(*lab.argv(i), "tc", "qdisc", "add", "dev", lab.hosts[i][2], "root", "tbf", "rate", rate, "burst", "32kbit",
         "latency", "400ms")


def unlimit(lab, i: int) -> None:  # type: ignore[no-untyped-def]
    subprocess.run([*lab.argv(i), "tc", "qdisc", "del", "dev", lab.hosts[i][2], "root"], capture_output=True,
                   timeout=30)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    forward(sys.argv[1], sys.argv[2], float(sys.argv[3]) / 1000.0)
