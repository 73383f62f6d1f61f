"""The runs on this machine: a small registry so ``tpassctl`` finds a job without an endpoint or a run id.

Each launcher writes one JSON file (0600) into a private directory while it runs: ``$XDG_RUNTIME_DIR/tpassrun``
when the user has one (systemd's per-user tmpfs, cleaned at logout), else ``<tmp>/tpassrun-<uid>`` created
0700. The directory must be ours and private, or we refuse it (another user could plant entries). An entry
records where the run's etcd is, its id, the event log and the path of the etcd credentials file (never a
secret). It is removed at exit; entries whose launcher died are pruned by whoever lists them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import stat
import tempfile
import time
from typing import TYPE_CHECKING, ClassVar

from tpassrun.rendezvous import pid_alive
from tpassrun.schema import Record, Schema

if TYPE_CHECKING:
    from tpassrun.settings import LaunchConfig
    from tpassrun.swapper import StatusHost

VERSION = 1
log = logging.getLogger("tpassrun.ops.registry")


class CtlError(Exception):
    """A one-line tpassctl user error (exit 1)."""


class RegistryError(Exception):
    """The registry directory is not private to this user."""


def registry_dir(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.stat(xdg).st_uid == os.getuid():
        path = os.path.join(xdg, "tpassrun")
    else:
        path = os.path.join(tempfile.gettempdir(), f"tpassrun-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RegistryError(f"{path} is not a private directory of this user (mode {oct(st.st_mode & 0o777)})")
    return path


@dataclasses.dataclass(frozen=True)
class RunEntry(Record):
    SCHEMA: ClassVar[Schema] = Schema(what="run entry", version=VERSION)

    run_id: str
    endpoint: str
    pid: int
    node_id: str = ""
    host: str = dataclasses.field(default_factory=socket.gethostname)
    started: float = dataclasses.field(default_factory=time.time)
    event_log: str | None = None
    log_dir: str | None = None
    credentials: str | None = None     # path of the run's etcd credentials file (0600), never its content
    rdzv_conf: str = ""                # the non-secret --rdzv-conf items tpassctl needs (e.g. a cacert path)
    nproc: int = 0
    spares: int = 0
    script: str = ""                   # what it runs: the entry point and its first arguments (for the run list)


def register(entry: RunEntry, directory: str | None = None) -> str:
    """Write ``entry`` (atomically, 0600); returns the path to pass to :func:`unregister`."""
    directory = directory or registry_dir()
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in entry.run_id)[:80]
    path = os.path.join(directory, f"{safe}-{entry.pid}.json")
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(entry.to_json(), fh)
    os.replace(tmp, path)
    return path


def unregister(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def list_runs(directory: str | None = None, *, prune: bool = True) -> list[RunEntry]:
    """The live runs on this machine, oldest first; entries of dead launchers are removed."""
    directory = directory or registry_dir()
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as fh:
                entry = RunEntry.from_json(json.load(fh))
        except (OSError, ValueError):     # a torn or foreign file (SchemaError is a ValueError)
            continue
        if not pid_alive(entry.pid):
            if prune:
                unregister(path)
            continue
        out.append(entry)
    return sorted(out, key=lambda e: e.started)


def register_run(agent: "StatusHost", stack: contextlib.AsyncExitStack, endpoint: str, event_path: str | None) -> None:
    """List ``agent``'s run while it lives (removed by ``stack``); a registry we cannot use is only a warning."""
    cfg = agent.cfg
    # paths, no secrets (tpassctl reads the password and the run key from those files, as the agent does)
    conf = ",".join(f"{k}={v}" for k, v in dict(cfg.rdzv_conf or {}).items()
                    if k in ("cacert", "cert", "key", "user", "password_file", "run_key_file", "read_timeout"))
    own_key = getattr(agent, "run_key_file", None)   # an embedded etcd's run key file (a path, never the key)
    if own_key and "run_key_file=" not in conf:
        conf = ",".join(x for x in (conf, f"run_key_file={own_key}") if x)
    entry = RunEntry(run_id=cfg.rdzv_id, endpoint=endpoint, pid=os.getpid(), node_id=agent.node_id,
                     event_log=os.path.abspath(event_path) if event_path else None, log_dir=agent.logs.run_dir,
                     credentials=getattr(agent, "credentials_file", None), rdzv_conf=conf,
                     nproc=cfg.nproc_per_node, spares=cfg.spares_per_node, script=_script_of(cfg))
    try:
        list_runs()             # prunes the entries of launchers that died without removing theirs
        path = register(entry)
    except (RegistryError, OSError) as exc:
        log.warning("run registry unavailable (tpassctl needs --rdzv-endpoint/--rdzv-id): %s", exc)
        return
    stack.callback(unregister, path)


def _script_of(cfg: "LaunchConfig", width: int = 48) -> str:
    """``train.py --steps 200 ...``: the entry point's file name and its arguments, cut to ``width``; the
    arguments are the user's own (the entry point's directory is left out: the run list is one line a run)."""
    name = ("-m " if cfg.module else "") + os.path.basename(cfg.training_script)
    text = " ".join([name, *cfg.training_script_args]).strip()
    return text if len(text) <= width else text[: width - 3] + "..."
