"""The agent's answer to a worker whose step raised an exception it cannot prove distributed (the effects around
the pure :func:`tpassrun.plan.failkind.cause_of`). A part of :class:`tpassrun.agent.Agent`.

The worker cannot tell from its exception whether a peer's failure caused it: torchtitan's functional collectives
raise gloo's "Connection reset by peer" from ``torch/_ops.py``, Megatron waits on a collective's handle in its own
file, any framework may wrap and re-raise. So it parks ``PENDING`` with its collectives left open and says
``Raised``; the agent, which sees the deaths on its node, the failure records and lost nodes of the others, the
peers parked ``FAILED`` here and a recovery under way, writes its ``Verdict`` into the worker's slot: a casualty
(it parks ``FAILED`` and waits for the recovery, as a failed collective does) or the root cause (it re-raises:
torchrun's path, its exit code and error file as torchrun's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from tpassrun.agent.state import AgentState, Started
from tpassrun.channel import Failed, Field, Raised, Slot, StepFailure, Verdict, WorkerPhase, worker_log_file
from tpassrun.plan import CAUSE_GRACE_S, Around, Cause, cause_of, classify_death, interrupted_by
from tpassrun.records import ExceptionCause, Failure, Keys, StepInterrupted, emit, load
from tpassrun.rendezvous import Generation
from tpassrun.swapper import annotated

log = logging.getLogger("tpassrun.agent")

POLL_S = 0.05          # how often the facts on this node are looked at again while a worker waits
RECORDS_EVERY_S = 0.25  # ... and the other nodes' failure records in etcd (a node of its own only: never)


class CauseJudge:
    """Agent's side of a worker parked ``PENDING``: gathers :class:`Around`, asks :func:`cause_of`, answers."""

    def __init__(self, state: AgentState, node: Started) -> None:
        self._state = state
        self._node = node
        self._deaths_seen: list[tuple[int, int | None, str]] = []   # (generation, rank, why)
        self._judging: set[asyncio.Future[None]] = set()            # workers waiting for their exception's cause

    def note_death(self, gen: Generation, slot: Slot, code: int) -> None:
        """A worker holding a rank died (``code`` != 0): evidence, for the rest of this world, that a failure came
        first. Kept with the world's generation: a recovery commits the next one, and older deaths stop counting."""
        st = self._state
        _kind, why = classify_death(code, self._node.slots.phase(slot))
        self._deaths_seen.append(((st.generation or gen).number, slot.rank, f"rank {slot.rank}'s death ({why})"))

    def on_raised(self, gen: Generation, slot: Slot, msg: Raised) -> None:
        task = asyncio.ensure_future(self._judge(gen, slot, slot.proc, msg))
        self._judging.add(task)
        task.add_done_callback(self._judging.discard)

    def on_failed(self, gen: Generation, slot: Slot, msg: Failed) -> None:
        """A survivor's collective failed: its own text of it went to its log file (tpassrun/worker/failure.py); the
        console's line (``step_interrupted``) says what interrupted it, once the death, lost node or recovery
        behind it is known here (at most :data:`~tpassrun.plan.failkind.CAUSE_GRACE_S`). A casualty's line was said
        by ``exception_cause``."""
        if msg.failure == StepFailure.CASUALTY.value or slot.proc is None:
            return
        task = asyncio.ensure_future(self._say_interrupted(gen, slot, slot.proc, msg))
        self._judging.add(task)
        task.add_done_callback(self._judging.discard)

    async def _say_interrupted(self, gen: Generation, slot: Slot, proc: Any, msg: Failed) -> None:
        st = self._state
        t0, rank = time.monotonic(), slot.rank
        records: tuple[str, ...] = ()
        read_at = -1.0
        by = ""
        while True:
            waited = time.monotonic() - t0
            if self._other_nodes(gen) and waited - read_at >= RECORDS_EVERY_S:
                read_at = waited
                records = await self._failure_records(gen, slot)
            by = interrupted_by(self._around(gen, slot, waited, records, ()))
            if by or waited >= CAUSE_GRACE_S:
                break
            if slot.proc is not proc or proc.returncode is not None:
                return          # it left meanwhile (the failure path, a teardown): its exit says what happened
            await asyncio.sleep(POLL_S)
        emit(st.events, StepInterrupted(slot=slot.index, rank=rank, step=msg.step, by=by, error=msg.error[:300],
                                        error_type=msg.error_type, failure=msg.failure,
                                        log=worker_log_file(getattr(proc, "error_file", ""))))

    async def _judge(self, gen: Generation, slot: Slot, proc: Any, msg: Raised) -> None:
        t0 = time.monotonic()
        self._node.swapper.probe_agents()       # a node whose agent is gone is declared lost now, not at its lease's end
        silent = asyncio.ensure_future(self._silent_nodes(gen))
        records: tuple[str, ...] = ()
        read_at = -1.0
        try:
            while slot.proc is proc and proc.returncode is None and self._node.slots.phase(slot) == WorkerPhase.PENDING:
                waited = time.monotonic() - t0
                if self._other_nodes(gen) and waited - read_at >= RECORDS_EVERY_S:
                    read_at = waited
                    records = await self._failure_records(gen, slot)
                around = self._around(gen, slot, waited, records, silent.result() if silent.done() else ())
                cause, why = cause_of(around)
                if cause is not Cause.PENDING:
                    self._answer(slot, msg, cause, why, waited)
                    return
                await asyncio.sleep(POLL_S)
        finally:
            silent.cancel()

    def _answer(self, slot: Slot, msg: Raised, cause: Cause, why: str, waited: float) -> None:
        st = self._state
        assert self._node.slots.channel is not None
        verdict = Verdict.CASUALTY if cause is Cause.CASUALTY else Verdict.ROOT_CAUSE
        self._node.slots.channel.set(slot.index, Field.VERDICT, verdict)
        emit(st.events, ExceptionCause(slot=slot.index, rank=slot.rank, step=msg.step, cause=cause.value, why=why,
                                       error=msg.error[:300], error_type=msg.error_type, seconds=round(waited, 3)))

    def _around(self, gen: Generation, slot: Slot, waited: float, records: tuple[str, ...],
                silent: tuple[str, ...]) -> Around:
        st = self._state
        cur = st.generation or gen
        dead = tuple(why for g, rank, why in self._deaths_seen if g == cur.number and rank != slot.rank) + records
        lost = tuple(annotated(cur, self._node.rdzv.generation).lost)   # lost nodes are annotations: written in place
        failed = tuple(s.rank for s in self._node.slots.active() if s is not slot and s.rank is not None
                       and self._node.slots.phase(s) == WorkerPhase.FAILED)
        return Around(waited_s=waited, dead=dead, lost_nodes=lost, failed_peers=failed,
                      recovering=self._node.swapper.recovering, silent_nodes=silent,
                      lease_s=float(self._node.rdzv.settings.lease_seconds))

    def _other_nodes(self, gen: Generation) -> list[str]:
        st = self._state
        cur = st.generation or gen
        return [m.node_id for m in cur.members if m.node_id != st.node_id and m.node_id not in cur.lost]

    async def _failure_records(self, gen: Generation, slot: Slot) -> tuple[str, ...]:
        """Other ranks' deaths of this world other nodes recorded (``failures/``; an outage: none known)."""
        st = self._state
        cur = st.generation or gen
        keys = Keys(self._node.rdzv.key(""))
        try:
            docs = await asyncio.wait_for(self._node.rdzv.store.get_prefix_json(keys.family("failures")), 2.0)
        except Exception as exc:  # noqa: BLE001 - etcd unreachable: the grace decides
            log.debug("reading failure records: %s", exc)
            return ()
        out = []
        for key, doc, rev in docs:
            f = load(Failure.from_json, key, doc, rev)
            if f is not None and f.generation >= cur.number and f.rank != slot.rank:
                out.append(f"rank {f.rank}'s death on node {f.node} (exit code {f.code})")
        return tuple(out)

    async def _silent_nodes(self, gen: Generation) -> tuple[str, ...]:
        """Member nodes whose agent does not answer (cut off or down: their lease decides)."""
        peers = self._other_nodes(gen)
        with contextlib.suppress(Exception):
            answers = await asyncio.gather(*(self._node.mirror.reach(n) for n in peers))
            return tuple(n for n, a in zip(peers, answers) if a == "silent")
        return ()
