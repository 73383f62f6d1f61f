"""The participant half of a swap (tpassrun/swapper/__init__.py) against fakes: what each phase tells the local workers
(typed protocol commands) and what it reports, with no etcd, no process and no socket.

The fake slot table plays the workers: a paused rank told to ``Resume`` runs to the boundary and pauses there,
every command is recorded, and the replies a phase waits for are scripted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import types

import pytest

from tpassrun.channel import INT64_MAX, Field, WorkerPhase
from tpassrun.channel import protocol as P
from tpassrun.channel.slots import Slot, SlotState
from tpassrun.plan.swap import transfer_key as _transfer_key
from tpassrun.records import Phase, SlotRef, SwapKind, SwapPlan
from tpassrun.swapper import Swapper
from tpassrun.swapper.agentport import AgentPort, SwapSettings
from tpassrun.swapper.phases import Phases

NODE = "a"


@pytest.fixture(autouse=True)
def _stores_answer(monkeypatch):
    """The fakes' workers' store (10.0.0.1:29500) is no socket: a re-form's look at it answers "listening"."""
    async def answers(self, addr, port):
        return ""
    monkeypatch.setattr(Phases, "store_silent", answers)


class FakeSlots:
    """The swapper's view of its node's slot table; workers answer the way tpassrun.worker does."""

    def __init__(self, rows: list[tuple[int | None, str, WorkerPhase, int]]) -> None:
        self.slots = []
        self.cells: dict[tuple[int, Field], int] = {}
        for i, (rank, state, phase, step) in enumerate(rows):
            slot = Slot(index=i, rank=rank, state=SlotState(state), managed=True)
            slot.proc = types.SimpleNamespace(returncode=None, pid=100 + i)
            self.slots.append(slot)
            self.cells[(i, Field.PHASE)], self.cells[(i, Field.STEP)] = int(phase), step
        self.sent: list[tuple[int, P.Message]] = []
        self.replies: dict[int, list[P.Message]] = {}
        self.channel = None

    # the part of LocalSlots the swapper uses
    def active(self) -> list[Slot]:
        return [s for s in self.slots if s.state == SlotState.RUNNING]

    def set_run_until(self, slot: Slot, step: int) -> None:
        self.cells[(slot.index, Field.RUN_UNTIL)] = step

    def phase(self, slot: Slot) -> WorkerPhase:
        return WorkerPhase(self.cells[(slot.index, Field.PHASE)])

    def position(self, slot: Slot) -> tuple[WorkerPhase, int]:
        return self.phase(slot), self.field(slot, Field.STEP)

    def field(self, slot: Slot, f: Field) -> int:
        return self.cells.get((slot.index, f), 0)

    def send(self, slot: Slot, msg: P.Message) -> bool:
        assert isinstance(msg, tuple(P.COMMANDS.values())), msg     # only declared commands go to a worker
        P.decode_command(P.encode(msg))                             # and they survive the wire
        self.sent.append((slot.index, msg))
        if isinstance(msg, P.Resume):   # the worker runs on to run_until and pauses there
            self.cells[(slot.index, Field.STEP)] = self.cells[(slot.index, Field.RUN_UNTIL)]
            self.cells[(slot.index, Field.PHASE)] = int(WorkerPhase.PAUSED)
        return True

    async def expect(self, slot: Slot, kinds: tuple[type, ...], timeout: float, match=None):
        queue = self.replies.get(slot.index, [])
        while queue:
            msg = queue.pop(0)
            if isinstance(msg, kinds) and (match is None or match(msg)):
                return msg
        return None

    async def wait_ready(self, slot: Slot, timeout: float) -> bool:
        return True

    def drain(self, slot: Slot) -> None:
        pass

    def commands(self, index: int) -> list[P.Message]:
        return [m for i, m in self.sent if i == index]


def generation(number: int = 2, world_size: int = 2):
    member = types.SimpleNamespace(node_id=NODE, group_rank=0, addr="127.0.0.1")
    return types.SimpleNamespace(number=number, world_size=world_size, members=(member,), spare_nodes=(),
                                 member=lambda node: member if node == NODE else None)


