"""What runs beside the agent's supervision during a generation: the rendezvous event pump, the status
publisher (``status/<node>``), the ``--tui`` panel, and the hang watchdog (``--hang-timeout``) with its pure
choice of the culprit (:func:`pick_hung`). A part of :class:`tpassrun.agent.Agent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

from tpassrun.agent.state import AgentState, Started
from tpassrun.agent.store import WorkersStore
from tpassrun.channel import Field, SlotState, WorkerPhase
from tpassrun.ops import RankPosition
from tpassrun.records import HangDetected, HangHeld, Keys, NodeStatus, ShardMirror, TrainingResumed, emit
from tpassrun.rendezvous import Generation
from tpassrun.settings import envnames as E
from tpassrun.swapper import RendezvousChanged

log = logging.getLogger("tpassrun.agent")


class GenerationTasks:
    """Agent's per-generation background tasks (started and cancelled by ``Agent._run_generation``)."""

    def __init__(self, state: AgentState, node: Started, store: WorkersStore) -> None:
        self._state = state
        self._node = node
        self._store = store
        self._shard_said: dict[int, tuple[int, int, int]] = {}   # rank -> the shard mirror figures last said

    async def pump_rdzv_events(self, gen: Generation) -> None:
        st = self._state
        async for ev in self._node.rdzv.events():
            st.queue.put_nowait(RendezvousChanged(ev))

    async def publish_status_loop(self) -> None:
        while True:
            self._node.swapper.hint_spares()
            await self.publish_status()
            await asyncio.sleep(1.0)

    async def publish_status(self) -> None:
        st = self._state
        workers = self._node.slots.table()
        self._note_progress()
        status = NodeStatus(node_id=st.node_id, addr=st.addr, pid=os.getpid(),
                            generation=st.generation.number if st.generation else None,
                            restart_count=st.restart_count, workers=workers, time=time.time(),
                            mirror_held=self._node.mirror.store.nbytes)
        self._say_shard_mirrors(workers)
        with contextlib.suppress(Exception):
            await self._node.rdzv.store.put_json(Keys(self._node.rdzv.key("")).status(st.node_id), status.to_json(), lease=True)

    def rank_positions(self, *, ended: bool = False) -> list[RankPosition]:
        slots = self._node.slots
        if slots is None or slots.channel is None:
            return []
        return [RankPosition(step=slots.field(s, Field.STEP),
                             running=slots.field(s, Field.PHASE) == WorkerPhase.RUNNING,
                             last_step_ms=slots.field(s, Field.LAST_STEP_NS) / 1e6,
                             run_from=slots.field(s, Field.RUN_FROM) - 1)
                for s in slots.slots if s.rank is not None and s.managed and (ended or s.state == SlotState.RUNNING)]

    def _note_progress(self) -> None:
        """Follow the step this node's managed ranks run; after a whole-group restart, say once (event
        ``training_resumed``) at which step the script resumed and how many steps it runs again."""
        st = self._state
        resumed = st.progress.note(self.rank_positions())
        if resumed is not None:
            emit(st.events, TrainingResumed(step=resumed.step, reached=resumed.reached, redone=resumed.redone,
                                            redone_s=round(resumed.redone_s, 3)))

    def _say_shard_mirrors(self, workers: Any) -> None:
        """The event log (and console) says what mirroring a rank's sharded state costs: once when it starts,
        again when a refresh's size or its local copies' memory changes by more than a tenth (tpassrun/worker/shards.py)."""
        st = self._state
        said = self._shard_said
        for w in workers:
            if not w.shard_held or w.rank is None:
                continue
            before = said.get(w.rank)
            if before is not None and all(abs(now - was) <= was // 10
                                          for now, was in zip((w.shard_bytes, w.shard_held), before[:2])) \
                    and w.shard_interval == before[2]:
                continue
            said[w.rank] = (w.shard_bytes, w.shard_held, w.shard_interval)
            mirror = self._node.mirror
            buddy = mirror.buddy.node if mirror is not None and mirror.buddy is not None else None
            emit(st.events, ShardMirror(rank=w.rank, slot=w.slot, bytes_per_refresh=w.shard_bytes, local_held=w.shard_held,
                                        interval=w.shard_interval or None, buddy=buddy, mirrored_step=w.shard_mirrored))

    async def status_panel(self) -> None:
        """``--tui``: the live view under the workers' output, from one etcd read a second (tpassrun/ops/tui_panel.py)."""
        st = self._state
        from tpassrun.ops import WaitNote, read_snapshot, run_panel

        rdzv = self._node.rdzv
        waiting = WaitNote()          # what this agent waits for, with its age (the console says it every few s)
        st.events.add_listener(waiting)

        async def fetch() -> dict[str, Any]:
            doc = (await read_snapshot(rdzv.store, rdzv.settings.run_prefix, st.cfg.rdzv_id)).to_json()
            return {**doc, "waiting": waiting.doc()}

        await run_panel(fetch, color=not st.environ.get(E.NO_COLOR))

    async def hang_watchdog(self) -> None:
        """Two checks, every quarter of --hang-timeout (at most 0.5 s):

        * any process of this node's slots (a worker, a warm spare, a joiner or a leaver in a swap, whatever its
          phase, during a swap or another node's recovery too) the kernel has kept stopped (SIGSTOP, state T)
          for --hang-timeout is killed: otherwise a stopped joiner or donor would hold a swap until its 120 s phase
          timeout, a stopped spare would be handed out as if it were ready, and a rank stopped while paused would
          never be found. Its death then takes the ordinary path
          (a recovery, a swap aborted or superseded, a spare re-admitted);
        * a running worker whose step heartbeat is older than --hang-timeout is killed, so its peers blocked in
          a collective with it get an error at once instead of waiting for gloo's 30-minute timeout (not while a
          swap runs here: paused workers do not beat)."""
        st = self._state

        timeout_ns = int(st.cfg.hang_timeout * 1e9)
        stopped_since: dict[int, int] = {}
        quiet_until = 0
        held: dict[str, int] = {}      # silent peer -> when ranks stale on it were first held back (ns)
        link_held = False              # stale ranks held back because this node's link was down (said once)
        while True:
            await asyncio.sleep(min(0.5, st.cfg.hang_timeout / 4))
            now = time.monotonic_ns()
            if self._kill_stopped(stopped_since, now, timeout_ns):
                quiet_until = now + timeout_ns     # let the death cascade and the recovery start
                continue
            if self._node.swapper.busy or now < quiet_until:
                continue
            if any(self._node.slots.phase(s) == WorkerPhase.PENDING for s in self._node.slots.active()):
                # a worker asks whose fault its exception is (tpassrun/agent/cause.py): its peers block on it meanwhile,
                # and killing one would make a casualty of a root cause
                continue
                continue
            stale = []
            for s in self._node.slots.active():
                if not s.managed or not s.alive or self._node.slots.phase(s) != WorkerPhase.RUNNING:
                    continue
                beat = self._node.slots.field(s, Field.HEARTBEAT_NS)
                if beat and now - beat > timeout_ns:
                    stale.append((beat, s))
            culprit = pick_hung(stale, _proc_state)
            if culprit is None:
                held.clear()
                link_held = False
                continue
            beat, s = culprit
            if not is_stopped(_proc_state(s.pid)):
                # Nothing of ours is stopped: the hang may be another node's (a rank SIGSTOPped there blocks ours
                # in the collective). That node's watchdog kills its stopped rank at once; ours then pause for
                # the recovery (busy) or fail out of the collective (no longer RUNNING). Killing ours too would
                # add a second death inside the first recovery. A node cut off from the
                # network blocks them the same way (held below while it is silent), and if it ran the workers'
                # store the recovery needs a new one: started now (it imports torch), not when its lease ends.
                await self._store.standby()
                if await self._held_for_silent_peer(stale, held, now):
                    continue
                link = self._node.health.link   # netwatch: a flap stalls every rank
                if link is not None and link.explains_stall(st.cfg.hang_timeout):
                    if not link_held:
                        link_held = True
                        emit(st.events, HangHeld(ranks=sorted(x.rank for _b, x in stale), silent=[],
                                                 seconds=round((now - min(b for b, _x in stale)) / 1e9, 3),
                                                 reason="this node's link was down within --hang-timeout"))
                    continue
                await asyncio.sleep(REMOTE_HANG_GRACE_S)
                if self._node.swapper.busy or not s.alive or self._node.slots.phase(s) != WorkerPhase.RUNNING \
                        or self._node.slots.field(s, Field.HEARTBEAT_NS) != beat:
                    continue
            emit(st.events, HangDetected(slot=s.index, rank=s.rank, pid=s.pid, proc_state=_proc_state(s.pid),
                                         seconds=round((now - beat) / 1e9, 3), step=self._node.slots.field(s, Field.STEP),
                                         stale_ranks=sorted(x.rank for _b, x in stale), what="no step"))
            s.proc.signal_group(signal.SIGKILL)
            stopped_since.pop(s.pid, None)
            quiet_until = time.monotonic_ns() + timeout_ns

    async def _held_for_silent_peer(self, stale: list[tuple[int, Any]], held: dict[str, int], now: int) -> bool:
        """Whether to leave ranks that went stale with nothing stopped here alone for now, because a member node
        does not answer (cut off, or down): they are blocked in a collective on it, and killing one only adds a
        death (perhaps of the last replica of what the lost node held: then only a restart is left). The lost
        node's plan breaks them out when its lease ends;
        held for that lease and a --hang-timeout more at most, then the watchdog acts as before. A node that is
        itself the one cut off holds too: it fences its workers when its own lease runs out."""
        st = self._state
        gen = self._node.rdzv.generation or st.generation     # latest, else running (swapper/agentport.py)
        if gen is None:
            return False
        peers = [m.node_id for m in gen.members if m.node_id != st.node_id and m.node_id not in gen.lost]
        answers = await asyncio.gather(*(self._node.mirror.reach(n) for n in peers))
        silent = [n for n, a in zip(peers, answers) if a == "silent"]
        for n in [n for n in held if n not in silent]:
            del held[n]
        new = [n for n in silent if n not in held]
        held.update((n, now) for n in new)
        limit_ns = int((self._node.rdzv.settings.lease_seconds + st.cfg.hang_timeout) * 1e9)
        waiting = [n for n in silent if now - held[n] < limit_ns]
        if new and waiting:
            emit(st.events, HangHeld(ranks=sorted(x.rank for _b, x in stale), silent=waiting,
                                     seconds=round((now - min(b for b, _x in stale)) / 1e9, 3),
                                     lease_s=self._node.rdzv.settings.lease_seconds))
        return bool(waiting)

    def _kill_stopped(self, stopped_since: dict[int, int], now: int, timeout_ns: int) -> bool:
        """Kill every process of this node's slots that has stayed stopped for ``timeout_ns`` (``stopped_since``:
        pid -> when it was first seen stopped, kept by the caller across polls). True when one was killed."""
        st = self._state
        from tpassrun.channel import Field

        procs = {s.pid: s for s in self._node.slots.slots if s.alive and s.pid is not None}
        due = stopped_too_long(stopped_since, {pid: _proc_state(pid) for pid in procs}, now, timeout_ns)
        for pid in due:
            s = procs[pid]
            rank = s.rank if s.state in (SlotState.RUNNING, SlotState.LEAVING) else None
            emit(st.events, HangDetected(slot=s.index, rank=rank, pid=pid, proc_state=_proc_state(pid),
                                         seconds=round((now - stopped_since.pop(pid)) / 1e9, 3),
                                         step=self._node.slots.field(s, Field.STEP) if rank is not None else None,
                                         role=str(s.state.value), phase=self._node.slots.phase(s).name.lower(),
                                         swap=self._node.swapper.busy, what="stopped"))
            s.proc.signal_group(signal.SIGKILL)
        return bool(due)


