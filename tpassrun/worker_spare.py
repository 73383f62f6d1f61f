"""A warm spare: waits in :func:`tpassrun.init` until the agent assigns it a rank, receives that rank's state
(and, for an unplanned swap, the dead rank's light snapshot), joins the world and becomes a joiner's
:class:`~tpassrun.worker_session.Session`.
"""

from __future__ import annotations

import base64
import logging
import os
import select
import socket
import time
from datetime import timedelta
from typing import Any

from . import envnames as E
from .channel import Field, WorkerPhase
from .world import join_world, set_rank_env
from .worker_commands import _transfer_auth
from .worker_link import AgentLink
from .worker_session import Session, _bundle_step

log = logging.getLogger("tpassrun.worker")


def _prewarm() -> None:
    """What a joiner would otherwise import on the critical path of a swap: DDP's constructor imports
    ``torch._dynamo`` on first use (seconds), and the handoff codec pulls in numpy. A spare pays it before it
    says hello, so "ready" means warm."""
    import importlib

    for name in ("torch._dynamo", "torch.nn.parallel.distributed", "tpassrun.handoff"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a missing optional piece only costs time later
            log.debug("prewarm %s: %s", name, exc)


def _wait_for_sender(listener: socket.socket, link: AgentLink, timeout: float,
                     pending: list[dict[str, Any]]) -> bool:
    """Wait until a sender connects (True), or until the agent sends a command other than the unplanned
    swap's ``light`` snapshot (False; the command is appended to ``pending``), or the timeout (False).

    An assigned spare may wait a while (it is assigned while the survivors finish their step), so it
    must stay responsive: an abort or a new assignment must not wait for the accept timeout.
    ``light`` arrives while the donor streams; it is kept in ``pending`` and answered after the
    state, in the order the agent expects."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if link.waiting():
            msg = link.recv()
            if msg["kind"] == "reserve":
                continue   # too late to pre-fault for this transfer
            pending.append(msg)
            if msg["kind"] != "light":
                return False
            continue
        readable, _, _ = select.select([listener, link.sock], [], [], remaining)
        if listener in readable:
            return True


def _receive_state(listener: socket.socket, link: AgentLink, msg: dict[str, Any], auth: Any,
                   pending: list[dict[str, Any]]) -> Any:
    """Wait for the sender the agent announced and receive its state, and the dead rank's mirrored shard when
    the assignment names one: (bundle, (shard bundle, light) or None); None if none came, or it failed.
    Connections that do not prove the swap key are dropped and the wait goes on: a stranger that connects
    first neither delays the swap past its timeout nor gets anything applied."""
    from . import handoff
    from .handoff_wire import accept_one

    swap_id = msg.get("swap_id")
    wait_s = float(msg.get("timeout", 120))
    accept_s = float(msg.get("accept_timeout", wait_s))
    max_bytes = int(msg["max_bytes"]) if msg.get("max_bytes") else None
    deadline = time.monotonic() + accept_s
    strangers = 0
    while True:
        if not _wait_for_sender(listener, link, deadline - time.monotonic(), pending):
            if not pending or pending[-1]["kind"] == "light":   # timed out (not interrupted)
                link.send("received", ok=False, swap_id=swap_id, error=f"HandoffError: no sender connected "
                          f"within {accept_s} s" + (f" ({strangers} unauthenticated connections dropped)"
                                                     if strangers else ""))
            return None   # an abort or a new assignment came first: the main loop handles it
        try:
            conn = accept_one(listener, 1.0)
        except handoff.HandoffError:
            continue
        with conn:
            conn.settimeout(wait_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                bundle, stats = handoff.recv_bundle(conn, auth=auth, max_bytes=max_bytes)
            except handoff.AuthError as exc:
                strangers += 1
                log.warning("spare: dropped a connection that did not prove the swap key: %s", exc)
                link.send("stranger", swap_id=swap_id, error=str(exc)[:200])
                continue
            except (OSError, handoff.HandoffError) as exc:
                link.send("received", ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=swap_id)
                return None
        extra = bundle.meta.get("extra")
        sent_for = extra.get("swap_id") if isinstance(extra, dict) else None
        if sent_for != swap_id:   # authenticated, so a bug rather than an attack: still never apply it
            link.send("received", ok=False, swap_id=swap_id,
                      error=f"HandoffError: the state is for swap {sent_for!r}, not {swap_id!r}")
            return None
        mirrored, nbytes = None, stats.nbytes
        if msg.get("mirror_from"):
            # the dead rank's sharded state is in its buddy's mirror, not on any live rank (tpassrun/shards.py)
            source = msg["mirror_from"]
            try:
                from .shards import fetch_mirrored

                shard, shard_light, _ = fetch_mirrored(source["target"], int(source["owner"]), int(source["step"]))
            except Exception as exc:  # noqa: BLE001 - reported: the agent retries or gives the recovery up
                link.send("received", ok=False, swap_id=swap_id,
                          error=f"fetching rank {source.get('owner')}'s shard of step {source.get('step')} from its "
                                f"mirror failed: {type(exc).__name__}: {exc}"[:300])
                return None
            mirrored, nbytes = (shard, shard_light), nbytes + shard.nbytes
        link.send("received", ok=True, nbytes=nbytes, seconds=stats.seconds, checksum=stats.checksum,
                  swap_id=swap_id, step=_bundle_step(bundle), mirrored=mirrored is not None)
        return bundle, mirrored


def _wait_as_spare(backend: str | None, link: AgentLink, local_rank: int,
                   timeout: timedelta | None) -> Session:
    """Block until the agent hands this spare a rank, receive that rank's state, join the world."""
    from . import handoff, testing
    from .light import decode as decode_light

    link.set(Field.PHASE, WorkerPhase.SPARE)
    bundle = None
    light: bytes | None = None
    mirrored: tuple[Any, bytes | None] | None = None   # the dead rank's shard and light snapshot, from its mirror
    listener = None
    assign: dict[str, Any] | None = None
    pending: list[dict[str, Any]] = []    # commands that came while waiting for the sender
    while True:
        msg = pending.pop(0) if pending else link.recv()
        kind = msg["kind"]
        if kind == "assign":
            assign = msg
            if listener is not None:
                listener.close()
            listener = None
            try:
                auth = _transfer_auth(msg)
                listener, port = handoff.listen_for_bundle(str(msg.get("listen_host") or "127.0.0.1"))
            except (OSError, handoff.HandoffError) as exc:
                bundle = None
                link.send("received", ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=msg.get("swap_id"))
                continue
            link.set(Field.PHASE, WorkerPhase.TRANSFERRING)
            link.send("listening", port=port, swap_id=msg.get("swap_id"))
            testing.fault_point(int(msg.get("rank", -1)), 0, "receive")  # tests: the joiner dies mid-transfer
            received = _receive_state(listener, link, msg, auth, pending)
            bundle, mirrored = received if received is not None else (None, None)
            continue
        if kind == "light":
            light = base64.b64decode(msg["data"])
            step = _bundle_step(decode_light(light))
            ok = msg.get("step") is None or step == int(msg["step"])
            link.send("light_ok", ok=ok, nbytes=len(light), step=step)
            if not ok:
                light = None
            continue
        if kind == "reserve":
            # The agent says how big a rank's state is: fault in that much now, while idle, so the transfer
            # does not pay the kernel for fresh pages (see handoff_wire._Arena).
            from .handoff_wire import reserve_receive_arena

            got = reserve_receive_arena(int(msg["nbytes"]))
            link.send("reserved", nbytes=got)
            continue
        if kind == "abort":
            bundle, light, assign, mirrored = None, None, None, None
            link.set(Field.PHASE, WorkerPhase.SPARE)
            continue
        if kind == "reform":
            if assign is None or bundle is None:
                link.send("reformed", ok=False, error="no state received")
                continue
            if listener is not None:
                listener.close()
            link.set(Field.PHASE, WorkerPhase.RECONFIGURING)
            set_rank_env(msg)
            os.environ.pop(E.TPASSRUN_SPARE, None)
            join_world(backend, msg, timeout)
            sess = Session(backend=backend, link=link, rank=int(msg["rank"]), world_size=int(msg["world_size"]),
                           local_rank=local_rank, generation=int(msg.get("generation", 0)), joined=True,
                           timeout=timeout)
            sess._pending_bundle = bundle
            if mirrored is not None:
                sess._pending_shard_bundle = mirrored[0]
                if light is None:
                    light = mirrored[1]     # the dead rank's node is gone, or kept no snapshot of that step
            sess._pending_light_bundle = decode_light(light) if light is not None else None
            sess.step = _bundle_step(sess._pending_light_bundle or bundle)
            link.set(Field.STEP, sess.step)
            link.send("reformed", ok=True, rank=sess.rank, world_size=sess.world_size, generation=sess.generation)
            return sess
        if kind == "exit":
            os._exit(int(msg.get("code", 0)))
        log.warning("spare ignoring unexpected command %r", kind)
