"""The hang watchdog (tpassrun/agent/tasks.py): a process the kernel keeps stopped is found in any phase.

bench/chaos.py found a SIGSTOPped worker that the watchdog never flagged: it looked only at running workers'
heartbeats, and not at all while a swap ran, so a rank stopped while paused, a stopped joiner or spare, or a rank
stopped during another node's recovery waited until someone sent SIGCONT. Real processes, really stopped; the
slot table and its shared-memory channel are the agent's own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import types

import pytest

from tpassrun.agent.tasks import GenerationTasks, _proc_state, stopped_too_long
from tpassrun.channel import Field, WorkerPhase
from tpassrun.channel.slots import LocalSlots, SlotState

pytestmark = pytest.mark.timeout(60)


def test_a_pid_stopped_at_every_look_for_the_timeout_is_due_and_sigcont_forgives():
    since: dict[int, int] = {}
    assert stopped_too_long(since, {1: "T", 2: "S", 3: "t"}, 0, 10) == []
    assert since == {1: 0, 3: 0}
    assert stopped_too_long(since, {1: "T", 2: "T", 3: "R"}, 5, 10) == []       # 3 was continued: forgotten
    assert stopped_too_long(since, {1: "T", 2: "T", 3: "T"}, 10, 10) == [1]      # 2 and 3 restart their count
    assert stopped_too_long(since, {2: "T", 3: "T"}, 15, 10) == [2]              # 1 is gone: forgotten
    assert 1 not in since and since[3] == 10


class _Proc:
    """What the watchdog uses of procs.WorkerProcess, around a real process in its own session."""

    def __init__(self) -> None:
        self.p = subprocess.Popen(["sleep", "600"], start_new_session=True)
        self.pid = self.p.pid

    @property
    def returncode(self) -> int | None:
        return self.p.poll()

    def signal_group(self, sig: int) -> bool:
        try:
            os.killpg(self.pid, sig)
            return True
        except ProcessLookupError:
            return False


class _Agent:
    """The agent state the watchdog reads (GenerationTasks holds it: AgentState, and Started: its slots, swapper,
    rendezvous, mirror and health daemon), the store's standby, and the part."""

    def __init__(self, slots: LocalSlots, hang_timeout: float) -> None:
        self.slots = slots
        self.cfg = types.SimpleNamespace(hang_timeout=hang_timeout)
        self.swapper = types.SimpleNamespace(busy=True)      # a swap (or another node's recovery) runs
        self.node_id = self.generation = self.rdzv = self.mirror = None
        self.health = types.SimpleNamespace(link=None)      # no link watch: nothing explains a stall
        self.said: list[dict] = []
        self.events = types.SimpleNamespace(write=lambda name, **kw: self.said.append({"event": name, **kw}))
        self._standby_store = None                          # WorkersStore.standby: a test that reaches it sets it
        self.tasks = GenerationTasks(self, self, types.SimpleNamespace(standby=lambda: self._standby_store()))


async def _stopped(proc: _Proc) -> None:
    os.kill(proc.pid, signal.SIGSTOP)
    while _proc_state(proc.pid) != "T":
        await asyncio.sleep(0.01)


