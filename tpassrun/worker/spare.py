"""A warm spare: a session without a rank. It waits in :func:`tpassrun.init` for the agent's commands (the
same dispatcher as a rank's, :mod:`tpassrun.worker.commands`, with the spare's table): an assignment to a
rank, whose state it receives (and, for an unplanned swap, the dead rank's light snapshot), then the reform
that makes it that rank (a joiner). Also here: reading a received bundle piece by piece (the joiner loads each
object as the script tracks it). A mixin of :class:`tpassrun.worker.session.Session`.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import socket
import time
from typing import Any

from tpassrun.settings import envnames as E
from tpassrun.worker import faultpoints as testing
from tpassrun.channel import Field, WorkerPhase
from tpassrun.channel.protocol import (Abort, Assign, Exit, Light, LightOk, Listening, Message, Received, Reform, Reformed,
                       Reserve, Stranger)
from tpassrun.transfer.quiet import Throttle, held_note
from tpassrun.worker.world import JoinAborted, join_world, set_rank_env
from tpassrun.worker.commands import Handler, _transfer_auth
from tpassrun.worker.link import AgentLink

log = logging.getLogger("tpassrun.worker")
_STRANGER_LINES = Throttle()     # a flood of strangers: one warning line per source a minute, with the count


@dataclasses.dataclass
class SpareWait:
    """What a spare holds while it waits for its rank."""

    assign: Assign | None = None
    bundle: Any = None                  # the assigned rank's state, once received
    light: bytes | None = None          # unplanned: the dead rank's light snapshot
    mirrored: tuple[Any, bytes | None] | None = None   # the dead rank's shard and light snapshot, from its mirror
    listener: socket.socket | None = None


class SpareCommands:
    """Session's commands while it is a spare (``_spare`` set; the dispatcher is ``BoundaryCommands._serve``)."""

    def _spare_commands(self) -> dict[type[Message], Handler]:
        return {Assign: self._on_assign, Light: self._on_light, Reserve: self._on_reserve, Abort: self._on_abort,
                Reform: self._on_join, Exit: self._on_spare_exit}

    def _wait_for_rank(self) -> None:
        """Block until the agent hands this spare a rank, receive that rank's state, join the world."""
        self._link.set(Field.PHASE, WorkerPhase.SPARE)
        self._spare = SpareWait()
        self._serve(0)

    def _on_assign(self, msg: Assign, step: int, failed: BaseException | None) -> bool:
        from tpassrun.transfer import handoff

        link, wait = self._link, self._spare
        wait.assign = msg
        if wait.listener is not None:
            wait.listener.close()
        wait.listener = None
        try:
            auth = _transfer_auth(msg.key, msg.swap_id, msg.world.rank)
            wait.listener, port = handoff.listen_for_bundle(msg.listen_host or "127.0.0.1")
        except (OSError, handoff.HandoffError) as exc:
            wait.bundle = None
            link.send(Received(ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=msg.swap_id,
                               attempt=msg.attempt))
            return False
        link.set(Field.PHASE, WorkerPhase.TRANSFERRING)
        link.send(Listening(port=port, swap_id=msg.swap_id, attempt=msg.attempt))
        if testing.ENABLED:
            testing.fault_point(msg.world.rank, 0, "receive")  # tests: the joiner dies mid-transfer
        received = _receive_state(wait.listener, link, msg, auth, self._pending)
        wait.bundle, wait.mirrored = received if received is not None else (None, None)
        return False

    def _on_light(self, msg: Light, step: int, failed: BaseException | None) -> bool:
        from tpassrun.transfer.light import decode as decode_light

        light: bytes | None = base64.b64decode(msg.data)
        got = _bundle_step(decode_light(light))
        ok = msg.step is None or got == msg.step
        self._link.send(LightOk(ok=ok, nbytes=len(light), step=got))
        self._spare.light = light if ok else None
        return False

    def _on_reserve(self, msg: Reserve, step: int, failed: BaseException | None) -> bool:
        # The agent says how big a rank's state is: fault in that much now, while idle, so the transfer does not
        # pay the kernel for fresh pages (see handoff_wire._Arena).
        from tpassrun.transfer.wire import reserve_receive_arena

        reserve_receive_arena(msg.nbytes)
        return False

    def _on_abort(self, msg: Abort, step: int, failed: BaseException | None) -> bool:
        wait = self._spare
        wait.bundle, wait.light, wait.assign, wait.mirrored = None, None, None, None
        self._link.set(Field.PHASE, WorkerPhase.SPARE)
        return False

    def _on_join(self, msg: Reform, step: int, failed: BaseException | None) -> bool:
        from tpassrun.transfer.light import decode as decode_light

        link, wait = self._link, self._spare
        if wait.assign is None or wait.bundle is None:
            link.send(Reformed(ok=False, error="no state received"))
            return False
        if wait.listener is not None:
            wait.listener.close()
        link.set(Field.PHASE, WorkerPhase.RECONFIGURING)
        world = msg.world
        set_rank_env(world)
        os.environ.pop(E.TPASSRUN_SPARE, None)
        t0 = time.perf_counter()
        if testing.ENABLED:
            testing.fault_point(world.rank, step, "join")   # tests: a joiner dies on its way into the world
        try:
            join_world(self.backend, world, self._timeout, lambda: self._join_interrupted(str(world.prefix)))
        except JoinAborted as exc:
            # a rank died on its way into the new world: keep what was received (this spare holds the rank for
            # the recovery that replaces the dead one) and wait at its step for the next re-form
            wait.listener = None
            self._join_aborted(_bundle_step(wait.bundle), str(exc))
            return False
        self.rank, self.world_size = world.rank, world.world_size
        self.generation = world.generation if world.generation is not None else 0
        self.joined = True
        self._spare = None
        self._pending.clear()
        self._pending_bundle = wait.bundle
        light = wait.light
        if wait.mirrored is not None:
            self._pending_shard_bundle = wait.mirrored[0]
            if light is None:
                light = wait.mirrored[1]     # the dead rank's node is gone, or kept no snapshot of that step
        self._pending_light_bundle = decode_light(light) if light is not None else None
        self.step = _bundle_step(self._pending_light_bundle or wait.bundle)
        self._replicas_after_recovery(True)      # checked against its replicas at its first step (tpassrun/worker/replicas.py)
        link.set(Field.STEP, self.step)
        link.send(Reformed(ok=True, rank=self.rank, world_size=self.world_size, generation=self.generation,
                           join_s=round(time.perf_counter() - t0, 4)))
        return True

    def _on_spare_exit(self, msg: Exit, step: int, failed: BaseException | None) -> bool:
        os._exit(msg.code)


