"""Sharded state (``sess.track_sharded``): a local ring of pre-step copies, pushed to a buddy's in-memory mirror.

Under ZeRO-1/2, FSDP2 or a hand-sharded optimizer no live peer holds a rank's shard, so a rank that dies
takes it along. Every rank with sharded state therefore keeps, at every K-th step start (a *version* is the
state at the start of that step):

* a **local copy** of all its heavy state (sharded *and* replicated objects) plus its light snapshot, in a
  ring of two versions: what a survivor rolls back to when the dead rank's newest copy is older than the
  survivor's own step (the rank died after the survivors committed their optimizer step, or in the middle of a
  refresh, or K > 1);
* a **mirror** of its sharded objects and light snapshot in the memory of a buddy agent on another node
  (:mod:`tpassrun.mirror`), pushed by a background thread over its own socket: what the dead rank's
  replacement loads.

Nothing of it is on a healthy rank's critical path but the ``state_dict()`` calls at the step start (they
collect references): the copy runs in a background thread (CPU) or on a side stream (GPU) while the step's
forward and backward run, and the step's commit point (a tracked optimizer starting to change the model)
waits for it (:meth:`ShardRing.fence`, normally already done); the push runs after it, off the step entirely.
The ring is double buffered (a version being pushed is never overwritten: the next snapshot is skipped
instead, and said), and the mirror keeps its newest two complete versions, so a rank that dies in the middle
of a refresh still leaves a complete older version; the recovery plan picks the newest version that every
rank involved has (:func:`tpassrun.plan.swap.resume_plan`).

The push may lag by one version, never more: a refresh step waits, before it snapshots, until the buddy holds
the previous version (:meth:`MirrorPusher.wait_pushed`; normally long done). Without that bound a loaded host's
pusher fell several versions behind (it skips to the newest), the dead rank's mirror held nothing the
survivors' three local versions still had, and a live recovery became a whole-group restart. A pusher that is
failing (the buddy is unreachable or full) or stalls for PUSH_WAIT_S is not waited for: the mirror is then
best effort, and the lag is said once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from tpassrun.worker.shard_copy import Copier, CopyJob, CpuCopier, CudaCopier, make_copier

log = logging.getLogger("tpassrun.worker.shards")

MIRROR_KIND = "shard/state"      # the mirror entry of one rank: its sharded objects + light snapshot
# Three local versions: the dead rank's mirror may lag its own ring by one version (its last refresh had not
# landed), and the survivors may be one step ahead of it (they started the next step, and copied it), so a
# survivor must still hold the version two before its newest.
RING_SLOTS = 3
PUSH_WAIT_S = 30.0    # a refresh waits at most this long for the previous version's push (then: best effort)


# --------------------------------------------------------------------------------------------- the ring


@dataclass
class Version:
    """One complete (or completing) local copy: the state at the start of step ``step``."""

    step: int
    shard: Any                      # StateBundle of the sharded objects (+ the light snapshot in ``extra``)
    local: Any                      # StateBundle of the other heavy objects (kept here only)
    job: CopyJob | None
    pins: int = 0                   # the pusher is reading it: never overwritten meanwhile

    @property
    def shard_nbytes(self) -> int:
        return int(self.shard.nbytes)

    @property
    def nbytes(self) -> int:
        return int(self.shard.nbytes + self.local.nbytes)

    def complete(self) -> bool:
        return self.job is None or (self.job.done() and getattr(self.job, "error", None) is None)

    def light(self) -> bytes | None:
        extra = self.shard.extra
        light = extra.get("light")
        return light if isinstance(light, bytes) else None


class ShardRing:
    """The local copies of a rank's heavy state, newest two versions (see the module docstring)."""

    def __init__(self, copier: Copier | None = None) -> None:
        self._copier = copier
        self._slots: list[Version | None] = [None] * RING_SLOTS
        self._lock = threading.Lock()
        self._inflight: Version | None = None
        self.skipped = 0                # snapshots skipped because both slots were busy (the push is behind)

    # --- the worker's main thread ---
    def begin(self, step: int, sharded: Mapping[str, Any], others: Mapping[str, Any], *, owner: int,
              light: bytes | None) -> Version | None:
        """Snapshot the state at the start of ``step``: collect the references now, copy in the background.
        Returns None when both slots are busy (the previous version is still being pushed)."""
        from tpassrun.transfer import handoff

        self.fence()
        with self._lock:
            newest = self._newest_locked()
            free = [i for i, v in enumerate(self._slots)
                    if v is None or (v is not newest and v.pins == 0)]
            if not free:
                self.skipped += 1
                return None
            # an empty slot, else the oldest version
            index = min(free, key=lambda i: -1 if (v := self._slots[i]) is None else v.step)
            old = self._slots[index]
            self._slots[index] = None    # never read half-overwritten
        if self._copier is None:
            self._copier = make_copier()
        shard = handoff.capture(sharded, step=step, extra={"light": light, "owner": owner})
        local = handoff.capture(others, step=step)
        dst_shard = self._buffers(shard.tensors, old.shard.tensors if old else [])
        dst_local = self._buffers(local.tensors, old.local.tensors if old else [])
        pairs = list(zip(dst_shard, shard.tensors)) + list(zip(dst_local, local.tensors))
        job = self._copier.start(pairs) if pairs else None
        version = Version(step, handoff.StateBundle(shard.meta, dst_shard), handoff.StateBundle(local.meta, dst_local),
                          job)
        with self._lock:
            self._slots[index] = version
        self._inflight = version
        return version

    def _buffers(self, live: Sequence[Any], old: Sequence[Any]) -> list[Any]:
        """Host buffers for ``live``: the older version's, reused when the layout is the same (fresh pages cost
        more than the copy itself), else new ones."""
        assert self._copier is not None
        same = len(old) == len(live) and all(tuple(o.shape) == tuple(t.shape) and o.dtype == t.dtype
                                             for o, t in zip(old, live))
        return list(old) if same else [self._copier.host_buffer(t) for t in live]

    def fence(self) -> None:
        """The live state may change from here on: wait until the in-flight copy has read it (normally done)."""
        version, self._inflight = self._inflight, None
        if version is not None and version.job is not None:
            version.job.fence()
            error = getattr(version.job, "error", None)
            if error is not None:
                log.warning("shard snapshot of step %d failed: %s", version.step, error)
                with self._lock:
                    self._slots = [None if v is version else v for v in self._slots]

    def versions(self) -> tuple[int, ...]:
        """Steps whose copy is complete, oldest first."""
        with self._lock:
            return tuple(sorted(v.step for v in self._slots if v is not None and v.complete()))

    def get(self, step: int) -> Version | None:
        with self._lock:
            return next((v for v in self._slots if v is not None and v.step == step), None)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(v.nbytes for v in self._slots if v is not None)

    def restore(self, step: int, sharded: Mapping[str, Any] | None, others: Mapping[str, Any] | None) -> bytes | None:
        """Load version ``step`` into the live objects (a survivor rolling back; None: leave that part alone) and
        return its light snapshot. The ring's buffers are reused by later versions, so the objects are given
        copies, never the buffers."""
        from tpassrun.transfer import handoff

        self.fence()
        version = self.get(step)
        if version is None or not version.complete():
            raise KeyError(f"no complete local copy of step {step} (have {self.versions()})")
        if version.job is not None:
            version.job.wait()
        for bundle, objects in ((version.shard, sharded), (version.local, others)):
            if objects is None:
                continue
            copies = handoff.StateBundle(bundle.meta, [t.clone() for t in bundle.tensors])
            handoff.apply(copies, {n: objects[n] for n in bundle.meta["objects"]}, restore_rng_state=False)
        return version.light()

    def drop_after(self, step: int) -> None:
        """Forget versions newer than ``step`` (after rolling back to it: they are re-made as the steps re-run)."""
        with self._lock:
            self._slots = [None if v is not None and v.step > step and not v.pins else v for v in self._slots]

    def clear(self) -> None:
        """Forget every version (after the tracked state was replaced wholesale, e.g. a joiner's first load)."""
        self.fence()
        with self._lock:
            self._slots = [v if v is not None and v.pins else None for v in self._slots]

    # --- the pusher thread ---
    def _newest_locked(self) -> Version | None:
        done = [v for v in self._slots if v is not None and v.complete()]
        return max(done, key=lambda v: v.step) if done else None

    def pin_newest(self, after: int) -> Version | None:
        """The newest complete version newer than step ``after``, pinned (call :meth:`unpin`), or None."""
        with self._lock:
            newest = self._newest_locked()
            if newest is None or newest.step <= after:
                return None
            newest.pins += 1
            return newest

    def unpin(self, version: Version) -> None:
        with self._lock:
            version.pins -= 1


