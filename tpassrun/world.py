"""The process group a worker belongs to, and the DDP around it, across re-formed worlds.

Joining a world (``init_process_group`` on the generation's store, under a swap's key prefix), leaving it,
aborting it so that peers blocked in a collective with a dead rank fail at once, and a DDP wrapper that is
rebuilt after every re-formed world. :mod:`tpassrun.worker` drives these; nothing here talks to the agent.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

from . import envnames as E

log = logging.getLogger("tpassrun.worker")


class ReconfigurableDDP:
    """A ``DistributedDataParallel`` that is rebuilt around the same module after a re-formed world.

    Attribute access and calls go to the current DDP instance, so ``ddp(x)``, ``ddp.parameters()``,
    ``ddp.module`` keep working across swaps.
    """

    def __init__(self, module: Any, kwargs: dict[str, Any], *, synced: bool = False) -> None:
        self._module = module
        self._kwargs = kwargs
        self._ddp = self._build(synced)

    def _build(self, synced: bool) -> Any:
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        kwargs = dict(self._kwargs)
        if synced and "init_sync" not in kwargs and "init_sync" in inspect.signature(DistributedDataParallel).parameters:
            # After a swap every rank already holds identical weights (survivors kept theirs, the joiner
            # loaded them before this call): skip DDP's broadcast of the whole model from rank 0. Survivors
            # (rebuild) and the joiner (first build) both skip it, so their collectives still match.
            kwargs["init_sync"] = False
        ddp = DistributedDataParallel(self._module, **kwargs)
        # Fix the gradient bucket layout now instead of after the first iteration. DDP normally re-buckets
        # once, by the order gradients became ready; a DDP rebuilt after a swap would then reduce its first
        # step with a different layout, hence a different summation order, than the uninterrupted run, and
        # the runs would drift apart in the last bits. With the layout fixed at construction (a collective,
        # done by every rank, here and in every rebuild) both runs reduce in the same order on every step.
        reducer = getattr(ddp, "reducer", None)
        if reducer is not None and hasattr(reducer, "_push_all_rebuilt_params"):
            reducer._push_all_rebuilt_params()
            reducer._rebuild_buckets()
        return ddp

    def rebuild(self) -> None:
        self._ddp = self._build(synced=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ddp(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_ddp"], name)


def socket_fds() -> dict[int, str]:
    """fd -> "socket:[inode]" for this process's sockets (Linux /proc)."""
    out: dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in names:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(fd)] = target
    return out


class GroupSockets:
    """The sockets a process-group init opened (gloo's full mesh, the store client).

    When a peer dies in a gloo collective only its direct ring neighbours get an error; a rank blocked on a
    *live* neighbour that has given up waits for gloo's timeout (30 min), and neither ``abort()`` nor
    ``destroy_process_group()`` closes gloo's sockets while DDP still references the group. Shutting these
    sockets down makes every peer blocked on us fail at once, so the error cascades through the ring.
    """

    def __init__(self) -> None:
        self._fds: dict[int, str] = {}
        self._before: dict[int, str] = {}

    def __enter__(self) -> "GroupSockets":
        self._before = socket_fds()
        return self

    def __exit__(self, *exc: object) -> None:
        after = socket_fds()
        self._fds = {fd: t for fd, t in after.items() if self._before.get(fd) != t}

    def shutdown(self) -> int:
        n = 0
        for fd, target in self._fds.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != target:
                    continue  # closed and reused for something else since
                sock = socket.socket(fileno=os.dup(fd))
                try:
                    sock.getpeername()  # only connected pairs: gloo's listener thread aborts the process
                    sock.shutdown(socket.SHUT_RDWR)  # if its listening socket is shut under it
                    n += 1
                finally:
                    sock.close()
            except OSError:
                continue
        self._fds = {}
        return n


GROUP_SOCKETS = GroupSockets()


def init_world(backend: str | None, **kwargs: Any) -> None:
    import torch.distributed as dist

    with GROUP_SOCKETS:
        dist.init_process_group(backend, **kwargs)


def abort_process_groups() -> None:
    """Abort every communicator of this process at once (NCCL needs one grouped abort; gloo closes its
    sockets), falling back to a plain destroy where abort is not supported."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    GROUP_SOCKETS.shutdown()
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
            return
        except Exception as exc:  # noqa: BLE001 - not every backend implements abort
            log.debug("abort_process_group: %s", exc)
    leave_process_group()


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - a group with a dead peer may refuse a clean teardown
            log.debug("destroy_process_group: %s", exc)


def join_world(backend: str | None, msg: dict[str, Any], timeout: timedelta | None) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    store = dist.TCPStore(msg["addr"], int(msg["port"]), is_master=False,
                          timeout=timeout or timedelta(seconds=300))
    store = dist.PrefixStore(str(msg["prefix"]), store)
    init_world(backend, store=store, rank=int(msg["rank"]), world_size=int(msg["world_size"]), **kwargs)


def set_rank_env(msg: dict[str, Any]) -> None:
    """Keep ``os.environ`` truthful for code that reads RANK after a swap."""
    for key, name in (("rank", E.RANK), ("world_size", E.WORLD_SIZE), ("group_rank", E.GROUP_RANK),
                      ("role_rank", E.ROLE_RANK), ("role_world_size", E.ROLE_WORLD_SIZE),
                      ("local_world_size", E.LOCAL_WORLD_SIZE), ("group_world_size", E.GROUP_WORLD_SIZE)):
        if key in msg and msg[key] is not None:
            os.environ[name] = str(msg[key])
    if msg.get("generation") is not None:
        os.environ[E.TPASSRUN_GENERATION] = str(msg["generation"])
