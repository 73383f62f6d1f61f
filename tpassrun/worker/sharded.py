"""The worker's sharded state (``sess.track_sharded``): the Session's side of :mod:`tpassrun.worker.shards`.

Where it touches the step loop (each a call of one line in the module named):

* ``run`` (worker_session): :meth:`ShardedState._shard_begin` at each step start (after the light snapshot),
  :meth:`ShardedState._shard_fence` at its end; the commit point (worker_step) fences too;
* a failed step (worker_commands ``_after_failure``) fences, so the agent reads complete versions;
* the agent's ``shard_rollback`` command (worker_commands) -> :meth:`ShardedState._shard_rollback`; the re-formed
  world (``_reform``) -> :meth:`ShardedState._shard_after_reform`;
* a joiner's received shard (worker_spare) is applied like the rest of its pending state (worker_session).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("tpassrun.worker")


class ShardedState:
    """Mixed into :class:`tpassrun.worker.session.Session` (which sets the attributes named here)."""

    _link: Any
    _tracked: dict[str, Any]
    _per_rank: set[str]
    _sharded: set[str]
    _shards: Any                      # shards.ShardState, made by the first track_sharded()
    _shard_restore_due: int | None    # a survivor loads its sharded copy of this step once re-formed
    _replica_group: tuple[int, ...]   # declare_replicas()
    rank: int
    step: int

    def track_sharded(self, **objects: Any) -> Any:
        """Like :meth:`track`, for state of which this rank holds its own shard only (a ZeRO optimizer
        partition, FSDP2's local shards, a hand-sharded optimizer's state): no other rank holds it, so tpassrun
        keeps a copy in the memory of a buddy agent on another node (in a job of one node, in the agent's own),
        refreshed every ``--shard-mirror-interval`` steps in the background, and an unplanned failure of this
        rank is recovered from there (see :mod:`tpassrun.worker.shards`). Objects may expose ``commit_optimizers()``:
        the torch optimizers whose ``step()`` starts changing them (where the background copy must be done).
        The rest of the heavy state (``track``) must be identical on every rank of its declared replica group.
        Launched without tpassrun, the same as :meth:`track`."""
        self.track(**objects)                       # type: ignore[attr-defined]
        self._per_rank.difference_update(objects)
        self._sharded.update(objects)
        if self._link is not None and self._shards is None:
            from tpassrun.worker.shards import ShardState

            self._shards = ShardState.from_env(self.rank, self._link.set)
            self._shard_retarget()
        return self

    # --- the step loop ---
    def _shard_objects(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(sharded objects, the other heavy objects): what a version of the local copy holds."""
        sharded = {k: self._tracked[k] for k in self._sharded}
        others = {k: v for k, v in self._tracked.items() if k not in self._per_rank and k not in self._sharded}
        return sharded, others

    def _shard_begin(self, step: int, light: bytes | None) -> None:
        shards = self._shards
        if shards is None:
            return
        if shards.retarget_due:
            shards.retarget_due = False
            self._shard_retarget()
        if getattr(self, "joined", False):
            shards.policy.joined()                  # K comes from the survivors (tpassrun/settings/shard_interval.py)
        shards.begin(step, self._shard_objects(), light=light)

    def _shard_fence(self) -> None:
        if self._shards is not None:
            self._shards.fence()

    def _shard_close(self) -> None:
        if self._shards is not None:
            self._shards.close()

    def _shard_retarget(self) -> None:
        """Ask the agent where this rank's shard copies go: its node's buddy mirror, or in a job of one node
        the agent's own (it outlives a worker, not the node). Once at the start and after each re-formed world
        (the ring may have changed): one round trip over the private socket, never per step."""
        if self._shards is None or self._link is None or not self._shards.enabled:
            return
        if set(self._replica_group) - {self.rank}:
            # HSDP: live replicas hold this rank's shards (they donate them): no mirror; the local copies serve
            # a rollback when the survivors of a failure stopped at different steps (tpassrun/plan/node_shards.py)
            self._shards.retarget(None, self.rank)
            return
        from tpassrun.channel.protocol import MirrorInfo, MirrorInfoRequest

        answer = self._link.request(MirrorInfoRequest(), MirrorInfo)
        self._shards.retarget((answer.buddy or answer.local) if isinstance(answer, MirrorInfo) else None, self.rank)

    # --- recovery ---
    def _shard_rollback(self, step: int) -> None:
        """Put every tracked object, the RNGs and the step back to the local copy of ``step``'s start (the
        dead rank's newest mirrored shard is older than where this survivor stopped). The sharded objects are
        loaded once the world is re-formed (:meth:`_shard_after_reform`): a framework's loader may ask its
        process groups (DeepSpeed's ZeRO asks its rank), and the old ones are gone; the joiner loads its shard
        there too."""
        version = self._shards.ring.get(step)
        live = step == self.step and self._committed != step
        if (version is None or not version.complete()) and live:
            # this survivor's live state already is that step's start (paused there, or failed in it before
            # its commit point): only what the step consumed goes back, as under DDP
            if self._last_light is not None:
                self._restore_light(self._last_light)  # type: ignore[attr-defined]
            self._drop_grads()                          # type: ignore[attr-defined]
            return
        sharded, others = self._shard_objects()
        light = self._shards.restore(step, None, others)
        if light is not None:
            self._restore_light(light)              # type: ignore[attr-defined]
        self._rollback_light, self._commit_light = light, None
        self._window = step
        self._drop_grads()                          # type: ignore[attr-defined]
        self._committed = self._sealed = -1
        # the sharded objects already are that step's (live): nothing to load; else once re-formed
        self._shard_restore_due = None if live else step
        self.step = step

    def _shard_after_reform(self) -> None:
        """In the re-formed world: load the sharded copy a rollback left pending; ask for the buddy again."""
        if self._shards is None:
            return
        self._shards.retarget_due = True            # asked at the next step start, once "reformed" is said
        self._shards.after_reform()                 # a joiner reads the refresh interval there
                                                    # (tpassrun/settings/shard_interval.py)
        due, self._shard_restore_due = self._shard_restore_due, None
        if due is not None:
            self._shards.restore(due, self._shard_objects()[0], None)


__all__ = ["ShardedState"]