# --------------------------------------------------------------------------------------------- the push


def _where(target: Any) -> str:
    return f"{getattr(target, 'node', '') or getattr(target, 'addr', '?')}:{getattr(target, 'port', '?')}"


def as_target(cfg: Any) -> Any:
    """A :class:`tpassrun.mirror.MirrorTarget` from the agent's ``mirror_info`` (its JSON form), or None."""
    if not cfg:
        return None
    if isinstance(cfg, Mapping):
        from tpassrun.mirror import MirrorTarget

        return MirrorTarget.from_json(cfg)
    return cfg


@dataclass
class PushStats:
    pushed_step: int = -1          # newest version the buddy holds complete
    pushes: int = 0
    sent_bytes: int = 0            # total
    last_bytes: int = 0            # one version
    last_seconds: float = 0.0
    last_cpu_s: float = 0.0        # the pusher thread's CPU time for one version (frame, MAC, socket)
    errors: int = 0
    last_error: str = ""


class MirrorPusher:
    """Pushes the ring's newest complete version to the buddy's mirror, from its own thread over its own
    connection. Never blocks the training thread: :meth:`offer` only wakes it up. When it falls behind (the
    push of one version takes longer than K steps) it skips to the newest version."""

    def __init__(self, ring: ShardRing, owner: int, *, on_pushed: Callable[[PushStats], None] | None = None) -> None:
        self.ring = ring
        self.owner = owner
        self.stats = PushStats()
        self._on_pushed = on_pushed
        self._target: Any = None         # tpassrun.mirror.MirrorTarget: client(), epoch
        self._client: Any = None
        self._wake = threading.Event()
        self._stop = False
        self._lock = threading.Lock()
        self._done = threading.Condition()   # notified after each push attempt (success or error)
        self._stalled = False                # a wait timed out: best effort until the next push lands
        self._thread: threading.Thread | None = None

    def wait_pushed(self, step: int, timeout: float | None = None) -> bool:
        """Block until the buddy holds version ``step`` (or a newer one): the bound on the mirror's lag (see the
        module docstring). Returns at once, False, when there is no buddy, the pusher is failing or stalled."""
        timeout = PUSH_WAIT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._done:
            while self.stats.pushed_step < step:
                if self._target is None or self._stop or self._stalled or self.stats.last_error:
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    self._stalled = True
                    log.warning("rank %d: the push of its shard (step %d) to the mirror at %s has taken over %g s: "
                                "the mirror is best effort until it lands", self.owner, step, _where(self._target),
                                timeout)
                    return False
                self._done.wait(left)
        return True

    def _notify(self) -> None:
        with self._done:
            self._done.notify_all()

    def retarget(self, target: Any, owner: int | None = None) -> None:
        """A new buddy (membership changed) or a new rank: the next push goes there, complete."""
        with self._lock:
            if target != self._target or (owner is not None and owner != self.owner):
                self._target = target
                self._drop_client()
                self.stats.pushed_step = -1
            if owner is not None:
                self.owner = owner
        self.offer()

    @property
    def pushing(self) -> bool:
        """Whether a mirror is targeted (not under HSDP: the replicas hold the shards, copies stay local)."""
        return self._target is not None

    def offer(self) -> None:
        if self._thread is None and not self._stop and self._target is not None:
            self._thread = threading.Thread(target=self._run, name="tpassrun-shard-push", daemon=True)
            self._thread.start()
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._notify()
        with self._lock:
            self._drop_client()

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _run(self) -> None:
        from tpassrun.transfer import encode_parts

        backoff = 0.0
        while not self._stop:
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop:
                return
            if backoff:
                time.sleep(backoff)
            with self._lock:
                target, owner = self._target, self.owner
            if target is None:
                continue
            version = self.ring.pin_newest(self.stats.pushed_step)
            if version is None:
                continue
            try:
                if version.job is not None:
                    version.job.wait()
                cpu0 = time.thread_time()
                parts = encode_parts(version.shard)
                nbytes = sum(len(p) for p in parts)
                t0 = time.perf_counter()
                with self._lock:
                    client = self._client
                if client is None:
                    client = target.client()     # connects on first use, never under the lock
                    with self._lock:
                        if self._target == target and self._client is None:
                            self._client = client
                client.put(owner, MIRROR_KIND, version.step, parts, epoch=int(getattr(target, "epoch", 0)))
                if client is not self._client:
                    client.close()
                seconds = time.perf_counter() - t0
                backoff = 0.0
                s = self.stats
                s.pushed_step, s.pushes, s.sent_bytes = version.step, s.pushes + 1, s.sent_bytes + nbytes
                s.last_bytes, s.last_seconds, s.last_cpu_s = nbytes, seconds, time.thread_time() - cpu0
                s.last_error, self._stalled = "", False
                if self._on_pushed is not None:
                    self._on_pushed(s)
            except Exception as exc:  # noqa: BLE001 - the mirror is best effort: retried, counted, said once
                with self._lock:
                    self._drop_client()
                self.stats.errors += 1
                if str(exc) != self.stats.last_error:
                    full = type(exc).__name__ == "MirrorFull"
                    log.warning("rank %d: pushing its shard (step %d) to the mirror at %s failed: %s%s", owner,
                                version.step, _where(target), exc,
                                " (raise --mirror-max-bytes on that node)" if full else "")
                self.stats.last_error = str(exc)
                backoff = min(max(0.05, backoff * 2), 2.0)
                self._wake.set()
            finally:
                self.ring.unpin(version)
                self._notify()