def port(slots: FakeSlots, events: list) -> AgentPort:
    async def nothing(*_a):
        return None

    gen = generation()
    return AgentPort(node_id=NODE, addr="10.0.0.1", settings=SwapSettings(2, 1),
                     events=types.SimpleNamespace(write=lambda name, **f: events.append((name, f))),
                     rdzv=types.SimpleNamespace(key=lambda *p: "/p/" + "/".join(p), store=None, is_leader=False, generation=None),
                     slots=slots, generation=lambda: gen, spawned_generation=lambda: 2,
                     master=lambda: ("10.0.0.1", 29500), set_generation=lambda g: None, spawn_spare=nothing,
                     publish_status=nothing, post=lambda ev: None)


def plan(**kw) -> SwapPlan:
    """Rank 1 on slot 1 moves to the spare in slot 2, all on this node."""
    base = dict(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef(NODE, 1, 1),
                joiner=SlotRef(NODE, 2, 1), donor=None, phase=Phase.BOUNDARY, reason="ecc", nodes=(NODE,),
                boundary=6, history=(("pause", 1.0), ("boundary", 2.0)), secret="ab" * 32)
    return SwapPlan(**{**base, **kw})


def two_ranks_and_a_spare(step: int = 5, phase: WorkerPhase = WorkerPhase.PAUSED) -> FakeSlots:
    return FakeSlots([(0, "running", phase, step), (1, "running", phase, step), (None, "spare", WorkerPhase.SPARE, 0)])


def test_boundary_runs_every_rank_to_the_boundary_and_assigns_the_joiner_early():
    slots = two_ranks_and_a_spare()
    slots.replies[2] = [P.Listening(port=4000, swap_id="s-1")]
    events: list = []
    swapper = Swapper(port(slots, events))

    async def boundary():
        report = await swapper.phases.boundary(plan())
        early = await swapper.phases.early[1]          # the joiner, assigned while the ranks ran to the boundary
        return report, early

    report, early = asyncio.run(boundary())
    assert (report.ok, report.candidate) == (True, 6)
    assert slots.commands(0) == [P.Resume()] and slots.commands(1) == [P.Resume()]
    assert slots.field(slots.slots[0], Field.RUN_UNTIL) == 6
    (assign,) = slots.commands(2)
    assert isinstance(assign, P.Assign)
    assert assign.world == P.WorldSpec(rank=1, world_size=2, role_rank=1, role_world_size=2, group_rank=0,
                                       local_world_size=2, group_world_size=1)
    assert (assign.swap_id, assign.listen_host, assign.key) == ("s-1", "10.0.0.1", _transfer_key(plan()))
    assert early == ("10.0.0.1", 4000)
    assert ("swap_boundary_reached", {"swap_id": "s-1", "step": 6}) in events


def test_a_late_reply_to_an_earlier_attempt_is_never_paired_with_the_next():
    """Issue 27: a ``Listening`` carried the swap id but no attempt, so a reply the spare sent for attempt 0 (its
    listener long closed) could be taken for attempt 1's, and the sender sent to a dead port. Every reply now
    names its attempt; the agent takes only this attempt's."""
    slots = two_ranks_and_a_spare()
    slots.replies[2] = [P.Listening(port=4000, swap_id="s-1", attempt=0), P.Listening(port=4001, swap_id="s-0"),
                        P.Listening(port=4002, swap_id="s-1", attempt=1)]
    swapper = Swapper(port(slots, []))
    assert asyncio.run(swapper.phases.assign_joiner(plan(attempt=1))) == ("10.0.0.1", 4002)
    (assign,) = slots.commands(2)
    assert assign.attempt == 1

    slots.replies[2] = [P.Received(ok=False, swap_id="s-1", attempt=0, error="late"),
                        P.Received(ok=True, swap_id="s-1", attempt=1, nbytes=8)]
    got = asyncio.run(swapper.ranks.await_received(plan(attempt=1), slots.slots[2]))
    assert (got.ok, got.attempt) == (True, 1)