def test_stopped_processes_are_killed_whatever_their_phase_and_during_a_swap():
    """A rank stopped while paused in a swap, a stopped warm spare and a stopped joiner (a spare being handed a
    rank) are each killed once stopped for --hang-timeout, while ``swapper.busy``; a worker stopped for less
    than that and continued is left alone. (bench/chaos.py: a rank stopped while paused was never found, and the
    job waited until the harness sent SIGCONT; a stopped joiner or donor held a swap for its 120 s phase timeout.)"""

    async def go() -> None:
        slots = await LocalSlots(2, 2, on_message=lambda s, m: None).open()
        procs = [_Proc() for _ in slots.slots]
        try:
            paused, spare, joiner, blip = slots.slots
            for s, p in zip(slots.slots, procs):
                s.proc, s.managed = p, True
            paused.state, paused.rank = SlotState.RUNNING, 0
            slots.channel.set(paused.index, Field.PHASE, int(WorkerPhase.PAUSED))
            blip.state, blip.rank = SlotState.RUNNING, 1
            slots.channel.set(blip.index, Field.PHASE, int(WorkerPhase.RUNNING))
            spare.state = joiner.state = SlotState.SPARE
            slots.channel.set(spare.index, Field.PHASE, int(WorkerPhase.SPARE))
            slots.channel.set(joiner.index, Field.PHASE, int(WorkerPhase.TRANSFERRING))
            for p in procs[:3]:
                await _stopped(p)
            agent = _Agent(slots, hang_timeout=10.0)
            since: dict[int, int] = {}
            now = 1_000_000_000
            assert not agent.tasks._kill_stopped(since, now, 10**10)     # seen stopped: the count starts
            await _stopped(procs[3])
            os.kill(procs[3].pid, signal.SIGCONT)
            assert agent.tasks._kill_stopped(since, now + 10**10, 10**10)
            for p in procs[:3]:
                assert p.p.wait() == -signal.SIGKILL
            assert procs[3].returncode is None
            got = {(e["slot"], e["rank"], e["role"], e["phase"], e["what"], e["proc_state"]) for e in agent.said}
            assert got == {(0, 0, "running", "paused", "stopped", "T"), (1, None, "spare", "spare", "stopped", "T"),
                           (2, None, "spare", "transferring", "stopped", "T")}, agent.said
            assert all(e["swap"] is True and e["seconds"] == 10.0 for e in agent.said)
        finally:
            for p in procs:
                p.signal_group(signal.SIGKILL)
                p.p.wait()
            await slots.close()

    asyncio.run(go())


def test_the_watchdog_loop_kills_a_stopped_spare_while_a_swap_runs():
    """The loop itself (not only its scan): before, it skipped every poll while ``swapper.busy`` and looked at
    running workers only, so this spare stayed stopped for ever."""

    async def go() -> None:
        slots = await LocalSlots(0, 1, on_message=lambda s, m: None).open()
        proc = _Proc()
        spare = slots.slots[0]
        spare.proc, spare.managed, spare.state = proc, True, SlotState.SPARE
        slots.channel.set(spare.index, Field.PHASE, int(WorkerPhase.SPARE))
        agent = _Agent(slots, hang_timeout=0.2)
        task = asyncio.ensure_future(agent.tasks.hang_watchdog())
        try:
            await _stopped(proc)
            while proc.returncode is None:      # bounded by the test's timeout
                await asyncio.sleep(0.05)
            assert proc.returncode == -signal.SIGKILL
            assert [(e["event"], e["slot"], e["role"], e["what"]) for e in agent.said] == [
                ("hang_detected", 0, "spare", "stopped")]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            proc.signal_group(signal.SIGKILL)
            proc.p.wait()
            await slots.close()

    asyncio.run(go())