class ShardState:
    """A worker's sharded-state machinery: the ring, the pusher, the refresh interval, and what it publishes
    in its channel slot (versions held, bytes held and sent) for its agent. Made by ``sess.track_sharded``."""

    def __init__(self, owner: int, interval: int | str | None, publish: Callable[[Any, int], None],
                 copier: Copier | None = None, store: Any = None) -> None:
        from tpassrun.settings import shard_interval

        self.ring = ShardRing(copier)
        self.policy = shard_interval.IntervalPolicy(interval, store)  # None or "auto": measured, agreed
        self._publish = publish
        self._began = False
        self._costed: tuple[Version, float] | None = None  # the newest refresh, its main-thread CPU
        self.retarget_due = False       # the worker asks the agent for its buddy again (after a re-formed world)
        self.pusher = MirrorPusher(self.ring, owner, on_pushed=self._pushed)
        from tpassrun.channel import Field

        # counted as a rank with sharded state from now on, before its first copy: a death inside step 0 is then
        # planned from its step-0 copy (begin) rather than as a rank whose state some other rank holds. Not with
        # the mirror off (--shard-mirror-interval 0): no copy will ever exist, and the planner must say at once
        # that no other rank holds the state (the adapter's replica group) instead of planning a recovery that
        # finds no copy (test_zero1_unplanned_kill_without_a_mirror_falls_back_and_says_why)
        if self.policy.enabled:
            publish(Field.SHARD_TRACKED, 1)

    @classmethod
    def from_env(cls, owner: int, publish: Callable[[Any, int], None]) -> "ShardState":
        import os

        from tpassrun.settings import envnames as E
        from tpassrun.settings import shard_interval

        raw = os.environ.get(E.TPASSRUN_SHARD_MIRROR_INTERVAL, shard_interval.AUTO)
        try:
            shard_interval.parse(raw)
        except ValueError:
            log.warning("%s=%r is not an interval: using %s", E.TPASSRUN_SHARD_MIRROR_INTERVAL, raw, shard_interval.AUTO)
            raw = shard_interval.AUTO
        return cls(owner, raw, publish)

    @property
    def interval(self) -> int:
        """Refresh every ``interval`` steps (0: never); under ``auto`` 1 until decided."""
        return self.policy.interval

    @property
    def enabled(self) -> bool:
        return self.policy.enabled

    def begin(self, step: int, objects: tuple[Mapping[str, Any], Mapping[str, Any]], *, light: bytes | None) -> None:
        """At a step start: snapshot it if it is a refresh step (every ``interval``-th, and the first one this
        process runs, so a joiner is covered at once). Step 0 only when every sharded object says its
        ``state_dict()`` leaves it as it is there (``copy_at_start()``: e.g. a DeepSpeed ZeRO partition, whose
        optimizer state DeepSpeed creates at initialization): before the first optimizer step a framework's
        ``state_dict()`` may initialise the optimizer's state to describe it (torch's ``get_optimizer_state_dict``
        runs a zero-gradient step, which moves Adam's step count). With a copy of step 0, a death before the first
        refresh or inside the first accumulation window is recovered live like any other; without, the group
        restarts (nothing is lost: nothing was done)."""
        sharded, others = objects
        if not self.enabled or (step == 0 and not copy_at_start(sharded)):
            return
        self.policy.step_started(step, time.perf_counter())
        due = self.policy.due(step)
        if (self._began and not due) or self.ring.get(step) is not None:
            return      # not a refresh step; or re-executing a step after a rollback: that copy is this very state
        self._began = True
        self._account()
        cpu0 = time.thread_time()
        held = self.ring.versions()
        if held:
            self.pusher.wait_pushed(held[-1])    # the mirror lags one version at most (module docstring)
        version = self.ring.begin(step, sharded, others, owner=self.pusher.owner, light=light)
        if version is None:
            log.debug("step %d: shard snapshot skipped, the previous one is still being pushed", step)
            return
        self._costed = (version, time.thread_time() - cpu0)
        if step == 0 and self.pusher.pushing:
            # the job's first copy: in the buddy's memory before the step starts, so that no instant of the first
            # step (or accumulation window) is without one (once per job: the push of one partition); published at
            # once (fence): the survivors' rings hold step 0 whatever instant of it a peer dies at
            self.fence()
            self.pusher.offer()
            self.pusher.wait_pushed(step)
            return
        self.pusher.offer()

    def _account(self) -> None:
        """The background CPU the previous refresh took,
        for ``auto`` (tpassrun/settings/shard_interval.py): its part on this thread,
        the copy thread's, the pusher's and as much again for the receiving agent. Called once its push is done
        (the next refresh waited for it)."""
        from tpassrun.settings import shard_interval

        costed, self._costed = self._costed, None
        if costed is None or self.policy.decided:
            return
        version, main_s = costed
        copy_s = getattr(version.job, "cpu_s", 0.0) if version.job is not None else 0.0
        stats = self.pusher.stats
        push_s = stats.last_cpu_s * (1 + shard_interval.RECEIVER_FACTOR) if stats.pushed_step == version.step else 0.0
        if self.pusher.pushing and not push_s:
            return      # its push did not land (yet): not a representative sample
        self.policy.refresh_cost(main_s + copy_s + push_s)

    def after_reform(self) -> None:
        self.policy.after_reform()

    def fence(self) -> None:
        """The live state changes from here on (the commit point, or the step's end)."""
        from tpassrun.channel import Field

        self.ring.fence()
        held = self.ring.versions()[-RING_SLOTS:]
        # a snapshot the buddy does not hold yet: push it now (the pusher sleeps until offered; the next refresh
        # waits for this push, which without this wake-up started only at that refresh or a second later). Not at
        # the other steps: waking a thread for nothing costs a step tens of microseconds of GIL hand-offs.
        if held and held[-1] > self.pusher.stats.pushed_step:
            self.pusher.offer()
        published = [0] * (RING_SLOTS - len(held)) + [1 + v for v in held]
        for f, v in zip((Field.SHARD_V0, Field.SHARD_V1, Field.SHARD_V2), published):
            self._publish(f, v)
        self._publish(Field.SHARD_HELD, self.ring.held_bytes)
        newest = self.ring.get(held[-1]) if held else None
        if newest is not None:     # what a refresh pushes: nothing without a mirror (the console says so)
            self._publish(Field.SHARD_BYTES, newest.shard_nbytes if self.pusher.pushing else 0)
        self._publish(Field.SHARD_INTERVAL, self.interval if self.policy.decided else 0)

    def _pushed(self, stats: PushStats) -> None:
        from tpassrun.channel import Field

        self._publish(Field.SHARD_PUSHED, 1 + stats.pushed_step)
        self._publish(Field.SHARD_SENT, stats.sent_bytes)

    def restore(self, step: int, sharded: Mapping[str, Any] | None, others: Mapping[str, Any] | None) -> bytes | None:
        light = self.ring.restore(step, sharded, others)
        self.ring.drop_after(step)
        self.fence()
        return light

    def retarget(self, cfg: Any, owner: int) -> None:
        """Where to push: the buddy's :class:`tpassrun.mirror.MirrorTarget` (or its JSON form, as the agent's
        ``mirror_info`` carries it); None stops pushing."""
        self.pusher.retarget(as_target(cfg), owner)

    def close(self) -> None:
        self.ring.fence()
        self.pusher.close()


