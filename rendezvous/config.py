"""Typed configuration: where etcd is (``EtcdConfig``) and how the rendezvous behaves (``RendezvousSettings``).

Both are built from torchrun's flags: ``--rdzv-endpoint`` and ``--rdzv-conf k=v,...`` (values arrive as
strings). Unknown ``--rdzv-conf`` keys are ignored here because the conf is shared with other layers.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Mapping

from tpassrun.schema import Record

from .errors import RendezvousError

DEFAULT_ETCD_PORT = 2379
DEFAULT_PREFIX = "/tpassrun/v1"
# Where a password may come from instead of the command line (spelled here: rendezvous must not import tpassrun).
ETCD_PASSWORD_ENV = "TPASSRUN_ETCD_PASSWORD"
# secret -> how to give it instead (the run key seals swap records: tpassrun/records/provenance.py)
_SECRET_KEYS = {"password": f"password_file=PATH (a file only you can read) or ${ETCD_PASSWORD_ENV}",
                "run_key": "run_key_file=PATH (a file only you can read) or $TPASSRUN_RUN_KEY"}


def refuse_inline_secrets(conf: Mapping[str, str]) -> None:
    """A password typed into ``--rdzv-conf`` is visible to every user in ``ps``: refuse it, naming the ways
    that are not (a 0600 file, or the environment)."""
    for key, instead in _SECRET_KEYS.items():
        if conf.get(key):
            raise RendezvousError(f"--rdzv-conf {key}=... would be visible to every user in `ps`: use {instead}")


def read_private_file(path: str, what: str) -> str:
    """The content of a secret file, refused unless only its owner can read it (like ssh does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise RendezvousError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "r") as fh:
        info = os.fstat(fh.fileno())
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise RendezvousError(f"the {what} {path} is readable by others (mode {stat.S_IMODE(info.st_mode):o}): "
                                  f"chmod 600 it")
        return fh.read()


@dataclass(frozen=True)
class Credentials(Record):
    """The etcd credentials file a tpassrun-hosted etcd writes (0600) and ``credentials_file`` reads."""

    user: str
    password: str


