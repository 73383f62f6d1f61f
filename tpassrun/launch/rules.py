"""The pure resolution rules of a torchrun command line: node ranges, ``--nproc-per-node``, ``--rdzv-conf``,
endpoints and which etcd a run uses (see :mod:`tpassrun.launch.config`'s table). No argparse, no I/O but the CPU and
accelerator counts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from tpassrun.settings import C10D_DEFAULT_PORT, ETCD_DEFAULT_PORT, ConfigError
from tpassrun.settings import envnames as E


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4); needs 0 < MIN <= MAX."""
    parts = nnodes.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f'--nnodes={nnodes} is not in "N" or "MIN:MAX" format') from None
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes={nnodes}: need 0 < MIN <= MAX (got MIN={lo}, MAX={hi})")
    return lo, hi


def cpu_count() -> int:
    """CPUs this process may run on (``torch._utils.cpu_count`` without importing torch)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _accelerator_count(kind: str) -> int:
    """Device count for ``gpu``/``xpu``/``auto``/a privateuse1 name. Imports torch, so only on demand (the type
    checker does not follow torch: its counts are taken as ``int`` here)."""
    import torch  # lazy on purpose: the launcher must not pay for torch

    if kind == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("--nproc-per-node=gpu: Cuda is not available.")
        return int(torch.cuda.device_count())
    if kind == "xpu":
        if not torch.xpu.is_available():
            raise ConfigError("--nproc-per-node=xpu: Xpu is not available.")
        return int(torch.xpu.device_count())
    if kind == "auto":
        if torch.accelerator.is_available():
            return int(torch.accelerator.device_count())
        return cpu_count()
    if kind == torch._C._get_privateuse1_backend_name():
        mod = getattr(torch, kind)
        if not mod.is_available():
            raise ConfigError(f"--nproc-per-node={kind}: {kind} is not available.")
        return int(mod.device_count())
    raise ConfigError(f"Unsupported nproc_per_node value: {kind}")


def determine_local_world_size(value: str, accelerator_count: Callable[[str], int] = _accelerator_count) -> int:
    """``--nproc-per-node``: an int, ``cpu``, or an accelerator kind (``gpu``, ``xpu``, ``auto``, ...)."""
    try:
        return int(value)
    except ValueError:
        pass
    if value == "cpu":
        return cpu_count()
    return accelerator_count(value)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` like torchrun's ``_parse_rendezvous_config`` (empty values rejected)."""
    conf: dict[str, str] = {}
    text = text.strip()
    if not text:
        return conf
    for kv in text.split(","):
        key, *values = kv.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError("--rdzv-conf must be in format <key1>=<value1>,...,<keyN>=<valueN>.")
        value = values[0].strip() if values else ""
        if not value:
            raise ConfigError(f"--rdzv-conf: the rendezvous configuration option '{key}' must have a value specified.")
        conf[key] = value
    return conf


ETCD_BACKENDS = ("etcd", "etcd-v2")   # an etcd cluster's members: a comma-separated list


def check_endpoint(endpoint: str, backend: str) -> None:
    """torchrun's ``parse_rendezvous_endpoint``, stricter: a host name or IPv4 address, an IPv6 address in brackets,
    a port that is an integer in 0..65535, each member of an etcd backend's list (``host[:port],...``, with or
    without ``http://``/``https://``). An error at once, never a connection attempt that times out."""
    if not endpoint:
        return
    from tpassrun.rendezvous import split_endpoint  # the one endpoint grammar (not at import: tpassrun --help)

    members = endpoint.split(",") if backend in ETCD_BACKENDS else [endpoint]
    for member in members:
        try:
            split_endpoint(member, schemes=backend in ETCD_BACKENDS, min_port=1 if backend in ETCD_BACKENDS else 0)
        except ValueError as exc:
            which = f" (member {member.strip()!r})" if len(members) > 1 else ""
            shape = "<host>[:<port>][,<host>[:<port>]...]" if backend in ETCD_BACKENDS else "<host>[:<port>]"
            raise ConfigError(f"--rdzv-endpoint={endpoint}{which}: {exc} (expected {shape}, an IPv6 address "
                              "in brackets)") from None


def parse_local_ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise ConfigError(
            "--local_ranks_filter must be a comma-separated list of integers e.g. --local_ranks_filter=0,1,2"
        ) from None


def derived_omp(nproc_per_node: int, environ: Mapping[str, str]) -> str | None:
    """torchrun's rule: OMP_NUM_THREADS unset and more than one worker -> the launcher sets "1"."""
    if E.OMP_NUM_THREADS not in environ and nproc_per_node > 1:
        return "1"
    return None


def with_default_port(endpoint: str, default_port: int) -> str:
    """``host`` -> ``host:default``; ``host:port`` and ``[v6]:port`` kept as they are; each member of a
    comma-separated list alike."""
    if "," in endpoint:
        return ",".join(with_default_port(m, default_port) for m in endpoint.split(",") if m.strip())
    endpoint = endpoint.strip()
    if not endpoint:
        return endpoint
    if endpoint.startswith("["):
        return endpoint if "]:" in endpoint else f"{endpoint}:{default_port}"
    host, sep, port = endpoint.rstrip("/").rpartition(":")
    if sep and host and port.isdigit():
        return endpoint
    return f"{endpoint.rstrip('/')}:{default_port}"


def resolve_etcd_endpoint(backend: str, endpoint: str, max_nodes: int, standalone: bool) -> str | None:
    """Which etcd v3 server the run uses; ``None`` means the embedded private one. See module doc."""
    if standalone:
        return None
    if backend in ("etcd", "etcd-v2"):
        return with_default_port(endpoint or "localhost", ETCD_DEFAULT_PORT)
    if endpoint:
        endpoint = with_default_port(endpoint, C10D_DEFAULT_PORT if backend == "c10d" else ETCD_DEFAULT_PORT)
        if endpoint.rsplit(":", 1)[1] != "0":
            return endpoint
        # torchrun's `--rdzv-endpoint host:0` (what --standalone uses): the agent picks a free port for its
        # store, which no other node could find, so it is one node's private rendezvous: ours is the embedded
        # etcd on a free port.
        if max_nodes == 1:
            return None
        raise ConfigError(f"--rdzv-endpoint={endpoint} (port 0) cannot be shared by {max_nodes} nodes: "
                          "give a fixed port")
    if max_nodes == 1:
        return None
    raise ConfigError(
        f"--rdzv-backend={backend} with more than one node needs an etcd v3 server: "
        "pass --rdzv-endpoint=<host>:<port> of an etcd reachable from every node"
    )


def static_etcd_endpoint(endpoint: str) -> str:
    """Multi-node ``static``: torchrun's agent of node rank 0 hosts the workers' store at the endpoint (given, or
    ``master_addr:master_port``), which workers get as MASTER_ADDR/PORT and may ``tcp://`` to; tpassrun's agent
    there serves that store too, and hosts its etcd next to it, on the endpoint's port + 1."""
    from tpassrun.rendezvous import split_endpoint  # (the endpoint passed check_endpoint)

    _scheme, host, port = split_endpoint(endpoint, schemes=False, min_port=0)
    if port is None:   # torchrun: ValueError "Port is absent in endpoint"
        raise ConfigError(f"--rdzv-endpoint={endpoint}: the static backend needs a port (the workers' store listens "
                          "there)")
    return f"[{host}]:{port + 1}" if ":" in host else f"{host}:{port + 1}"