def test_ranks_stale_on_a_silent_node_are_held_for_its_lease_then_the_watchdog_acts_as_before():
    """A node cut off from the network blocks this node's ranks in a collective without failing anything: their
    heartbeats go stale with nothing stopped here. While a member node does not answer, the watchdog leaves them
    alone (said once) for that node's lease and a --hang-timeout more: the lost node's plan breaks them out when
    the lease ends (bench/chaos.py: a node holding 3 of 4 ranks was cut off, the watchdog killed the 4th, the only
    survivor, and with no replica left the group restarted). A peer that answers holds nothing back."""
    from tpassrun.rendezvous import Generation, GenState, Member

    async def go(answer: str) -> tuple[list[dict], float]:
        slots = await LocalSlots(1, 0, on_message=lambda s, m: None).open()
        proc = _Proc()
        rank0 = slots.slots[0]
        rank0.proc, rank0.managed, rank0.state, rank0.rank = proc, True, SlotState.RUNNING, 0
        slots.channel.set(rank0.index, Field.PHASE, int(WorkerPhase.RUNNING))
        slots.channel.set(rank0.index, Field.HEARTBEAT_NS, 1)          # stale since long ago
        agent = _Agent(slots, hang_timeout=0.2)
        agent.swapper = types.SimpleNamespace(busy=False)
        agent.node_id = "a"
        gen = Generation(number=3, state=GenState.ACTIVE, members=(Member("a", 0, "h", 1, 0), Member("b", 1, "h", 1, 1)),
                         world_size=2)
        agent.generation = gen
        agent.rdzv = types.SimpleNamespace(generation=gen, settings=types.SimpleNamespace(lease_seconds=1))
        agent.mirror = types.SimpleNamespace(reach=lambda node: _answer(answer))

        async def standby() -> None:
            agent.said.append({"event": "standby"})
        agent._standby_store = standby
        task = asyncio.ensure_future(agent.tasks.hang_watchdog())
        t0 = asyncio.get_running_loop().time()
        try:
            while proc.returncode is None:      # bounded by the test's timeout
                await asyncio.sleep(0.02)
            return agent.said, asyncio.get_running_loop().time() - t0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            proc.signal_group(signal.SIGKILL)
            proc.p.wait()
            await slots.close()

    said, _ = asyncio.run(go("silent"))
    events = [e["event"] for e in said if e["event"] != "standby"]
    assert events == ["hang_held", "hang_detected"], said
    held = said[[e["event"] for e in said].index("hang_held")]
    assert held["silent"] == ["b"] and held["ranks"] == [0] and held["lease_s"] == 1
    said, _ = asyncio.run(go("up"))
    assert [e["event"] for e in said if e["event"] != "standby"] == ["hang_detected"], said


async def _answer(what: str) -> str:
    return what


def test_a_worker_asking_whose_fault_its_exception_is_holds_the_watchdog_back():
    """A rank parked PENDING (tpassrun/agent/cause.py) keeps its collectives open: its peers block on it and go stale. Killing
    one would make the waiting rank a casualty of a death the watchdog caused; the watchdog waits for the verdict."""
    async def go() -> list[dict]:
        slots = await LocalSlots(2, 0, on_message=lambda s, m: None).open()
        peer, asking = _Proc(), _Proc()
        for index, (proc, phase) in enumerate(((peer, WorkerPhase.RUNNING), (asking, WorkerPhase.PENDING))):
            s = slots.slots[index]
            s.proc, s.managed, s.state, s.rank = proc, True, SlotState.RUNNING, index
            slots.channel.set(s.index, Field.PHASE, int(phase))
            slots.channel.set(s.index, Field.HEARTBEAT_NS, 1)          # stale since long ago
        agent = _Agent(slots, hang_timeout=0.1)
        agent.swapper = types.SimpleNamespace(busy=False)
        agent.generation = None                                  # one node: no peer node to wait for
        agent.rdzv = types.SimpleNamespace(generation=None)

        async def standby() -> None:
            pass
        agent._standby_store = standby
        task = asyncio.ensure_future(agent.tasks.hang_watchdog())
        try:
            await asyncio.sleep(3.0)           # past REMOTE_HANG_GRACE_S: it would have killed by now
            assert peer.returncode is None and asking.returncode is None, agent.said
            slots.channel.set(1, Field.PHASE, int(WorkerPhase.FAILED))     # the verdict: it parks FAILED
            while peer.returncode is None:      # bounded by the test's timeout
                await asyncio.sleep(0.02)
            return agent.said
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for proc in (peer, asking):
                proc.signal_group(signal.SIGKILL)
                proc.p.wait()
            await slots.close()

    said = asyncio.run(go())
    assert [e["event"] for e in said] == ["hang_detected"] and said[0]["rank"] == 0, said
