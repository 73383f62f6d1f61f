"""The coordinator's triage as a pure function (tpassrun/plan/triage.py), and the participant against fakes."""

from __future__ import annotations

import asyncio
import dataclasses
import types

from tpassrun.channel import Field, WorkerPhase
from tpassrun.plan.swap import ClusterView, SlotView
from tpassrun.plan.triage import CasPlan, CreatePlan, PutFallback, PutTaint, Say, Seen, triage
from tpassrun.records import HANDLED_RESTART, Failure, Phase, Report, SlotRef, SwapKind, SwapPlan, Taint, TaintEffect
from tpassrun.swapper import Swapper
from tpassrun.swapper.agentport import AgentPort, FallbackRequested, SwapSettings

NOW = 1000.0


def view(*slots: SlotView, members=("a", "b")) -> ClusterView:
    return ClusterView(generation=2, members=members, spare_nodes=(), slots=slots)


RUNNING = (SlotView("a", 0, 0, "running", True, 9), SlotView("a", 1, 1, "running", True, 9),
           SlotView("b", 0, 2, "running", True, 9))
SPARE = SlotView("b", 1, None, "spare", True)


def seen(**kw) -> Seen:
    base = dict(now=NOW, epoch=2, plans=(), reports=(), failures=(), taints=(),
                view=view(*RUNNING, SPARE))
    return Seen(**{**base, **kw})


def taint(tid="t1", **kw) -> Taint:
    base = dict(id=tid, effect=TaintEffect.MIGRATE, reason="ecc", source="tpassctl", node_id="a", slot=1, rank=1)
    return Taint(**{**base, **kw})


def kinds(result) -> list[str]:
    return [type(a).__name__ for a in result.actions]


def test_nothing_to_do_is_no_action():
    assert triage(seen()).actions == ()


def test_a_taint_becomes_a_plan_to_the_nearest_spare_and_is_announced_once():
    result = triage(seen(taints=(taint(),)))
    assert kinds(result) == ["Say", "CreatePlan"]
    create = result.actions[1]
    assert isinstance(create, CreatePlan) and create.taint == taint()
    assert create.plan.leaver == SlotRef("a", 1, 1) and create.plan.joiner == SlotRef("b", 1, 1)
    assert result.received == {"t1"}
    again = triage(seen(taints=(taint(),), received_said=frozenset({"t1"})))
    assert kinds(again) == ["CreatePlan"]


def test_exclude_and_handled_taints_are_left_alone_and_health_taints_are_not_announced():
    taints = (taint("x", effect=TaintEffect.EXCLUDE), taint("h", handled_by="s-9"),
              taint("g", source="health", handled_by="health-kill"))
    result = triage(seen(taints=taints))
    assert [a.fields["id"] for a in result.actions if isinstance(a, Say)] == ["x", "h"]
    assert not any(isinstance(a, CreatePlan) for a in result.actions)


def test_a_taint_without_a_spare_waits_and_says_so_once():
    no_spare = view(*RUNNING)
    result = triage(seen(view=no_spare, taints=(taint(),), received_said=frozenset({"t1"})))
    assert kinds(result) == ["Say", "PutTaint"] and result.said == {"t1"}
    assert result.actions[1].taint.state.startswith("wait")
    quiet = triage(seen(view=no_spare, taints=(taint(),), received_said=frozenset({"t1"}),
                        waiting_said=frozenset({"t1"})))
    assert quiet.actions == ()


def test_an_unmanaged_rank_restarts_the_group_without_its_slot():
    unmanaged = view(SlotView("a", 0, 0, "running", False, 9), SlotView("a", 1, 1, "running", False, 9), SPARE)
    result = triage(seen(view=unmanaged, taints=(taint(),), received_said=frozenset({"t1"})))
    assert kinds(result) == ["Say", "PutTaint", "PutTaint", "RestartGroup"]
    marked = result.actions[2]
    assert isinstance(marked, PutTaint) and marked.taint.handled_by == HANDLED_RESTART and marked.taint.slot == 1


def test_a_worker_failure_becomes_an_unplanned_swap_from_a_replica():
    dead = Failure(node="a", slot=1, rank=1, code=-9, step=9, light=True, generation=2)
    dead_view = view(RUNNING[0], SlotView("a", 1, 1, "dead", True, 9), RUNNING[2], SPARE)
    result = triage(seen(view=dead_view, failures=(("a-1", dead),), taints=(taint(),), received_said=frozenset({"t1"})))
    assert kinds(result) == ["PutFailure", "Say", "CreatePlan"]     # one thing per tick: the taint waits
    plan = result.actions[2].plan
    assert plan.kind is SwapKind.UNPLANNED and plan.id == "u-a-1-2" and plan.donor is not None
    assert result.actions[0].failure.handled == "plan"


