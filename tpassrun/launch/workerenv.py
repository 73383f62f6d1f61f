"""The one place that writes a worker's environment and command line.

What a worker sees is exactly what torchrun 2.13 gives it (agent/server/local_elastic_agent.py
``_start_workers``/``_set_local_rank_env``, run.py ``config_from_args``), plus tpassrun's own
``TPASSRUN_*`` variables that the agent passes in :attr:`WorkerAssignment.extra`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from string import Template
from typing import Any

from tpassrun.settings import ConfigError, LaunchConfig
from tpassrun.settings import envnames as E

log = logging.getLogger(__name__)

LOCAL_RANK_MACRO = "${local_rank}"

# `--run-path`: torchrun runs `runpy.run_path(script)` inside a multiprocessing child of the agent.
# tpassrun's agent is asyncio and never forks itself, so it starts a fresh interpreter that does the
# same thing: argv becomes [script, *args] and the script runs as __main__.
RUN_PATH_BOOTSTRAP = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
RUN_PATH_ENTRYPOINT_NAME = "run_script_path"  # what torchrun's failure report calls it

_OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be "
    "%s in default, to avoid your system being overloaded, "
    "please further tune the variable for optimal performance in "
    "your application as needed. \n"
    "*****************************************"
)


@dataclass(frozen=True)
class WorkerAssignment:
    """Who one worker is in the current generation; the agent fills it from the rendezvous."""

    local_rank: int
    rank: int
    group_rank: int
    role_rank: int
    role_world_size: int
    local_world_size: int
    world_size: int
    group_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    error_file: str  # "" when logs go to os.devnull, like torchrun
    use_agent_store: bool
    timer_file: str | None = None  # TORCHELASTIC_TIMER_FILE when the agent serves torchrun's file timer
    extra: Mapping[str, str] = field(default_factory=dict)  # TPASSRUN_* variables


def elastic_entry_point(cfg: LaunchConfig) -> str:
    """torchrun's ``WorkerSpec.get_entrypoint_name()`` (events' ``entry_point``): the basename of what it
    executes (the interpreter, or the binary with ``--no-python``), or ``run_script_path`` for ``--run-path``."""
    if cfg.run_path:
        return RUN_PATH_ENTRYPOINT_NAME
    return os.path.basename(cfg.training_script if cfg.no_python else cfg.python_exec)


def role_ranks(members: Sequence[Any], rank: int, world_size: int) -> tuple[int, int]:
    """``(ROLE_RANK, ROLE_WORLD_SIZE)`` of global ``rank``, as torchrun's ``_assign_worker_ranks``: the
    workers of one ``--role`` are numbered 0..n-1 in group-rank order; the size counts that role only.

    ``members`` have ``group_rank``, ``rank_offset``, ``nproc`` and ``role``. A spare (rank < 0) or a rank
    no member holds gets ``(rank, world_size)``.
    """
    owner = next((m for m in members if m.rank_offset <= rank < m.rank_offset + m.nproc), None)
    if rank < 0 or owner is None:
        return rank, world_size
    same = [m for m in members if m.role == owner.role]
    before = sum(m.nproc for m in same if m.group_rank < owner.group_rank)
    return before + rank - owner.rank_offset, sum(m.nproc for m in same)


@functools.lru_cache(maxsize=1)
def _warn_omp_once(value: str) -> None:
    log.warning(_OMP_WARNING, value)


def visible_device_for(local_rank: int, inherited: str | None) -> str:
    """``--virtual-local-rank``: the one GPU this worker sees, mapped through the inherited list."""
    if inherited is None:
        return str(local_rank)
    gpus = inherited.split(",")
    if local_rank >= len(gpus):
        raise ConfigError(f"local_rank {local_rank} exceeds available GPUs in CUDA_VISIBLE_DEVICES={inherited}")
    return gpus[local_rank].strip()


def worker_env(cfg: LaunchConfig, a: WorkerAssignment, base_env: Mapping[str, str]) -> dict[str, str]:
    """The full environment of one worker: ``base_env`` (the launcher's) plus torchrun's variables.

    torchrun sets ``OMP_NUM_THREADS`` and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` in its *own*
    environment, from where they leak into every worker; we write them explicitly instead, so the
    launcher's ``os.environ`` is never mutated.
    """
    env = dict(base_env)
    env[E.TORCHELASTIC_SIGNALS_TO_HANDLE] = cfg.signals_to_handle
    if E.OMP_NUM_THREADS not in env and cfg.omp_num_threads is not None:
        _warn_omp_once(cfg.omp_num_threads)
        env[E.OMP_NUM_THREADS] = cfg.omp_num_threads
    env.update({
        E.RANK: str(a.rank),
        E.GROUP_RANK: str(a.group_rank),
        E.ROLE_RANK: str(a.role_rank),
        E.ROLE_NAME: cfg.role,
        E.LOCAL_WORLD_SIZE: str(a.local_world_size),
        E.WORLD_SIZE: str(a.world_size),
        E.GROUP_WORLD_SIZE: str(a.group_world_size),
        E.ROLE_WORLD_SIZE: str(a.role_world_size),
        E.MASTER_ADDR: a.master_addr,
        E.MASTER_PORT: str(a.master_port),
        E.TORCHELASTIC_RESTART_COUNT: str(a.restart_count),
        E.TORCHELASTIC_MAX_RESTARTS: str(cfg.max_restarts),
        E.TORCHELASTIC_RUN_ID: cfg.rdzv_id,
        E.TORCHELASTIC_USE_AGENT_STORE: str(a.use_agent_store),
        E.TORCH_NCCL_ASYNC_ERROR_HANDLING: base_env.get(E.TORCH_NCCL_ASYNC_ERROR_HANDLING, "1"),
        E.TORCHELASTIC_ERROR_FILE: a.error_file,
    })
    if a.timer_file is not None:
        env[E.TORCHELASTIC_TIMER_FILE] = a.timer_file
    if cfg.virtual_local_rank:
        env[E.LOCAL_RANK] = "0"
        env[E.CUDA_VISIBLE_DEVICES] = visible_device_for(a.local_rank, base_env.get(E.CUDA_VISIBLE_DEVICES))
    else:
        env[E.LOCAL_RANK] = str(a.local_rank)
    env.update(a.extra)
    return env


ENCRYPT_CONF = "encrypt"       # --rdzv-conf encrypt=true: state transfers encrypted (tpassrun.transfer.wire)


def encrypt_requested(rdzv_conf: Mapping[str, str] | None) -> bool:
    """Whether ``--rdzv-conf encrypt=...`` asks for encryption (true/1/yes; anything else but false/0/no/empty
    is refused by :func:`check_encrypt_conf`)."""
    return str((rdzv_conf or {}).get(ENCRYPT_CONF, "")).strip().lower() in ("1", "true", "yes", "on")


def check_encrypt_conf(rdzv_conf: Mapping[str, str] | None, unavailable: str | None) -> str | None:
    """The one-line error for a bad ``encrypt=`` value, or encryption asked for where it cannot be had."""
    raw = str((rdzv_conf or {}).get(ENCRYPT_CONF, "")).strip().lower()
    if raw not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        return f"--rdzv-conf {ENCRYPT_CONF}={raw!r}: expected true or false"
    if encrypt_requested(rdzv_conf) and unavailable is not None:
        return f"--rdzv-conf {ENCRYPT_CONF}=true: {unavailable}"
    return None


def substitute_local_rank(args: tuple[str, ...] | list[str], local_rank: int) -> list[str]:
    """torchrun's ``macros.substitute``: ``${local_rank}`` -> the rank (``string.Template`` rules)."""
    return [Template(arg).safe_substitute(local_rank=str(local_rank)) for arg in args]


def worker_argv(cfg: LaunchConfig, local_rank: int, *, spare: bool = False) -> list[str]:
    """The command line of one worker.

    ``[PYTHON_EXEC, "-u", ("-m"), script, *args]``; ``--no-python``: ``[script, *args]``;
    ``--run-path``: ``[PYTHON_EXEC, "-u", "-c", <runpy bootstrap>, script, *args]`` (see
    :data:`RUN_PATH_BOOTSTRAP`). ``${local_rank}`` is substituted with ``string.Template`` rules, as
    torchrun does (so ``$$`` becomes ``$``).

    A ``spare`` (tpassrun's own, torchrun has none) starts through :mod:`tpassrun.launch.sparestart`, which parks a
    script that joins the world without ``tpassrun.init()`` instead of letting it fail on ``RANK=-1``; only
    when the worker interpreter is ours (it must import tpassrun) and the target is Python.
    """
    # torchrun substitutes every Popen argument after the executable, so the script name too
    # (but not a --no-python binary, which is the executable itself).
    script_and_args = substitute_local_rank((cfg.training_script, *cfg.training_script_args), local_rank)
    if spare and not cfg.no_python and cfg.python_exec == sys.executable:
        return [cfg.python_exec, "-u", "-m", "tpassrun.launch.sparestart", *(["-m"] if cfg.module else []),
                *script_and_args]
    if cfg.run_path:
        return [cfg.python_exec, "-u", "-c", RUN_PATH_BOOTSTRAP, *script_and_args]
    if cfg.no_python:
        return [cfg.training_script, *script_and_args[1:]]
    head = [cfg.python_exec, "-u"] + (["-m"] if cfg.module else [])
    return [*head, *script_and_args]


def entrypoint_name(cfg: LaunchConfig) -> str:
    """The name torchrun puts in its failure report title (launcher/api.py ``_get_entrypoint_name``)."""
    if cfg.run_path:
        return RUN_PATH_ENTRYPOINT_NAME
    if cfg.no_python:
        return cfg.training_script
    if cfg.python_exec != sys.executable:
        return cfg.python_exec
    args = ["-u"] + (["-m"] if cfg.module else []) + [cfg.training_script, *cfg.training_script_args]
    return next((arg for arg in args if arg[:1] != "-"), "")
