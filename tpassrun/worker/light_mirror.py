"""A rank's light snapshots pushed by the worker itself, straight into its buddy's mirror, as they are written.

The agent copies its workers' light snapshots to the buddy node in the background (:mod:`tpassrun.swapper.mirrorplane`),
which leaves a race: a node that dies in the instants after a step's seal was written, before its agent got
round to copying it, takes the only copy along, and the survivors that completed the step cannot resume. So the
worker hands each snapshot to the kernel itself, at the moment it writes it (the seal in the backward pass, before
this rank's gradients reach the step's all-reduce; a step-start snapshot before the step's first collective):
one MAC'd frame of ~10 KB through an already-open one-way connection (:class:`tpassrun.mirror.client.PushStream`),
sent without waiting for any answer. A process killed right after that (the node's agent SIGKILLed, the worker
with it, or the worker alone) still has the frame delivered: the kernel sends what it accepted before it closes
the connection in order. No survivor can complete the step before this rank contributed to its all-reduce, so
no survivor can get ahead of what the buddy will hold.

Nothing here is a round trip: the connection is made (and re-made) by a helper thread, after one ``mirror_info``
question to the agent at the run's start and after each re-formed world. While it is not up (the first steps, a
buddy that does not answer, a send buffer that stayed full) the worker says so in its channel slot
(``Field.LIGHT_MIRRORED`` = 0) and the agent copies the snapshots as before; while it is up the agent leaves them
to the worker (no frame crosses the network twice).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from tpassrun.channel import Field

log = logging.getLogger("tpassrun.worker")

KIND = "light"                  # == tpassrun.swapper.mirrorplane.LIGHT: the same entries the agent's copies fill
RETRY_AFTER_S = 1.0             # a buddy that could not be reached (or a broken stream) is tried again after this


class LightMirror:
    """One per managed rank. ``retarget(target)`` (a :class:`tpassrun.mirror.MirrorTarget`, None: no buddy)
    starts connecting in the background; ``push(step, frame)`` right after each light snapshot is written."""

    def __init__(self, owner: int, link: Any, on_retry: Any = None) -> None:
        self.owner = owner
        self._link = link
        self._on_retry = on_retry         # called (from a helper thread) when the target should be asked again
        self._up = threading.Event()
        self._target: Any = None
        self._stream: Any = None          # a connected PushStream, or None
        self._busy = False                # a helper thread finishes a frame the send buffer could not take
        self._gen = 0                     # bumped by every retarget: a late helper thread gives up
        self._lock = threading.Lock()
        self._said = ""
        self.pushed = 0
        self.bytes = 0

    @property
    def up(self) -> bool:
        return self._stream is not None and not self._busy

    def retarget(self, target: Any, owner: int | None = None) -> None:
        """Push to ``target`` from now on (connecting in the background); None stops pushing."""
        with self._lock:
            if owner is not None:
                self.owner = owner
            if target == self._target and self._stream is not None:
                return
            self._gen += 1
            self._drop_locked()
            self._target = target
            if target is not None:
                self._start(self._gen, 0.0)

    def wait_up(self, timeout: float) -> bool:
        """Wait (bounded) for the connection a retarget started: once per run start or re-formed world, so the
        first step's seal already goes out this way."""
        return self._up.wait(timeout)

    def push(self, step: int, frame: bytes) -> bool:
        """Hand the light snapshot labelled ``step`` to the buddy's mirror now, never blocking. True when the
        kernel took it (it is then delivered even if this process dies next)."""
        stream = self._stream
        if stream is None or self._busy:
            return False
        try:
            rest = stream.push(self.owner, KIND, step, int(self._target.epoch), frame)
        except OSError as exc:
            self._broken(f"{exc}")
            return False
        if rest is not None:
            # the send buffer was full (the buddy stopped reading for a while): the frame's head is in, so the
            # rest must follow before anything else; a helper thread sends it, the agent copies meanwhile
            self._busy = True
            self._link.set(Field.LIGHT_MIRRORED, 0)
            threading.Thread(target=self._finish, args=(stream, rest, self._gen), daemon=True,
                             name="tpassrun-light-mirror").start()
            return False
        self.pushed += 1
        self.bytes += len(frame)
        return True

    def close(self) -> None:
        with self._lock:
            self._gen += 1
            self._target = None
            self._drop_locked()

    # --- helpers (off the training thread) ---
    def _start(self, gen: int, delay: float) -> None:
        threading.Thread(target=self._connect, args=(gen, delay), daemon=True, name="tpassrun-light-mirror").start()

    def _connect(self, gen: int, delay: float) -> None:
        if delay:
            time.sleep(delay)
        with self._lock:
            target = self._target if gen == self._gen else None
        if target is None:
            return
        from tpassrun.mirror import MirrorError, PushStream

        stream = PushStream(target.addr, target.port, target.key, run_id=target.run_id)
        try:
            stream.connect()
        except (MirrorError, OSError) as exc:
            self._say(f"cannot push light snapshots to the buddy mirror on {target.node} ({exc}); its agent "
                      "copies them instead")
            self._retry_later(gen)
            return
        with self._lock:
            if gen != self._gen:
                stream.close()
                return
            self._stream, self._busy, self._said = stream, False, ""
            self._link.set(Field.LIGHT_MIRRORED, 1)
            self._up.set()

    def _retry_later(self, gen: int) -> None:
        """After a failure: wait, then have the training thread ask the agent for the target again at its next
        step start (the buddy may have changed: a re-formed ring) and reconnect."""
        def later() -> None:
            time.sleep(RETRY_AFTER_S)
            if gen == self._gen and self._on_retry is not None:
                self._on_retry()

        threading.Thread(target=later, daemon=True, name="tpassrun-light-mirror").start()

    def _finish(self, stream: Any, rest: bytes, gen: int) -> None:
        try:
            stream.finish(rest)
        except OSError as exc:
            with self._lock:
                if gen == self._gen and self._stream is stream:
                    self._broken_locked(f"{exc}")
            return
        with self._lock:
            if gen == self._gen and self._stream is stream:
                self._busy = False
                self._link.set(Field.LIGHT_MIRRORED, 1)

    def _broken(self, why: str) -> None:
        with self._lock:
            self._broken_locked(why)

    def _broken_locked(self, why: str) -> None:
        self._drop_locked()
        self._say(f"the push stream to the buddy mirror broke ({why}); its agent copies the light snapshots "
                  "until it is back")
        self._retry_later(self._gen)

    def _drop_locked(self) -> None:
        stream, self._stream, self._busy = self._stream, None, False
        self._up.clear()
        self._link.set(Field.LIGHT_MIRRORED, 0)
        if stream is not None:
            stream.close()

    def _say(self, msg: str) -> None:
        if msg != self._said:
            self._said = msg
            log.warning("rank %d: %s", self.owner, msg)


__all__ = ["KIND", "LightMirror"]
