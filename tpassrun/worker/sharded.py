"""The worker's sharded state (``sess.track_sharded``): the Session's side of :mod:`tpassrun.worker.shards`.

Where it touches the step loop (each a call of one line in the module named):

* ``Session.run`` (session.py): :meth:`ShardedState.begin` at each step start (after the light snapshot),
  :meth:`ShardedState.fence` at its end; the commit point (step.py) fences too;
* a failed step (``BoundaryCommands.after_failure``, commands.py) fences, so the agent reads complete versions;
* the agent's ``shard_rollback`` command (commands.py) -> :meth:`ShardedState.rollback`; the re-formed
  world (``BoundaryCommands._reform``) -> :meth:`ShardedState.after_reform`;
* a joiner's received shard (spare.py) is applied like the rest of its pending state (session.py).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from tpassrun.worker.state import WorkerState
from tpassrun.worker.step import StepTransaction

log = logging.getLogger("tpassrun.worker")


class ShardedState:
    """A part of :class:`tpassrun.worker.session.Session` (``track_sharded`` registers through :meth:`add`)."""

    def __init__(self, state: WorkerState, txn: StepTransaction) -> None:
        self.state = state
        self.txn = txn

    def add(self, objects: Iterable[str]) -> None:
        """Objects just tracked (``sess.track_sharded``): this rank holds its own shard of them only; the first
        ones start the local copies and ask where the mirror is."""
        st = self.state
        names = set(objects)
        st.per_rank.difference_update(names)
        st.sharded.update(names)
        if st.link is not None and st.shards is None:
            from tpassrun.worker.shards import ShardState

            st.shards = ShardState.from_env(st.rank, st.link.set)
            self.retarget()

    # --- the step loop ---
    def objects(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(sharded objects, the other heavy objects): what a version of the local copy holds."""
        st = self.state
        sharded = {k: st.tracked[k] for k in st.sharded}
        others = {k: v for k, v in st.tracked.items() if k not in st.per_rank and k not in st.sharded}
        return sharded, others

    def begin(self, step: int, light: bytes | None) -> None:
        shards = self.state.shards
        if shards is None:
            return
        if shards.retarget_due:
            shards.retarget_due = False
            self.retarget()
        if self.state.joined:
            shards.policy.joined()                  # K comes from the survivors (tpassrun/settings/shard_interval.py)
        shards.begin(step, self.objects(), light=light)

    def fence(self) -> None:
        st = self.state
        if st.shards is not None:
            st.shards.fence()

    def close(self) -> None:
        st = self.state
        if st.shards is not None:
            st.shards.close()

    def retarget(self) -> None:
        """Ask the agent where this rank's shard copies go: its node's buddy mirror, or in a job of one node
        the agent's own (it outlives a worker, not the node). Once at the start and after each re-formed world
        (the ring may have changed): one round trip over the private socket, never per step."""
        st = self.state
        if st.shards is None or st.link is None or not st.shards.enabled:
            return
        if set(st.replica_group) - {st.rank}:
            # HSDP: live replicas hold this rank's shards (they donate them): no mirror; the local copies serve
            # a rollback when the survivors of a failure stopped at different steps (tpassrun/plan/node_shards.py)
            st.shards.retarget(None, st.rank)
            return
        from tpassrun.channel import MirrorInfo, MirrorInfoRequest

        answer = st.link.request(MirrorInfoRequest(), MirrorInfo)
        st.shards.retarget((answer.buddy or answer.local) if isinstance(answer, MirrorInfo) else None, st.rank)

    # --- recovery ---
    def rollback(self, step: int) -> None:
        """Put every tracked object, the RNGs and the step back to the local copy of ``step``'s start (the
        dead rank's newest mirrored shard is older than where this survivor stopped). The sharded objects are
        loaded once the world is re-formed (:meth:`after_reform`): a framework's loader may ask its
        process groups (DeepSpeed's ZeRO asks its rank), and the old ones are gone; the joiner loads its shard
        there too."""
        st = self.state
        shards = st.shards
        assert shards is not None, "a rollback to a local copy without sharded state"
        version = shards.ring.get(step)
        # it stands at that step before its commit point, its sharded objects loaded: they are that step's
        live = step == st.step and st.committed != step and st.shard_restore_due is None
        if (version is None or not version.complete()) and live:
            self._in_place(step)
            return
        sharded, others = self.objects()
        light = shards.restore(step, None, others)
        if light is not None:
            self.txn.restore_light(light)
        st.rollback_light, st.commit_light = light, None
        st.window = step
        self.txn.drop_grads()
        st.committed = st.sealed = -1
        # the sharded objects already are that step's (live): nothing to load; else once re-formed
        st.shard_restore_due = None if live else step
        st.step = step

    def _in_place(self, step: int) -> None:
        """:meth:`rollback` to ``step`` where this rank stands, before its commit point, without a complete copy
        of its start (the planner counts such a rank as holding it: ``tpassrun.swapper.shardplane.live_step``).
        Nothing changes the heavy state before the commit point, so only what the step consumed goes back: the
        per-rank state to the snapshot its transaction began with, the gradients dropped. Paused at its boundary
        before starting it, the rank holds exactly its start: nothing goes back. Inside an open accumulation
        window the step is no transaction's start (the window's gradients would be lost): refused."""
        st = self.state
        began = st.txn is not None and st.txn[0] == step
        if not began and st.window != step:
            raise RuntimeError(f"rank {st.rank} stands at step {step} inside the accumulation window begun at step "
                               f"{st.window}: step {step} is not a step it can be put back to")
        if began:
            assert st.txn is not None
            light = st.txn[1] if st.light_enabled else None    # (turned off: no snapshot is that step's)
            if light is None:
                raise RuntimeError(f"rank {st.rank} stands inside step {step} with neither a copy of its start nor "
                                   "a snapshot of its per-rank state there")
            self.txn.restore_light(light)
            self.txn.drop_grads()
            st.rollback_light = light
        st.commit_light = None
        st.committed = st.sealed = -1
        st.window = step

    def after_reform(self) -> None:
        """In the re-formed world: load the sharded copy a rollback left pending; ask for the buddy again."""
        st = self.state
        if st.shards is None:
            return
        st.shards.retarget_due = True            # asked at the next step start, once "reformed" is said
        st.shards.after_reform()                 # a joiner reads the refresh interval there
                                                    # (tpassrun/settings/shard_interval.py)
        due, st.shard_restore_due = st.shard_restore_due, None
        if due is not None:
            st.shards.restore(due, self.objects()[0], None)


__all__ = ["ShardedState"]