def test_a_plan_without_a_usable_secret_assigns_no_joiner():
    slots = two_ranks_and_a_spare()
    swapper = Swapper(port(slots, []))
    why = asyncio.run(swapper.phases.assign_joiner(plan(secret="not hex")))
    assert "no transfer secret" in why and slots.sent == []


def test_reform_sends_each_rank_its_world_the_joiner_the_leavers_and_the_leaver_away():
    slots = two_ranks_and_a_spare(step=6)
    slots.replies = {0: [P.Reformed(rank=0, world_size=2, generation=3, join_s=0.5)],
                     2: [P.Reformed(ok=True, rank=1, world_size=2, generation=3)]}
    events: list = []
    report = asyncio.run(Swapper(port(slots, events)).phases.reform(plan(phase=Phase.REFORM)))
    assert report.ok
    store = ("10.0.0.1", 29500, "/tpassrun/s-1/0/", 3)          # the generation after the plan's
    assert slots.commands(0) == [P.Reform(world=P.WorldSpec(rank=0, world_size=2).with_store(*store))]
    assert slots.commands(2) == [P.Reform(world=P.WorldSpec(
        rank=1, world_size=2, role_rank=1, role_world_size=2, group_rank=0, local_world_size=2,
        group_world_size=1).with_store(*store))]
    assert slots.commands(1) == [P.Exit(code=0)]               # the leaver goes (planned)
    assert [s.state for s in slots.slots] == [SlotState.RUNNING, SlotState.LEAVING, SlotState.RUNNING]
    assert (slots.slots[2].rank, slots.slots[1].rank) == (1, None)
    assert all(slots.field(s, Field.RUN_UNTIL) == INT64_MAX for s in (slots.slots[0], slots.slots[2]))
    assert ("swap_reform_timings", {"swap_id": "s-1", "ranks": {"0": {"join_s": 0.5}, "1": {}}}) in events


def test_an_unplanned_reform_rolls_the_survivors_back_and_retires_the_dead_slot():
    slots = two_ranks_and_a_spare(step=6, phase=WorkerPhase.FAILED)
    slots.slots[1].state = SlotState.DEAD
    slots.replies = {0: [P.Reformed(rank=0, world_size=2, generation=3)], 2: [P.Reformed(rank=1, world_size=2)]}
    unplanned = plan(kind=SwapKind.UNPLANNED, donor=SlotRef(NODE, 0, 0), phase=Phase.REFORM)
    report = asyncio.run(Swapper(port(slots, [])).phases.reform(unplanned))
    assert report.ok
    (reform,) = slots.commands(0)
    assert isinstance(reform, P.Reform) and reform.rollback
    assert slots.commands(1) == [] and slots.slots[1].state is SlotState.QUARANTINED


def test_a_re_form_at_a_store_that_does_not_answer_fails_before_any_rank_is_told_to_join(monkeypatch):
    """A rank told to join at a dead store blocks inside torch's TCPStore until its timeout, where no AbortJoin
    reaches it (a chaos re-form hung 120 s on the store of a node lost earlier): the participant looks first."""
    import socket

    monkeypatch.undo()
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()
    slots = two_ranks_and_a_spare(step=6)
    report = asyncio.run(Swapper(port(slots, [])).phases.reform(plan(phase=Phase.REFORM, store=dead)))
    assert not report.ok and f"the workers' store at 127.0.0.1:{dead[1]} does not answer" in report.error
    assert slots.sent == [] and [s.state for s in slots.slots] == [SlotState.RUNNING, SlotState.RUNNING,
                                                                   SlotState.SPARE]


