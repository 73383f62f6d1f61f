"""The workers' store, locked down (issue 27 item 2): one port on the advertised address, an authenticated door
for tpassrun's workers and a plain door (relayed to a loopback-only TCPStore) for torchrun's contract.

What the rest of tpassrun uses:

* :func:`derive_store_key` (torch-free): the run's store key, from the mirror key every agent shares;
* :class:`StoreServer`, :func:`serve` (the store process, :mod:`tpassrun.launch.storeserver`);
* :func:`connect` (workers): an :class:`AuthStore` when the worker was given the key, else the plain TCPStore
  torchrun's workers use;
* :func:`bind_host` (pure): where a store listens (loopback for a single node, else the advertised address).

``docs/security-store.md`` says what is protected and what is not. Importing this package does not import torch.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any

from tpassrun.settings import envnames as E
from tpassrun.store.wire import MAGIC, derive_store_key

__all__ = ["MAGIC", "bind_host", "connect", "derive_store_key", "key_from_env", "serve"]


def key_from_env(environ: Any = None) -> bytes | None:
    text = (os.environ if environ is None else environ).get(E.TPASSRUN_STORE_KEY, "")
    try:
        key = bytes.fromhex(text)
    except ValueError:
        return None
    return key if len(key) >= 16 else None


def connect(host: str, port: int, timeout: timedelta, key: bytes | None = None) -> Any:
    """The store a worker forms a world with: authenticated with ``key`` (default: the one its agent gave it),
    else torch's plain TCPStore client (a worker launched without a key: never worse than torchrun)."""
    key = key if key is not None else key_from_env()
    if key is None:
        import torch.distributed as dist

        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    from tpassrun.store.client import AuthStore

    return AuthStore(host, int(port), key, timeout)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind_host(advertised: str, single_node: bool, named: bool = True) -> str:
    """Where the workers' store listens (pure, but for one name lookup): a single node's on loopback (what
    ``advertised`` resolves to when that is a loopback address, else 127.0.0.1); a job of several nodes' on the
    address ``advertised`` resolves to (its peers connect there). One exception: a host name nobody chose
    (``named`` False: the FQDN default, no ``--local-addr``) that resolves here to loopback only (127.0.1.1 in
    Debian's /etc/hosts) while the other nodes resolve it to this node's real address: every interface then,
    as torchrun (the authenticated door still keeps tpassrun's worlds to the key holders)."""
    if single_node:   # an IPv4 loopback address the name has (127.0.1.1 on Debian), else 127.0.0.1
        v4 = _resolve(advertised, socket.AF_INET)
        return v4 if v4 and is_loopback(v4) else "127.0.0.1"
    resolved = _resolve(advertised, socket.AF_UNSPEC)
    if not named and (not resolved or is_loopback(resolved)):
        return "::" if socket.has_ipv6 and _resolve("::", socket.AF_INET6) else "0.0.0.0"
    return resolved or advertised


def _resolve(name: str, family: int) -> str:
    try:
        return str(socket.getaddrinfo(name, None, family, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return ""


def serve(host: str, port: int, key: bytes, *, plain: bool = True, plain_on_demand: bool = False) -> Any:
    from tpassrun.store.server import StoreServer

    server = StoreServer(host, port, key, plain=plain, plain_on_demand=plain_on_demand)
    server.start()
    return server
