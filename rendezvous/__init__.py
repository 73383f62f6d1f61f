"""etcd v3 rendezvous for tpassrun.

Layout: ``config`` (EtcdConfig, RendezvousSettings), ``state`` (the data and its versioned JSON),
``machine`` (pure decisions), ``lease`` (pure: when the lease is surely alive), ``etcd_link`` (the etcd
connection and its reconnects), ``etcd_io`` (the only module that sends etcd requests), ``guard`` (the run's seal on
the rendezvous's records, injected: ``RecordGuard``), ``handler`` (EtcdRendezvous: effects around the machine) with
``leading`` (its leader half), ``embedded`` (a throw-away etcd server).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the submodule that defines it, imported on first use: the launcher's command-line checks use the endpoint
# grammar (``config.split_endpoint``) without paying for aetcd and gRPC
_EXPORTS = {
    **dict.fromkeys(("DEFAULT_PREFIX", "ETCD_PASSWORD_ENV", "EtcdConfig", "RendezvousSettings", "read_private_file",
                     "refuse_inline_secrets", "split_endpoint"), ".config"),
    **dict.fromkeys(("EmbeddedEtcd", "ServerTls", "find_etcd_binary", "host_etcd_if_absent", "pid_alive"),
                    ".embedded"),
    **dict.fromkeys(("RendezvousClosedError", "RendezvousConnectionError", "RendezvousError", "RendezvousKeyError",
                     "RendezvousTimeoutError"), ".errors"),
    **dict.fromkeys(("EtcdStore", "LeaseIs", "WatchEvent", "encode_value"), ".etcd_io"),
    **dict.fromkeys(("EtcdConnection", "Link", "one_line"), ".etcd_link"),
    "RecordGuard": ".guard",
    "EtcdRendezvous": ".handler",
    **dict.fromkeys(("Bootstrap", "Closed", "EventKind", "GenState", "Generation", "Leader", "Member", "NodeInfo",
                     "RdzvEvent"), ".state"),
}

if TYPE_CHECKING:
    from .config import (
        DEFAULT_PREFIX,
        ETCD_PASSWORD_ENV,
        EtcdConfig,
        RendezvousSettings,
        read_private_file,
        refuse_inline_secrets,
        split_endpoint,
    )
    from .embedded import EmbeddedEtcd, ServerTls, find_etcd_binary, host_etcd_if_absent, pid_alive
    from .errors import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousError,
        RendezvousKeyError,
        RendezvousTimeoutError,
    )
    from .etcd_io import EtcdStore, LeaseIs, WatchEvent, encode_value
    from .etcd_link import EtcdConnection, Link, one_line
    from .guard import RecordGuard
    from .handler import EtcdRendezvous
    from .state import Bootstrap, Closed, EventKind, Generation, GenState, Leader, Member, NodeInfo, RdzvEvent


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "DEFAULT_PREFIX",
    "LeaseIs",
    "encode_value",
    "EmbeddedEtcd",
    "ServerTls",
    "host_etcd_if_absent",
    "pid_alive",
    "EtcdConfig",
    "EtcdConnection",
    "EtcdRendezvous",
    "EtcdStore",
    "Bootstrap",
    "Closed",
    "EventKind",
    "GenState",
    "Generation",
    "Leader",
    "Member",
    "NodeInfo",
    "RdzvEvent",
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousKeyError",
    "RecordGuard",
    "RendezvousSettings",
    "RendezvousTimeoutError",
    "WatchEvent",
    "Link",
    "one_line",
    "find_etcd_binary",
    "ETCD_PASSWORD_ENV",
    "refuse_inline_secrets",
    "read_private_file",
    "split_endpoint",
]