def copy_at_start(sharded: Mapping[str, Any]) -> bool:
    """Whether every sharded object's ``state_dict()`` is safe to call at step 0 (``copy_at_start()``, or the
    attribute, true: it changes nothing there)."""
    def says(obj: Any) -> bool:
        attr = getattr(obj, "copy_at_start", False)
        return bool(attr() if callable(attr) else attr)

    return bool(sharded) and all(says(obj) for obj in sharded.values())


def fetch_mirrored(target: Any, owner: int, step: int) -> tuple[Any, bytes | None, int]:
    """The joiner's side: the dead rank ``owner``'s mirrored shard of ``step`` from the buddy's mirror ->
    (bundle of its sharded objects, its light snapshot, the step)."""
    target = as_target(target)
    with target.client() as client:
        item = client.get(owner, MIRROR_KIND, step)
    if item is None:
        raise KeyError(f"the mirror at {_where(target)} holds no copy of rank {owner}'s shard of step {step}")
    bundle, light, got = decode_mirrored(item.data)
    if got != step or item.version != step:
        raise ValueError(f"the mirror at {_where(target)} gave step {got} of rank {owner}'s shard, not {step}")
    return bundle, light, got


def decode_mirrored(data: bytes | bytearray | memoryview) -> tuple[Any, bytes | None, int]:
    """A mirror entry -> (bundle of the sharded objects, the light snapshot, the step it is the start of)."""
    from tpassrun.transfer import decode_small

    bundle = decode_small(data)
    light = bundle.extra.get("light")
    return bundle, light if isinstance(light, bytes) else None, bundle.step


__all__ = ["CpuCopier", "CudaCopier", "MIRROR_KIND", "copy_at_start", "MirrorPusher", "PushStats", "ShardRing",
           "ShardState", "Version", "as_target", "decode_mirrored", "fetch_mirrored", "make_copier"]