def test_a_rank_that_does_not_rejoin_fails_the_phase_and_says_why():
    slots = two_ranks_and_a_spare(step=6)
    slots.replies = {0: [P.Reformed(ok=False, error="store unreachable")]}
    report = asyncio.run(Swapper(port(slots, [])).phases.reform(plan(phase=Phase.REFORM)))
    assert not report.ok and report.error == "rank 0 did not join the new world: store unreachable"


def test_send_tells_the_leaver_to_stream_and_checks_what_the_joiner_received():
    slots = two_ranks_and_a_spare(step=6)
    swapper = Swapper(port(slots, []))
    swapper.phases.transfers_seen.add(("s-1", 0))
    sending = plan(phase=Phase.SEND, joiner_addr=("10.0.0.1", 4000))
    swapper.phases.refuse_destination = _no_refusal                 # the registered-address check needs etcd
    slots.replies[2] = [P.Received(ok=True, swap_id="s-1", nbytes=10, seconds=0.1, checksum="c", step=6)]
    report = asyncio.run(swapper.phases.send(sending))
    assert report.ok and report.extra == {"nbytes": 10, "seconds": 0.1}
    (send,) = slots.commands(1)
    assert send == P.SendState(addr="10.0.0.1", port=4000, swap_id="s-1", key=_transfer_key(sending), rank=1,
                               replicated_only=False, without_sharded=False, rng=True, timeout=120.0)

    slots.replies[2] = [P.Received(ok=True, swap_id="s-1", step=5)]      # a state of the wrong step
    report = asyncio.run(swapper.phases.send(sending))
    assert not report.ok and "received the state of step 5" in report.error


def test_an_unplanned_joiner_gets_the_dead_ranks_light_snapshot_and_a_rejected_one_is_final():
    slots = two_ranks_and_a_spare(step=6)
    swapper = Swapper(port(slots, []))
    swapper.phases.transfers_seen.add(("s-1", 0))
    swapper.phases.refuse_destination = _no_refusal
    unplanned = plan(kind=SwapKind.UNPLANNED, donor=SlotRef(NODE, 0, 0), phase=Phase.SEND,
                     joiner_addr=("10.0.0.1", 4000), light_b64="AAAA")
    slots.replies[2] = [P.Received(ok=True, swap_id="s-1", step=6), P.LightOk(ok=False, step=4)]
    report = asyncio.run(swapper.phases.send(unplanned))
    assert slots.commands(2) == [P.Light(data="AAAA", step=6)]
    send = slots.commands(0)[0]
    assert isinstance(send, P.SendState) and send.replicated_only and not send.rng   # a donor: replicated state
    assert (report.ok, report.final) == (False, True) and "step 4" in report.error


def test_an_aborted_swap_resumes_paused_ranks_and_releases_the_spare():
    slots = two_ranks_and_a_spare(step=6)
    asyncio.run(Swapper(port(slots, [])).phases.abort(plan(phase=Phase.ABORTED)))
    assert slots.commands(0) == [P.Resume()] and slots.commands(1) == [P.Resume()]
    assert slots.commands(2) == [P.Abort()]
    assert all(slots.field(s, Field.RUN_UNTIL) == INT64_MAX for s in slots.slots)


def test_spares_are_told_how_much_to_reserve_once():
    slots = two_ranks_and_a_spare()
    slots.cells[(0, Field.STATE_BYTES)] = 1 << 20
    swapper = Swapper(port(slots, []))
    swapper.hint_spares()
    swapper.hint_spares()
    (reserve,) = slots.commands(2)
    assert isinstance(reserve, P.Reserve) and reserve.nbytes > 1 << 20


async def _no_refusal(_plan):
    return None