def test_a_failure_takes_its_state_from_its_declared_replica_or_falls_back_at_once():
    dead = Failure(node="a", slot=1, rank=1, code=-9, step=9, light=True, generation=2, replicas=(1,),
                   alone="ZeRO-1 keeps each rank's partition on that rank only")
    dead_view = view(RUNNING[0], SlotView("a", 1, 1, "dead", True, 9), RUNNING[2], SPARE)
    result = triage(seen(view=dead_view, failures=(("a-1", dead),)))
    assert kinds(result)[:2] == ["PutFailure", "Say"] and "CreatePlan" in kinds(result)
    said = result.actions[1].fields
    assert said["action"] == "fallback" and said["reason"].startswith("rank 1 died and no other rank holds its "
                                                                       "state: ZeRO-1 keeps")
    assert result.actions[2].plan.phase is Phase.ABORTED      # the dead rank's agent restarts the group


def test_a_failure_with_no_spare_falls_back():
    dead = Failure(node="a", slot=1, rank=1, code=1, step=9, light=True, generation=2)
    result = triage(seen(view=view(*RUNNING), failures=(("a-1", dead),)))
    assert kinds(result) == ["PutFailure", "Say", "PutFallback"]
    fallback = result.actions[2]
    assert isinstance(fallback, PutFallback) and fallback.node == "a" and fallback.fallback.slot == 1


def test_a_failure_from_before_the_last_restart_is_marked_stale_and_the_taints_go_on():
    old = Failure(node="a", slot=1, rank=1, code=1, step=9, light=True, generation=1)
    result = triage(seen(failures=(("a-1", old),), taints=(taint(),), received_said=frozenset({"t1"})))
    assert kinds(result) == ["PutFailure", "CreatePlan"]
    assert result.actions[0].failure.handled == "stale"


def plan(**kw) -> SwapPlan:
    base = dict(id="s-1", kind=SwapKind.PLANNED, generation=2, leaver=SlotRef("a", 1, 1), joiner=SlotRef("b", 1, 1),
                donor=None, phase=Phase.PAUSE, reason="ecc", nodes=("a", "b"), history=(("pause", NOW - 1.0),))
    return SwapPlan(**{**base, **kw})


def test_an_active_plan_advances_when_every_report_is_in_and_blocks_new_work():
    reports = (Report(node="a", phase=Phase.PAUSE, candidate=9), Report(node="b", phase=Phase.PAUSE, candidate=10))
    result = triage(seen(plans=((plan(), 7),), reports=reports, taints=(taint("t2"),)))
    assert kinds(result) == ["Say", "CasPlan"]      # the new taint is announced, and queues behind the plan
    cas = result.actions[1]
    assert isinstance(cas, CasPlan) and cas.revision == 7 and cas.new.phase is Phase.BOUNDARY and cas.new.boundary == 10
    assert triage(seen(plans=((plan(), 7),), reports=reports[:1])).actions == ()     # still waiting for b


def test_a_plan_from_before_the_last_restart_is_aborted_quietly():
    result = triage(seen(plans=((plan(generation=1), 3),)))
    assert kinds(result) == ["CasPlan"]
    assert result.actions[0].decision is None and result.actions[0].new.phase is Phase.ABORTED


# ---------------------------------------------------------------------------------------------- participant
class FakeSlots:
    """The swapper's view of the local slot table: phases and steps in a dict instead of shared memory."""

    def __init__(self, rows):
        self.slots = [types.SimpleNamespace(index=i, rank=r, state="running", alive=True, managed=True)
                      for i, (r, _ph, _st) in enumerate(rows)]
        self.cells = {(i, Field.PHASE): int(ph) for i, (_r, ph, _st) in enumerate(rows)}
        self.cells.update({(i, Field.STEP): st for i, (_r, _ph, st) in enumerate(rows)})
        self.run_until: dict[int, int] = {}
        self.channel = None

    def active(self):
        return [s for s in self.slots if s.state == "running"]

    def set_run_until(self, slot, step):
        self.run_until[slot.index] = step

    def phase(self, slot):
        return WorkerPhase(self.cells[(slot.index, Field.PHASE)])

    def position(self, slot):
        return self.phase(slot), self.field(slot, Field.STEP)

    def field(self, slot, f):
        return self.cells.get((slot.index, f), 0)


def port(slots, posted) -> AgentPort:
    async def nothing(*_a):
        return None
    events = types.SimpleNamespace(write=lambda *a, **k: None)
    return AgentPort(node_id="a", addr="127.0.0.1", settings=SwapSettings(2, 1), events=events,
                     rdzv=types.SimpleNamespace(key=lambda *p: "/p/" + "/".join(p), store=None, is_leader=False, generation=None),
                     slots=slots, generation=lambda: None, spawned_generation=lambda: 2, master=lambda: ("", 0),
                     set_generation=lambda g: None, spawn_spare=nothing, publish_status=nothing, post=posted.append)