def _proc_state(pid: int | None) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, Z...), or "?"."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


REMOTE_HANG_GRACE_S = 2.0   # how long a stale rank that is not stopped waits for another node's watchdog


def is_stopped(state: str) -> bool:
    """A process the kernel will not run (stopped, traced, or in uninterruptible sleep): unambiguously hung."""
    return state in ("T", "t", "D")


def stopped_too_long(since: dict[int, int], states: dict[int, str], now: int, timeout_ns: int) -> list[int]:
    """The pids stopped (T/t) at every look for ``timeout_ns`` (pure). ``since`` (pid -> first seen stopped) is
    updated in place: a pid seen running again, or gone, is forgotten; SIGCONT before the timeout is no hang."""
    for pid in list(since):
        if pid not in states or states[pid] not in ("T", "t"):
            del since[pid]
    for pid, state in states.items():
        if state in ("T", "t"):
            since.setdefault(pid, now)
    return sorted(pid for pid, t in since.items() if now - t >= timeout_ns)


def pick_hung(stale: list[tuple[int, Any]], state_of: Any) -> tuple[int, Any] | None:
    """Which of the ranks whose step heartbeat is stale is the cause (pure but for ``state_of``).

    When one rank hangs, its peers soon block in the next collective and go stale too: killing all of them
    would throw away the replicas we recover from. A stopped (T/t) or uninterruptible (D) process is the
    culprit; otherwise, with several stale ranks, the one whose heartbeat stopped first.
    """
    if not stale:
        return None
    for item in stale:
        if is_stopped(state_of(item[1].pid)):
            return item
    return min(stale, key=lambda x: x[0])
