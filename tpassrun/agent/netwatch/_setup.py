"""The multi-host setup checked at start: an advertised address the other hosts cannot reach is said once.

``loopback_warning`` is pure (the name's resolution is given); ``advertised_check`` does the one lookup.
"""

from __future__ import annotations

import ipaddress
import socket


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return addr == "localhost"


def loopback_warning(advertised: str, resolved: str | None, max_nodes: int) -> str | None:
    """One console line when a job of several nodes advertises this node at an address that is loopback here (a
    host name that resolves to 127.0.x.x, as Debian's /etc/hosts maps the host's own name): the other hosts cannot
    reach this node's store, mirror or gloo's sockets there. None when that is fine."""
    if max_nodes <= 1 or not (_is_loopback(advertised) or (resolved is not None and _is_loopback(resolved))):
        return None
    where = advertised if resolved in (None, advertised) else f"{advertised} ({resolved})"
    return (f"this node's address {where} is loopback while --nnodes allows {max_nodes} nodes: other hosts cannot "
            "reach it there; pass --local-addr with an address they reach and set GLOO_SOCKET_IFNAME (NCCL: "
            "NCCL_SOCKET_IFNAME) to its interface (docs/network.md, several hosts)")


def advertised_check(advertised: str, max_nodes: int) -> str | None:
    """``loopback_warning`` for this host: ``advertised`` resolved here (the first address it has)."""
    if max_nodes <= 1:
        return None
    try:
        resolved: str | None = str(socket.getaddrinfo(advertised, None, socket.AF_UNSPEC, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        resolved = None
    return loopback_warning(advertised, resolved, max_nodes)