def _credentials(conf: Mapping[str, str], environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(user, password) from, in order: ``credentials_file`` (JSON, what a tpassrun-hosted etcd writes),
    ``password_file``, the inline ``password`` (in-process callers only; the CLI refuses it), ``$TPASSRUN_ETCD_PASSWORD``."""
    user = conf.get("user") or conf.get("username") or None
    path = conf.get("credentials_file")
    if path:
        try:
            creds = Credentials.from_json(json.loads(read_private_file(path, "etcd credentials file")))
        except ValueError:      # not JSON, or a SchemaError
            raise RendezvousError(f"the etcd credentials file {path} is not {{\"user\": ..., \"password\": ...}}") from None
        return creds.user, creds.password
    if conf.get("password_file"):
        lines = read_private_file(conf["password_file"], "etcd password file").splitlines()
        return user, (lines[0] if lines else "")
    password = conf.get("password") or (environ.get(ETCD_PASSWORD_ENV) if user else None) or None
    return user, password


def _float(conf: Mapping[str, str], key: str, default: float) -> float:
    raw = conf.get(key)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise RendezvousError(f"--rdzv-conf {key}={raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise RendezvousError(f"--rdzv-conf {key}={raw!r} must be a positive number")
    return value


_HOSTNAME = re.compile(r"^[\w.-]+$")   # torchrun's rule for a host name or IPv4 address (IPv6: in brackets)
SCHEMES = ("http", "https")


def _ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def split_endpoint(item: str, *, schemes: bool = True, min_port: int = 1) -> tuple[str | None, str, int | None]:
    """One member of an endpoint list, strictly: ``[scheme://]host[:port]`` -> ``(scheme, host, port)`` (``None``:
    not given). ``host``: a name or IPv4 address, or an IPv6 address in brackets (``[::1]:2379``; unbracketed only
    as torchrun reads it, ``<v6>:<port>``); ``port``: digits, ``min_port``..65535. ``ValueError`` with the reason
    otherwise: a malformed endpoint is an error at once, never a connection attempt."""
    text, scheme = item.strip(), None
    if "://" in text:
        scheme, _, text = text.partition("://")
        scheme = scheme.lower()
        if not schemes or scheme not in SCHEMES:
            raise ValueError(f"scheme {scheme!r}: only http:// or https:// (etcd) may come before the host")
        text = text.removesuffix("/")
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed:
            raise ValueError("no closing ']' after the IPv6 address")
        if not _ipv6(host):
            raise ValueError(f"{host!r} in brackets is not an IPv6 address")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{rest!r} after the IPv6 address (expected ]:<port>)")
        port_text: str | None = rest[1:] if rest else None
    elif text.count(":") > 1:
        host, _, port_text = text.rpartition(":")
        if not _ipv6(host):
            raise ValueError("an IPv6 address goes in brackets: [<address>]:<port>")
    else:
        host, colon, port_text = text.partition(":")
        port_text = port_text if colon else None
        if not host:
            raise ValueError("the host is missing")
        if not _HOSTNAME.match(host):
            raise ValueError(f"{host!r} is not a host name or an IP address")
    if port_text is None:
        return scheme, host, None
    if not port_text:
        raise ValueError("the port after ':' is missing")
    if not (port_text.isascii() and port_text.isdigit()) or not min_port <= int(port_text) <= 65535:
        raise ValueError(f"the port {port_text!r} is not an integer in {min_port}..65535")
    return scheme, host, int(port_text)


def join_host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 address in brackets (what gRPC and users read)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd.

    ``read_timeout`` bounds the first connection and every single request; ``reconnect_timeout`` bounds how
    long an outage may last mid-run before the rendezvous gives up with ``RendezvousConnectionError``.
    """

    endpoints: tuple[tuple[str, int], ...]
    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    read_timeout: float = 60.0
    reconnect_timeout: float = 30.0
    prefix: str | None = None  # --rdzv-conf etcd_prefix, if given

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise RendezvousError("no etcd endpoint given")
        if self.protocol not in ("http", "https"):
            raise RendezvousError(f"etcd protocol must be http or https, not {self.protocol!r}")
        if (self.user is None) != (self.password is None):
            raise RendezvousError("etcd user and password must be given together")
        if (self.cert is None) != (self.key is None):
            raise RendezvousError("etcd client cert and key must be given together")

    @property
    def tls(self) -> bool:
        return self.protocol == "https" or self.cacert is not None or self.cert is not None

    @property
    def display(self) -> str:
        """The endpoints as a user typed them, for error messages."""
        return ",".join(join_host_port(h, p) for h, p in self.endpoints)

    @classmethod
    def from_endpoint(cls, endpoint: str, conf: Mapping[str, str] | None = None) -> "EtcdConfig":
        """Parse ``host[:port][,host[:port]...]`` (each optionally with ``http://``/``https://``; the members of
        one etcd cluster: the connection fails over between them) plus ``--rdzv-conf``."""
        conf = conf or {}
        protocol = conf.get("protocol", "").strip().lower() or None
        endpoints: list[tuple[str, int]] = []
        for item in endpoint.split(","):
            if not item.strip():
                continue
            try:
                scheme, host, port = split_endpoint(item)
            except ValueError as exc:
                raise RendezvousError(f"bad etcd endpoint {item.strip()!r}: {exc}") from None
            if scheme is not None:
                if protocol is not None and protocol != scheme:
                    raise RendezvousError(f"etcd endpoint scheme {scheme!r} contradicts protocol={protocol!r}")
                protocol = scheme
            endpoints.append((host, DEFAULT_ETCD_PORT if port is None else port))
        user, password = _credentials(conf, os.environ)
        read_timeout = _float(conf, "read_timeout", 60.0)
        return cls(
            endpoints=tuple(endpoints),
            protocol=protocol or "http",
            cacert=conf.get("cacert") or conf.get("ca_cert") or None,
            cert=conf.get("cert") or conf.get("ssl_cert") or None,
            key=conf.get("key") or conf.get("ssl_cert_key") or None,
            user=user,
            password=password,
            read_timeout=read_timeout,
            reconnect_timeout=_float(conf, "reconnect_timeout", max(30.0, read_timeout)),
            prefix=conf.get("etcd_prefix") or None,
        )


@dataclass(frozen=True)
class RendezvousSettings:
    """How one run's rendezvous behaves. Times are seconds."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    close_timeout: float = 30.0
    lease_ttl: float = 10.0  # node liveness; the keepalive runs every ttl/10 (rendezvous.lease: when to fence)
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise RendezvousError(f"bad run id {self.run_id!r}: must be non-empty and contain no '/'")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise RendezvousError(f"need 1 <= min_nodes <= max_nodes, got {self.min_nodes}:{self.max_nodes}")
        if self.lease_ttl < 1:
            raise RendezvousError(f"lease_ttl must be at least 1 s, got {self.lease_ttl}")
        if self.join_timeout <= 0 or self.last_call_timeout < 0 or self.close_timeout <= 0:
            raise RendezvousError("join_timeout and close_timeout must be > 0, last_call_timeout >= 0")

    @property
    def lease_seconds(self) -> int:
        """etcd leases are whole seconds (and etcd rounds tiny ones up to its minimum)."""
        return max(1, math.ceil(self.lease_ttl))

    @property
    def run_prefix(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.run_id}/"

    @classmethod
    def from_conf(
        cls, run_id: str, min_nodes: int, max_nodes: int, conf: Mapping[str, str] | None = None
    ) -> "RendezvousSettings":
        """Read the ``--rdzv-conf`` keys that concern the rendezvous.

        ``lease_ttl`` wins; else torchrun's ``keep_alive_interval * keep_alive_max_attempt`` (how long
        torchrun lets a silent node stay in the round); else ``heartbeat_timeout``. ``join_timeout`` wins
        over ``timeout`` (the legacy etcd handler's name for it; torchrun always passes ``timeout=900``).
        """
        conf = conf or {}
        if "lease_ttl" in conf:
            lease_ttl = _float(conf, "lease_ttl", 10.0)
        elif "keep_alive_interval" in conf or "keep_alive_max_attempt" in conf:
            lease_ttl = _float(conf, "keep_alive_interval", 5.0) * _float(conf, "keep_alive_max_attempt", 3.0)
        elif "heartbeat_timeout" in conf:
            lease_ttl = _float(conf, "heartbeat_timeout", 10.0)
        else:
            lease_ttl = 10.0
        if "join_timeout" in conf:
            join_timeout = _float(conf, "join_timeout", 600.0)
        else:
            join_timeout = _float(conf, "timeout", 600.0)
        last_call = conf.get("last_call_timeout")
        try:
            last_call_timeout = 30.0 if last_call in (None, "") else float(last_call)
        except ValueError:
            raise RendezvousError(f"--rdzv-conf last_call_timeout={last_call!r} is not a number") from None
        return cls(
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            join_timeout=join_timeout,
            last_call_timeout=last_call_timeout,
            close_timeout=_float(conf, "close_timeout", 30.0),
            lease_ttl=lease_ttl,
            prefix=conf.get("etcd_prefix") or DEFAULT_PREFIX,
        )