def test_the_participant_stops_its_ranks_and_reports_the_earliest_common_boundary():
    slots = FakeSlots([(0, WorkerPhase.PAUSED, 5), (1, WorkerPhase.PAUSED, 6)])
    swapper = Swapper(port(slots, []))
    report = asyncio.run(swapper.phases.pause(plan()))
    assert slots.run_until == {0: 0, 1: 0}                  # every local rank told to stop at its next step
    assert (report.ok, report.candidate, report.steps) == (True, 6, (5, 6))


def test_an_aborted_unplanned_recovery_asks_the_agent_for_a_fallback():
    slots = FakeSlots([(0, WorkerPhase.RUNNING, 5), (1, WorkerPhase.FAILED, 5)])
    slots.slots[1].state = "dead"
    sent = []
    slots.send = lambda slot, kind, **f: sent.append((slot.index, kind))
    posted: list = []
    swapper = Swapper(port(slots, posted))
    aborted = dataclasses.replace(plan(kind=SwapKind.UNPLANNED, donor=SlotRef("a", 0, 0)), phase=Phase.ABORTED)
    asyncio.run(swapper.phases.abort(aborted))
    assert posted == [FallbackRequested("rank 1 cannot be recovered live: its recovery was aborted", slots.slots[1],
                                        free=False)]


def test_a_second_taint_of_a_rank_that_already_left_its_slot_is_coalesced_not_migrated_again():
    """A taint storm (or tpassctl twice, or health and an operator) tainted rank 1 on a/1 twice. The first taint's
    swap moved it to b/1; the second was then planned as a new migration of rank 1, off its new, healthy slot.
    It is now marked handled by the swap that moved the rank (said once), and the tainted slot stays out."""
    done = plan(phase=Phase.DONE, history=(("pause", NOW - 2), ("done", NOW)))
    moved = view(SlotView("a", 0, 0, "running", True, 9), SlotView("b", 1, 1, "running", True, 9),
                 SlotView("b", 0, 2, "running", True, 9), SlotView("a", 2, None, "spare", True))
    second = taint("t2", time=NOW - 5)
    result = triage(seen(view=moved, plans=((done, 3),), taints=(taint("t1", handled_by=done.id), second),
                         received_said=frozenset({"t1", "t2"})))
    assert kinds(result) == ["Say", "PutTaint"], result.actions
    assert result.actions[0].event == "taint_coalesced"
    assert result.actions[1].taint.handled_by == done.id and result.actions[1].taint.state.startswith("coalesced")
    # the status not yet showing the move: the done swap alone says the rank left that slot
    stale = triage(seen(plans=((done, 3),), taints=(second,), received_said=frozenset({"t2"})))
    assert kinds(stale) == ["Say", "PutTaint"] and stale.actions[1].taint.handled_by == done.id
    # no swap known (another agent's recovery, a restart): the rank runs elsewhere now
    elsewhere = triage(seen(view=moved, taints=(second,), received_said=frozenset({"t2"})))
    assert kinds(elsewhere) == ["Say", "PutTaint"] and elsewhere.actions[1].taint.handled_by == "coalesced"
    # a taint made after that swap, of the rank where it runs now, is a new one
    fresh = taint("t3", node_id="b", slot=1, time=NOW + 5)
    assert kinds(triage(seen(view=moved, plans=((done, 3),), taints=(fresh,),
                             received_said=frozenset({"t3"})))) == ["CreatePlan"]


def test_a_storm_of_taints_is_one_plan_at_a_time_and_a_rank_without_a_spare_waits_saying_so_once():
    """Three ranks tainted at once with one spare: one plan; while it runs nothing else is planned; once done, the
    next rank has no spare left and waits, said once, and stays quiet at every later look (no livelock)."""
    taints = (taint("t1"), taint("t2", node_id="a", slot=0, rank=0), taint("t3", node_id="b", slot=0, rank=2))
    first = triage(seen(taints=taints))
    assert kinds(first) == ["Say", "Say", "Say", "CreatePlan"] and first.actions[3].taint.id == "t1"
    assert first.received == {"t1", "t2", "t3"}      # every arrival said at once, the queued ones too
    assert triage(seen(plans=((plan(), 3),), taints=taints, received_said=first.received)).actions == ()
    done = plan(phase=Phase.DONE, history=(("pause", NOW), ("done", NOW + 1)))
    after = view(SlotView("a", 0, 0, "running", True, 9), SlotView("b", 1, 1, "running", True, 9),
                 SlotView("b", 0, 2, "running", True, 9))
    rest = (taint("t1", handled_by=done.id), *taints[1:])
    waiting = triage(seen(view=after, plans=((done, 3),), taints=rest, received_said=first.received))
    assert [a.event for a in waiting.actions if isinstance(a, Say)] == ["swap_waiting", "swap_waiting"]
    assert waiting.said == {"t2", "t3"}
    marked = [a.taint for a in waiting.actions if isinstance(a, PutTaint)]
    quiet = triage(seen(view=after, plans=((done, 3),), taints=(rest[0], *marked), received_said=first.received,
                        waiting_said=waiting.said))
    assert quiet.actions == ()
