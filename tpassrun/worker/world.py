"""The process group a worker belongs to, and the DDP around it, across re-formed worlds.

Joining a world (``init_process_group`` on the generation's store, under a swap's key prefix), leaving it,
aborting it so that peers blocked in a collective with a dead rank fail at once, and a DDP wrapper that is
rebuilt after every re-formed world. :mod:`tpassrun.worker` drives these; nothing here talks to the agent.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from tpassrun.settings import envnames as E

if TYPE_CHECKING:
    from tpassrun.channel import WorldSpec

log = logging.getLogger("tpassrun.worker")


class BucketLayout:
    """The gradient bucket layout of a :class:`ReconfigurableDDP`, tracked as a replicated object so that a
    joiner builds its DDP with the same buckets as the survivors.

    Why it matters: the all-reduce of a bucket sums each element in an order that depends on where it sits in
    the flat bucket (gloo's and NCCL's rings chunk the bucket), so the same gradients reduced with another
    layout differ in the last bits. ``DistributedDataParallel`` starts with one bucket and re-buckets once,
    at its second iteration, in the order gradients became ready. A DDP rebuilt after a swap would start over
    from one bucket while the uninterrupted run uses the rebuilt layout; given this layout it reduces exactly
    as the uninterrupted one does. ``buckets`` is None until the first DDP has re-bucketed.
    """

    def __init__(self) -> None:
        self.buckets: list[list[int]] | None = None
        self.sizes: list[int] | None = None
        self._source: Any = None   # the ReconfigurableDDP whose live DDP may know a newer layout

    def refresh(self) -> None:
        if self._source is not None:
            # the pending layout only stands in for one not known yet: its sizes are the caps, not the buckets'
            # bytes, and every replica must hold the same state (a DDP rebuilt after a swap has no rebuilt layout
            # of its own before its first iteration: it keeps the one it was built with, as the joiner does)
            found = rebuilt_layout(self._source._ddp) or (self._source._pending_layout() if self.buckets is None
                                                          else None)
            if found is not None:
                self.buckets, self.sizes = found

    def state_dict(self) -> dict[str, Any]:
        self.refresh()
        return {"v": 1, "buckets": self.buckets, "sizes": self.sizes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("v") != 1:
            raise ValueError(f"DDP bucket layout version {state.get('v')!r} is not supported (expected 1)")
        buckets, sizes = state.get("buckets"), state.get("sizes")
        if buckets is not None and not (all(type(i) is int for b in buckets for i in b)
                                        and isinstance(sizes, list) and len(sizes) == len(buckets)):
            raise ValueError("DDP bucket layout is malformed")
        self.buckets = [list(b) for b in buckets] if buckets is not None else None
        self.sizes = list(sizes) if sizes is not None else None


def rebuilt_layout(ddp: Any) -> tuple[list[list[int]], list[int]] | None:
    """The bucket layout ``ddp`` re-bucketed to (parameter indices per bucket, bucket bytes), from its
    logging data (recorded on the iterations right after the re-bucketing); None before that."""
    try:
        data = ddp._get_ddp_logging_data()
        indices, sizes = data.get("rebuilt_per_bucket_param_indices"), data.get("rebuilt_bucket_sizes")
        if not indices or not sizes:
            return None
        buckets = [[int(i) for i in bucket.split()] for bucket in str(indices).split(",")]
        nbytes = [int(n) for n in str(sizes).split(",")]
    except Exception as exc:  # noqa: BLE001 - a torch without this logging: fall back to DDP's own layout
        log.debug("no DDP bucket layout: %s", exc)
        return None
    return (buckets, nbytes) if len(buckets) == len(nbytes) else None


class ReconfigurableDDP:
    """A ``DistributedDataParallel`` that is rebuilt around the same module after a re-formed world.

    Attribute access and calls go to the current DDP instance, so ``ddp(x)``, ``ddp.parameters()``,
    ``ddp.module`` keep working across swaps. Numerically it is ``DistributedDataParallel(module, **kwargs)``:
    the first DDP is built exactly so, and every rebuild (and a joiner's first build) starts with the layout
    the first one re-bucketed to (:class:`BucketLayout`).
    """

    def __init__(self, module: Any, kwargs: dict[str, Any], *, synced: bool = False,
                 layout: BucketLayout | None = None) -> None:
        self._module = module
        self._kwargs = kwargs
        self._layout = layout if layout is not None else BucketLayout()
        self._ddp = self._build(synced)
        self._layout._source = self
        self._ready: list[int] = []      # parameter indices in the order their gradients became ready
        self._ready_done = False         # ... and that backward finished (its all-reduce completed)
        self._ready_hooks: list[Any] = []
        if self._layout.buckets is None:
            self._record_ready_order()

    def _build(self, synced: bool) -> Any:
        import inspect

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        kwargs = dict(self._kwargs)
        if synced and "init_sync" not in kwargs and "init_sync" in inspect.signature(DistributedDataParallel).parameters:
            # After a swap every rank already holds identical weights (survivors kept theirs, the joiner
            # loaded them before this call): skip DDP's broadcast of the whole model from rank 0. Survivors
            # (rebuild) and the joiner (first build) both skip it, so their collectives still match.
            kwargs["init_sync"] = False
        buckets, sizes = self._layout.buckets, self._layout.sizes
        if buckets is None or sizes is None:
            return DistributedDataParallel(self._module, **kwargs)
        # DDP computes its initial buckets with this function and hands them to the reducer reversed; give it
        # the re-bucketed layout instead (reversed here, so the reducer gets it in its own order). The
        # reducer re-buckets once more after its first iteration, by the same ready order: the same layout.
        compute = dist._compute_bucket_assignment_by_size

        def recorded_layout(params: Any, limits: Any, *args: Any, **kw: Any) -> Any:
            if sorted(i for b in buckets for i in b) != list(range(len(params))):
                return compute(params, limits, *args, **kw)   # not the module we recorded: DDP's own
            return [list(b) for b in reversed(buckets)], list(reversed(sizes))

        dist._compute_bucket_assignment_by_size = recorded_layout
        try:
            return DistributedDataParallel(self._module, **kwargs)
        finally:
            dist._compute_bucket_assignment_by_size = compute

    def _record_ready_order(self) -> None:
        """Note the order gradients become ready in the first backward, as the reducer does: torch re-buckets
        by it at the next forward, and a swap right before that (at step 1) must hand over that layout."""
        from torch.autograd import Variable

        params = self._reducer_params()

        def finished() -> None:
            self._ready_done = True

        def after_ddp() -> None:   # queued behind DDP's end-of-backward callback, whichever was queued first
            Variable._execution_engine.queue_callback(finished)

        def hook(index: int) -> Any:
            def ready(_param: Any) -> None:
                if index not in self._ready:
                    self._ready.append(index)
                if len(self._ready) == len(params):
                    self._drop_ready_hooks()
                    # `finished` runs at the end of this backward, after DDP's own end-of-backward callback
                    # (which waits for the all-reduce), and not at all when that one raises: a first
                    # backward whose all-reduce failed is re-executed as the first iteration again, with
                    # DDP's initial buckets, exactly as the uninterrupted run did; its order must not be used.
                    Variable._execution_engine.queue_callback(after_ddp)
            return ready

        for i, p in enumerate(params):
            self._ready_hooks.append(p.register_post_accumulate_grad_hook(hook(i)))

    def _drop_ready_hooks(self) -> None:
        for handle in self._ready_hooks:
            handle.remove()
        self._ready_hooks = []

    def _reducer_params(self) -> list[Any]:
        """The parameters the reducer indexes, in its order (DDP's ``_build_params_for_reducer``)."""
        ignored = getattr(self._module, "_ddp_params_and_buffers_to_ignore", ())
        names = {id(p): n for n, p in self._module.named_parameters()}
        return [p for p in self._module.parameters() if p.requires_grad and names.get(id(p)) not in ignored]

    def _pending_layout(self) -> tuple[list[list[int]], list[int]] | None:
        """The layout torch's DDP will re-bucket to at its next forward, when its first backward is done and
        it has not re-bucketed yet (computed as the reducer does: ready order, first-bucket and bucket caps)."""
        import torch.distributed as dist

        ddp, params = self._ddp, self._reducer_params()
        if not params or not self._ready_done or len(self._ready) != len(params) or ddp.find_unused_parameters:
            return None
        try:
            config = ddp._bucket_config
            limits = list(config.per_bucket_bytes_caps) or [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
            buckets, sizes = dist._compute_bucket_assignment_by_size(
                [params[i] for i in self._ready], limits, [False] * len(params), list(self._ready))
        except Exception as exc:  # noqa: BLE001 - another torch: leave DDP its own layout
            log.debug("cannot compute DDP's pending bucket layout: %s", exc)
            return None
        return [list(b) for b in buckets], list(sizes)

    def rebuild(self) -> None:
        self._layout.refresh()     # what the DDP being replaced re-bucketed to (or is about to)
        self._drop_ready_hooks()
        self._ddp = self._build(synced=True)
        if self._layout.buckets is None:
            self._ready, self._ready_done = [], False
            self._record_ready_order()

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

    def adopt_since_init(self) -> int:
        """Also shut down, on a failure, the TCP sockets opened since the world's init: the groups made after
        ``init_process_group`` (device meshes, a framework's data-parallel groups). Without this a survivor
        blocked in a sub-group collective with another survivor waits for gloo's timeout. Framework adapters
        call it once their groups exist (and again after re-creating them)."""
        added = {fd: t for fd, t in socket_fds().items()
                 if self._before.get(fd) != t and fd not in self._fds and _is_inet(fd)}
        self._fds.update(added)
        return len(added)

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


def _is_inet(fd: int) -> bool:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return sock.family in (socket.AF_INET, socket.AF_INET6)
    finally:
        sock.close()


GROUP_SOCKETS = GroupSockets()


def init_world(backend: str | None, **kwargs: Any) -> None:
    import torch.distributed as dist

    with GROUP_SOCKETS:
        dist.init_process_group(backend, **kwargs)


def store_client(addr: str, port: int, timeout: timedelta) -> Any:
    """The workers' store as this worker may reach it: through the authenticated door with the key its agent
    gave it (tpassrun.store), else (no key: launched by something else) torch's plain TCPStore client."""
    from tpassrun.store import connect

    store = connect(addr, port, timeout)
    _HELD.append(store)
    return store


# A store written in Python (tpassrun.store.AuthStore) is held by torch through its C++ base only: were the
# Python object collected, the next call into it would fail ("pure virtual function"). The stores of the
# worlds this process formed stay referenced here; those of worlds it left are closed (release_stores).
_HELD: list[Any] = []


def release_stores(keep: int = 1) -> None:
    """Close the stores of worlds this process left, keeping the newest ``keep`` (the world it is in)."""
    while len(_HELD) > keep:
        old = _HELD.pop(0)
        close = getattr(old, "close", None)
        if close is not None:
            try:
                close()
            except OSError:
                pass


def init_first_world(backend: str | None, timeout: timedelta | None) -> None:
    """The generation's first world, as ``init_process_group()`` with env:// would form it (MASTER_ADDR/PORT,
    RANK, WORLD_SIZE), but through the store's authenticated door when this worker holds the store key."""
    from tpassrun.store import key_from_env

    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    env = os.environ
    if key_from_env() is None or not env.get(E.MASTER_ADDR) or not env.get(E.MASTER_PORT):
        init_world(backend, **kwargs)
        return
    store = store_client(env[E.MASTER_ADDR], int(env[E.MASTER_PORT]), timeout or timedelta(seconds=300))
    init_world(backend, store=store, rank=int(env[E.RANK]), world_size=int(env[E.WORLD_SIZE]), **kwargs)


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


class JoinAborted(Exception):
    """The agent gave the world being re-formed up before every rank arrived (one died on the way)."""


ARRIVAL_POLL_S = 0.002


def join_world(backend: str | None, world: "WorldSpec", timeout: timedelta | None,
               interrupted: Callable[[], bool] | None = None) -> None:
    """Join the world ``world`` names (its store: the generation's TCPStore under the swap's prefix).

    With ``interrupted``, every rank first counts itself in under the world's prefix and waits until all have
    arrived, asking ``interrupted()`` between polls: a rank killed on its way into the new world would otherwise
    hold every other one inside the process group's rendezvous until its timeout, where the agent cannot reach
    them. When it returns True the join is given up (:class:`JoinAborted`); the worker stays where it stopped,
    without a process group, for the recovery that replaces the dead rank (tpassrun.plan.triage)."""
    import faulthandler
    import sys

    # a join that hangs inside torch (a store that never answers, gloo waiting for a peer) cannot be interrupted
    # from here: past a minute every thread's stack goes to stderr, so the worker's log says where it stopped
    try:
        faulthandler.dump_traceback_later(JOIN_STACKS_AFTER_S, exit=False, file=sys.stderr)
    except (AttributeError, ValueError, OSError):    # a stderr the script replaced by something without a fd
        pass
    try:
        _join_world(backend, world, timeout, interrupted)
        release_stores(keep=1)      # the left world's store connection: the new world has its own
    finally:
        faulthandler.cancel_dump_traceback_later()


JOIN_STACKS_AFTER_S = 60.0


def _join_world(backend: str | None, world: "WorldSpec", timeout: timedelta | None,
                interrupted: Callable[[], bool] | None) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    limit = timeout or timedelta(seconds=300)
    store = dist.PrefixStore(str(world.prefix), store_client(world.addr, int(world.port), limit))
    if interrupted is not None:
        deadline = time.monotonic() + limit.total_seconds()
        arrived = store.add("tpassrun_arrived", 1)
        while arrived < int(world.world_size):
            if interrupted():
                raise JoinAborted(f"the world of {world.world_size} ranks under {world.prefix} was given up")
            if time.monotonic() > deadline:
                raise JoinAborted(f"only {arrived} of {world.world_size} ranks arrived within {limit}")
            time.sleep(ARRIVAL_POLL_S)
            arrived = store.add("tpassrun_arrived", 0)
        try:
            init_world(backend, store=store, rank=int(world.rank), world_size=int(world.world_size), **kwargs)
        except Exception as exc:  # a rank that arrived and died before connecting: given up too
            leave_process_group()
            raise JoinAborted(f"the world could not be formed: {type(exc).__name__}: {exc}"[:300]) from exc
        return
    init_world(backend, store=store, rank=int(world.rank), world_size=int(world.world_size), **kwargs)


def set_rank_env(world: "WorldSpec") -> None:
    """Keep ``os.environ`` truthful for code that reads RANK after a swap (fields ``world`` leaves None stay)."""
    for value, name in ((world.rank, E.RANK), (world.world_size, E.WORLD_SIZE), (world.group_rank, E.GROUP_RANK),
                        (world.role_rank, E.ROLE_RANK), (world.role_world_size, E.ROLE_WORLD_SIZE),
                        (world.local_world_size, E.LOCAL_WORLD_SIZE),
                        (world.group_world_size, E.GROUP_WORLD_SIZE)):
        if value is not None:
            os.environ[name] = str(value)
    if world.generation is not None:
        os.environ[E.TPASSRUN_GENERATION] = str(world.generation)