def test_a_plan_given_up_while_its_world_re_forms_stops_the_joining_ranks_and_resumes_nobody():
    """A rank died on its way into the new world: every local rank still joining is told to stop (AbortJoin), none
    is resumed (they have no process group); superseded, nothing restarts; given up for good, the group restarts."""
    history = (("pause", 1.0), ("boundary", 2.0), ("transfer", 3.0), ("send", 4.0), ("reform", 5.0), ("aborted", 6.0))
    for superseded in (True, False):
        slots = FakeSlots([(0, "running", WorkerPhase.RECONFIGURING, 6), (None, "quarantined", WorkerPhase.DONE, 6),
                           (1, "running", WorkerPhase.RECONFIGURING, 6)])
        slots.replies = {0: [P.Reformed(ok=False, error="join given up")], 2: [P.Reformed(ok=False)]}
        posted: list = []
        swapper = Swapper(dataclasses.replace(port(slots, []), post=posted.append))
        asyncio.run(swapper.phases.abort(plan(phase=Phase.ABORTED, history=history, superseded=superseded)))
        abort = P.AbortJoin(prefix="/tpassrun/s-1/0/")          # this world's only: never the next one's
        assert slots.commands(0) == [abort] and slots.commands(2) == [abort]
        assert not any(isinstance(m, P.Resume) for _i, m in slots.sent)
        assert slots.replies == {0: [], 2: []}                     # their answers taken: none is left for later
        assert len(posted) == (0 if superseded else 1)
        if posted:
            assert "could not be re-formed for the swap of rank 1" in posted[0].reason


def test_every_agent_follows_the_workers_store_a_swap_moved_even_one_that_took_no_part():
    """A node plan moved the workers' store (its node was lost) and re-formed without this node (a spare node
    that leads): it must know the new store, or its next plan names the lost node's dead one (bench/chaos.py, an
    agent SIGKILLed then a rank: the leader, which took no part, named the dead store and that re-form hung on it
    until the phase timeout)."""
    moved = []
    slots = FakeSlots([(None, "spare", WorkerPhase.SPARE, 0)])
    p = dataclasses.replace(port(slots, []), set_master=lambda addr, host: moved.append((addr, host)))
    swapper = Swapper(p)
    done = plan(id="n-b", kind=SwapKind.NODE, nodes=("c",), phase=Phase.DONE, store=("10.0.0.9", 4242),
                store_host="c", moves=(), history=(("pause", 1.0), ("done", 2.0)))

    async def follow():
        swapper.coordinator.kick = lambda: None
        await swapper._on_plan(done)
    asyncio.run(follow())
    assert moved == [(("10.0.0.9", 4242), "c")]


def test_the_epoch_is_the_last_restarts_generation_the_same_on_a_spare_node_that_joined_later():
    """A spare node that joined in generation 37 (its spawn generation) leads after the others died: the era's
    plans and deaths (generation >= 3, the last restart) are not stale to it, and its mirror copies carry the
    epoch every other agent's carry (a buddy refused a joiner's light copies as older than those it held)."""
    slots = FakeSlots([(None, "spare", WorkerPhase.SPARE, 0)])
    late = dataclasses.replace(port(slots, []), spawned_generation=lambda: 37, formed_generation=lambda: 3)
    assert late.epoch() == 3
    assert dataclasses.replace(late, formed_generation=None).epoch() == 37      # tests' ports: as before


def test_the_annotated_generation_is_the_latest_record_only_while_it_has_the_running_ones_number():
    """Which generation (swapper/agentport.py): the leader rewrites the running generation in place (lost nodes,
    spare nodes that joined) and the agent reads that through ``annotated()``; a record of a later generation is
    not the running one annotated (a restart or a commit not adopted yet): ``latest()`` still shows it."""
    slots = FakeSlots([(None, "spare", WorkerPhase.SPARE, 0)])
    base = port(slots, [])
    running, rewritten, later = generation(2), generation(2), generation(3)
    rdzv = types.SimpleNamespace(**{**vars(base.rdzv), "generation": None})
    p = dataclasses.replace(base, rdzv=rdzv, generation=lambda: running)
    assert p.latest() is None and p.annotated() is running       # the handle has read nothing yet
    rdzv.generation = rewritten
    assert p.latest() is rewritten and p.annotated() is rewritten
    rdzv.generation = later
    assert p.latest() is later and p.annotated() is running
    assert dataclasses.replace(p, generation=lambda: None).annotated() is None