def _prewarm() -> None:
    """What a joiner would otherwise import on the critical path of a swap: DDP's constructor imports
    ``torch._dynamo`` on first use (seconds), and the handoff codec pulls in numpy. A spare pays it before it
    says hello, so "ready" means warm."""
    import importlib

    for name in ("torch._dynamo", "torch.nn.parallel.distributed", "tpassrun.transfer.handoff"):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a missing optional piece only costs time later
            log.debug("prewarm %s: %s", name, exc)


def _next_command(link: AgentLink, pending: list[Message]) -> bool:
    """While a joiner waits for its sender: take the agent's commands that are there. False once one came that
    ends the wait (it is appended to ``pending`` for the dispatcher); the unplanned swap's ``Light`` arrives while
    the donor streams and is kept in ``pending``, answered after the state, in the order the agent expects."""
    while link.waiting():
        msg = link.recv()
        if isinstance(msg, Reserve):
            continue   # too late to pre-fault for this transfer
        pending.append(msg)
        if not isinstance(msg, Light):
            return False
    return True


def _receive_state(listener: socket.socket, link: AgentLink, msg: Any, auth: Any, pending: list[Message],
                   reply: bool = True) -> tuple[Any, Any] | None:
    """Wait for the sender the agent announced and receive its state, and the dead rank's mirrored shard when
    the assignment names one: (bundle, (shard bundle, light) or None); None if none came, or it failed.
    Every connection's handshake runs at once, each within its own deadline (:class:`~tpassrun.transfer.gate.
    HandshakeGate`): a stranger that connects first, says nothing or drips its proof a byte at a time neither
    delays the sender nor gets anything applied; each one dropped is reported (``Stranger``). The wait stays
    responsive: an abort or a new assignment is served at once, not after the accept timeout. ``msg``: an
    ``Assign`` (or a survivor's ``CatchUp``, with ``reply=False``: then (bundle, transfer stats), and the caller
    says Received once it checked and loaded the state). Every reply names the swap and its attempt."""
    from tpassrun.transfer import handoff
    from tpassrun.transfer.wire import poly1305_here, encryption_wanted, listener_flags
    from tpassrun.transfer.gate import HandshakeGate

    swap_id, attempt = msg.swap_id, msg.attempt
    accept_s = float(msg.accept_timeout)
    max_bytes = getattr(msg, "max_bytes", None) or None
    deadline = time.monotonic() + accept_s
    strangers = 0
    encrypted = encryption_wanted()    # the run's --rdzv-conf encrypt=true: the hello says so, the stream is sealed
    with HandshakeGate(listener, auth, listener_flags(poly1305_here(), encrypted), watch=(link.sock,)) as gate:
        while True:
            if not _next_command(link, pending):
                return None   # an abort or a new assignment came first: the dispatcher handles it
            left = deadline - time.monotonic()
            if left <= 0:
                link.send(Received(ok=False, swap_id=swap_id, attempt=attempt, error=f"HandoffError: no sender "
                                   f"connected within {accept_s} s" + (f" ({strangers} unauthenticated connections "
                                                                        "dropped)" if strangers else "")))
                return None
            proved = gate.poll(left)
            for source, why in gate.take_dropped():
                strangers += 1
                held = _STRANGER_LINES.check(source)
                if held is not None:
                    log.warning("spare: dropped a connection from %s that did not prove the swap key: %s%s", source,
                                why, held_note(held, _STRANGER_LINES.window))
                link.send(Stranger(swap_id=swap_id, attempt=attempt, error=f"{source}: {why}"[:200]))
            if proved is not None:
                break
    with proved.sock as conn:
        conn.settimeout(float(msg.timeout))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            bundle, stats = handoff.recv_bundle(conn, mac=proved.mac, max_bytes=max_bytes, encrypt=encrypted)
        except (OSError, handoff.HandoffError) as exc:
            link.send(Received(ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=swap_id,
                               attempt=attempt))
            return None
        extra = bundle.meta.get("extra")
        sent_for = extra.get("swap_id") if isinstance(extra, dict) else None
        if sent_for != swap_id:   # authenticated, so a bug rather than an attack: still never apply it
            link.send(Received(ok=False, swap_id=swap_id, attempt=attempt,
                               error=f"HandoffError: the state is for swap {sent_for!r}, not {swap_id!r}"))
            return None
        if not reply:
            return bundle, stats
        mirrored, nbytes = None, stats.nbytes
        if msg.mirror_from is not None:
            # the dead rank's sharded state is in its buddy's mirror, not on any live rank (tpassrun/worker/shards.py)
            source = msg.mirror_from
            try:
                from tpassrun.worker.shards import fetch_mirrored

                shard, shard_light, _ = fetch_mirrored(source.target, source.owner, source.step)
            except Exception as exc:  # noqa: BLE001 - reported: the agent retries or gives the recovery up
                link.send(Received(ok=False, swap_id=swap_id, attempt=attempt,
                                   error=f"fetching rank {source.owner}'s shard of step {source.step} from its "
                                         f"mirror failed: {type(exc).__name__}: {exc}"[:300]))
                return None
            mirrored, nbytes = (shard, shard_light), nbytes + shard.nbytes
        link.send(Received(ok=True, nbytes=nbytes, seconds=stats.seconds, checksum=stats.checksum,
                           swap_id=swap_id, attempt=attempt, step=_bundle_step(bundle), mirrored=mirrored is not None))
        return bundle, mirrored


# --- reading a received bundle piece by piece (the joiner loads each object as the script tracks it) ---

def _object_names(bundle: Any) -> list[str]:
    return sorted(bundle.meta.get("objects", {}))


def _has_object(bundle: Any, name: str) -> bool:
    return name in bundle.meta.get("objects", {})


def _apply_one(bundle: Any, name: str, obj: Any) -> None:
    from tpassrun.transfer.codec import decode_tree

    obj.load_state_dict(decode_tree(bundle.meta["objects"].pop(name), bundle.tensors))


def _bundle_rng(bundle: Any) -> Any:
    from tpassrun.transfer.codec import decode_tree

    tree = bundle.meta.get("rng")
    return None if tree is None else decode_tree(tree, bundle.tensors)


def _bundle_step(bundle: Any) -> int:
    return int(bundle.meta.get("step", 0)) if bundle is not None else 0
