"""A warm spare: a session without a rank. It waits in :func:`tpassrun.init` for the agent's commands (the
same dispatcher as a rank's, :mod:`tpassrun.worker.commands`, with the spare's table): an assignment to a
rank, whose state it receives (and, for an unplanned swap, the dead rank's light snapshot), then the reform
that makes it that rank (a joiner). The receiving end of the transfer is :mod:`tpassrun.worker.receive`. A part
of :class:`tpassrun.worker.session.Session`.
"""

from __future__ import annotations

import base64
import logging
import os
import time

from tpassrun.channel import (
    Abort,
    Assign,
    Exit,
    Field,
    Light,
    LightOk,
    Listening,
    Message,
    Received,
    Reform,
    Reformed,
    Reserve,
    WorkerPhase,
)
from tpassrun.settings import envnames as E
from tpassrun.worker import faultpoints as testing
from tpassrun.worker.commands import BoundaryCommands, Handler
from tpassrun.worker.receive import _bundle_step, _receive_state, _transfer_auth
from tpassrun.worker.replicas import ReplicaCheck
from tpassrun.worker.state import SpareWait, WorkerState
from tpassrun.worker.world import JoinAborted, join_world, set_rank_env

log = logging.getLogger("tpassrun.worker")


class SpareCommands:
    """Session's commands while it is a spare (``WorkerState.spare`` set; the dispatcher is
    ``BoundaryCommands.serve``)."""

    def __init__(self, state: WorkerState, commands: BoundaryCommands, replicas: ReplicaCheck) -> None:
        self.state = state
        self.commands = commands
        self.replicas = replicas

    def table(self) -> dict[type[Message], Handler]:
        """The commands a spare obeys, by type."""
        return {Assign: self.on_assign, Light: self.on_light, Reserve: self.on_reserve, Abort: self.on_abort,
                Reform: self.on_join, Exit: self.on_exit}

    def _waiting(self) -> SpareWait:
        wait = self.state.spare
        assert wait is not None, "a spare's command reached a worker that holds a rank"
        return wait

    def wait_for_rank(self) -> None:
        """Block until the agent hands this spare a rank, receive that rank's state, join the world."""
        st = self.state
        link = st.managed_link()
        link.set(Field.PHASE, WorkerPhase.SPARE)
        st.spare = SpareWait()
        self.commands.serve(0)

    def on_assign(self, msg: Assign, step: int, failed: BaseException | None) -> bool:
        from tpassrun.transfer import handoff

        st = self.state
        link, wait = st.managed_link(), self._waiting()
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
        received = _receive_state(wait.listener, link, msg, auth, st.pending)
        wait.bundle, wait.mirrored = received if received is not None else (None, None)
        return False

    def on_light(self, msg: Light, step: int, failed: BaseException | None) -> bool:
        from tpassrun.transfer import decode_light

        st = self.state
        link = st.managed_link()
        light = base64.b64decode(msg.data)
        got = _bundle_step(decode_light(light))
        ok = msg.step is None or got == msg.step
        link.send(LightOk(ok=ok, nbytes=len(light), step=got))
        self._waiting().light = light if ok else None
        return False

    def on_reserve(self, msg: Reserve, step: int, failed: BaseException | None) -> bool:
        # The agent says how big a rank's state is: fault in that much now, while idle, so the transfer does not
        # pay the kernel for fresh pages (see handoff_wire._Arena).
        from tpassrun.transfer import reserve_receive_arena

        reserve_receive_arena(msg.nbytes)
        return False

    def on_abort(self, msg: Abort, step: int, failed: BaseException | None) -> bool:
        st = self.state
        link = st.managed_link()
        wait = self._waiting()
        wait.bundle, wait.light, wait.assign, wait.mirrored = None, None, None, None
        link.set(Field.PHASE, WorkerPhase.SPARE)
        return False

    def on_join(self, msg: Reform, step: int, failed: BaseException | None) -> bool:
        from tpassrun.transfer import decode_light

        st = self.state
        link, wait = st.managed_link(), self._waiting()
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
            join_world(st.backend, world, st.timeout, lambda: self.commands.join_interrupted(str(world.prefix)))
        except JoinAborted as exc:
            # a rank died on its way into the new world: keep what was received (this spare holds the rank for
            # the recovery that replaces the dead one) and wait at its step for the next re-form
            wait.listener = None
            self.commands.join_aborted(_bundle_step(wait.bundle), str(exc))
            return False
        st.rank, st.world_size = world.rank, world.world_size
        st.generation = world.generation if world.generation is not None else 0
        st.joined = True
        st.spare = None
        st.pending.clear()
        st.pending_bundle = wait.bundle
        light = wait.light
        if wait.mirrored is not None:
            st.pending_shard_bundle = wait.mirrored[0]
            if light is None:
                light = wait.mirrored[1]     # the dead rank's node is gone, or kept no snapshot of that step
        st.pending_light_bundle = decode_light(light) if light is not None else None
        st.step = _bundle_step(st.pending_light_bundle or wait.bundle)
        self.replicas.after_recovery(True)      # checked against its replicas at its first step (tpassrun/worker/replicas.py)
        link.set(Field.STEP, st.step)
        link.send(Reformed(ok=True, rank=st.rank, world_size=st.world_size, generation=st.generation,
                           join_s=round(time.perf_counter() - t0, 4)))
        return True

    def on_exit(self, msg: Exit, step: int, failed: BaseException | None) -> bool:
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
