"""AgentHealth: the pure taint decision, and the daemon against a real etcd with a FileSensor.

The agent is a small stand-in (real EtcdStore, slots as plain objects, a real EventLog), so these tests
need no worker processes; tests/test_health_e2e.py runs the real thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import types
from typing import Any

import pytest

from tpassrun.agent import healthd
from tpassrun.agent.healthd import AgentHealth, SlotInfo, TaintOp, WrittenTaint, decide, taint_id
from tpassrun.channel import Field
from tpassrun.channel.slots import SlotState
from tpassrun.health import HealthVerdict, Status, TaintEffect
from tpassrun.ops.events import EventLog
from tpassrun.rendezvous import EtcdConfig, EtcdStore

NODE = "node-a"
ECC = "ecc_uncorrected_volatile"


# ---------------------------------------------------------------- pure decisions

def verdict(device: str, effect: TaintEffect = TaintEffect.MIGRATE, status: Status | None = None,
            metric: str | None = ECC, reason: str = "uncorrected ECC: +3 > 0") -> HealthVerdict:
    if status is None:
        status = Status.HEALTHY if effect is TaintEffect.NONE else (
            Status.FAILING if effect is TaintEffect.FAIL else Status.DEGRADED)
    return HealthVerdict(device, status, effect, reason, metric, 0.0)


RUNNING = SlotInfo(1, 1, SlotState.RUNNING)
SPARE = SlotInfo(4, None, SlotState.SPARE)


def test_migrate_on_a_running_slot_writes_a_taint_for_its_rank():
    action = decide(verdict("gpu1"), RUNNING, [], node_id=NODE, now_wall=123.0)
    assert action.op is TaintOp.WRITE and action.kill_slot is None
    doc = action.taint.to_json()
    assert doc == {**doc, "v": 1, "node_id": NODE, "local_rank": None, "slot": 1, "rank": 1, "effect": "migrate",
                   "source": "health", "time": 123.0, "device": "gpu1", "metric": ECC}
    assert doc["id"] == taint_id(NODE, "gpu1", ECC) and "uncorrected ECC: +3 > 0" in doc["reason"]
    assert "migrate rank 1" in action.reason


def test_a_taint_is_written_once():
    tid = taint_id(NODE, "gpu1", ECC)
    action = decide(verdict("gpu1"), RUNNING, [WrittenTaint(tid, "gpu1", ECC, 1, 1)], node_id=NODE, now_wall=0)
    assert action.op is TaintOp.KEEP and tid in action.reason


def test_spare_and_exclude_taints_name_the_slot_not_a_rank():
    on_spare = decide(verdict("gpu4"), SPARE, [], node_id=NODE, now_wall=0)
    assert on_spare.op is TaintOp.WRITE and on_spare.taint.rank is None and on_spare.taint.slot == 4
    exclude = decide(verdict("gpu1", TaintEffect.EXCLUDE), RUNNING, [], node_id=NODE, now_wall=0)
    assert exclude.op is TaintOp.WRITE
    assert (exclude.taint.effect.value, exclude.taint.rank, exclude.taint.slot) == ("exclude", None, 1)
    assert "exclude slot 1" in exclude.reason


def test_fail_kills_the_rank_and_leaves_recovery_to_the_unplanned_path():
    action = decide(verdict("gpu1", TaintEffect.FAIL), RUNNING, [], node_id=NODE, now_wall=0)
    assert action.op is TaintOp.WRITE and action.kill_slot == 1
    # handled_by keeps the coordinator from also planning a migration of the rank's replacement
    assert action.taint.handled_by == healthd.KILLED and action.taint.effect.value == "fail"


def test_recovery_deletes_only_on_a_healthy_reading():
    tid = taint_id(NODE, "gpu1", ECC)
    written = [WrittenTaint(tid, "gpu1", ECC, 1, 1)]
    healthy = decide(verdict("gpu1", TaintEffect.NONE, reason="3 checks pass"), RUNNING, written,
                     node_id=NODE, now_wall=0)
    assert healthy.op is TaintOp.DELETE and healthy.delete == (tid,)
    unknown = decide(verdict("gpu1", TaintEffect.NONE, Status.UNKNOWN, reason="cannot read"), RUNNING, written,
                     node_id=NODE, now_wall=0)
    assert unknown.op is TaintOp.KEEP and "stays" in unknown.reason
    nothing = decide(verdict("gpu1", TaintEffect.NONE), RUNNING, [], node_id=NODE, now_wall=0)
    assert nothing.op is TaintOp.KEEP


def test_a_straggler_taint_stays_with_the_slot_the_rank_left():
    old = taint_id(NODE, "rank2", "step_time", 2)
    assert old != taint_id(NODE, "rank2", "step_time", 4)      # slow again in the spare: a new taint
    written = [WrittenTaint(old, "rank2", "step_time", 2, 2)]
    moved = SlotInfo(4, 2, SlotState.RUNNING)
    healthy = verdict("rank2", TaintEffect.NONE, metric="step_time", reason="1x the median")
    assert decide(healthy, moved, written, node_id=NODE, now_wall=0).op is TaintOp.KEEP
    in_place = decide(healthy, SlotInfo(2, 2, SlotState.RUNNING), written, node_id=NODE, now_wall=0)
    assert in_place.op is TaintOp.DELETE and in_place.delete == (old,)


def test_devices_no_slot_uses_are_ignored_and_ids_are_key_safe():
    assert decide(verdict("gpu7"), None, [], node_id=NODE, now_wall=0).op is TaintOp.KEEP
    tid = taint_id("host/1", "MIG-GPU-abc/1/0", None)
    assert "/" not in tid and tid == taint_id("host/1", "MIG-GPU-abc/1/0", None)


# ---------------------------------------------------------------- the daemon against real etcd

class FakeProc:
    def __init__(self) -> None:
        self.pid = 4242
        self.signals: list[int] = []

    def signal_group(self, sig: int) -> bool:
        self.signals.append(sig)
        return True


class FakeSlots:
    """LocalSlots' surface the daemon uses: ``slots`` and ``field``; every STEP read is a new step."""

    def __init__(self, n: int, spares: int) -> None:
        self.slots = [types.SimpleNamespace(index=i, rank=i if i < n else None, local_rank=i, proc=FakeProc(),
                                            state=SlotState.RUNNING if i < n else SlotState.SPARE, pid=4242)
                      for i in range(n + spares)]
        self.step_seconds: dict[int, float] = {}
        self._steps: dict[int, int] = {}

    def field(self, slot: Any, f: Field) -> int:
        if f is Field.STEP:
            self._steps[slot.index] = self._steps.get(slot.index, 0) + 1
            return self._steps[slot.index]
        if f is healthd.STEP_TIME_FIELD:
            return int(self.step_seconds.get(slot.index, 0.01) * 1e9)
        return 0


class FakeRdzv:
    def __init__(self, store: EtcdStore, run_id: str) -> None:
        self.store = store
        self.prefix = f"/tpassrun/v1/{run_id}/"

    def key(self, *parts: str) -> str:
        return self.prefix + "/".join(parts)


@contextlib.asynccontextmanager
async def fake_agent(endpoint: str, run_id: str, **cfg: Any):
    events: list[dict] = []
    store = EtcdStore(EtcdConfig.from_endpoint(endpoint, {"read_timeout": "5"}), lease_ttl=10)
    await store.open()
    agent = types.SimpleNamespace(
        cfg=types.SimpleNamespace(**{"health_config": None, "health_interval": 0.05, "straggler_factor": 0.0,
                                     "migrate_back": False, **cfg}),
        node_id=NODE, rdzv=FakeRdzv(store, run_id), slots=FakeSlots(4, 1),
        events=EventLog(None, node_id=NODE, echo=events.append), environ={}, recorded=events)
    try:
        yield agent
    finally:
        with contextlib.suppress(Exception):
            await store.delete_prefix(agent.rdzv.prefix)
        await store.close()


@contextlib.asynccontextmanager
async def running(health: AgentHealth):
    task = asyncio.ensure_future(health.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def write_readings(path, readings) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"v": 1, "readings": readings}, f)
    os.replace(tmp, path)


async def until(predicate, what: str, timeout: float = 10.0):
    """Poll ``predicate`` (sync or async) until it returns something truthy."""
    async def loop():
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
            await asyncio.sleep(0.02)
    try:
        return await asyncio.wait_for(loop(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def taints(agent) -> dict[str, dict]:
    return {k.rsplit("/", 1)[-1]: d for k, d, _ in await agent.rdzv.store.get_prefix_json(agent.rdzv.key("taints") + "/")}


# A value rule that clears at once: the taint holds exactly as long as the file says so (a delta rule
# would clear on the next poll by itself, racing the test).
CLEARABLE_ECC = {"v": 1, "rules": [{"metric": ECC, "op": ">=", "threshold": 1, "clear_after": 0,
                                    "name": "uncorrected ECC"}]}


@pytest.mark.timeout(60)
def test_reading_taints_the_slot_and_recovery_removes_it(etcd_server, run_id, tmp_path):
    readings = tmp_path / "health.json"
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(CLEARABLE_ECC))
    write_readings(readings, [{"device": "gpu1", "metric": ECC, "value": 0}])

    async def scenario():
        async with fake_agent(etcd_server.endpoint, run_id, health_file=str(readings),
                              health_config=str(policy)) as agent:
            health = AgentHealth(agent)       # default sensors: NVML (no GPU here) + the file from cfg
            async with running(health):
                await until(lambda: health.monitor is not None and health.monitor.polls >= 2, "two polls")
                write_readings(readings, [{"device": "gpu1", "metric": ECC, "value": 3}])
                found = await until(lambda: taints(agent), "the taint key")
                # the daemon is done with this verdict once it has logged the taint
                await until(lambda: any(e["event"] == "health_taint" for e in agent.recorded), "health_taint")
                # ... and has published its snapshot (right after the taint; leaving `running` earlier
                # cancels that write)
                await until(lambda: _published_taints(agent), "the health snapshot with the taint")
            (tid, doc), = found.items()
            assert tid == taint_id(NODE, "gpu1", ECC) == doc["id"]
            assert (doc["node_id"], doc["slot"], doc["local_rank"], doc["rank"]) == (NODE, 1, None, 1)
            assert (doc["effect"], doc["source"]) == ("migrate", "health") and f"{ECC}=3" in doc["reason"]
            kinds = [e["event"] for e in agent.recorded]
            assert kinds.index("health_verdict") < kinds.index("health_taint")
            verdict_event = next(e for e in agent.recorded if e["event"] == "health_verdict")
            assert (verdict_event["device"], verdict_event["slot"], verdict_event["rank"]) == ("gpu1", 1, 1)
            said = [e["message"] for e in agent.recorded if e["event"] == "health_message"]
            assert len([m for m in said if "no GPU" in m]) <= 1   # NVML says so once (or works, on a GPU box)
            snapshot, _ = await agent.rdzv.store.get_json(agent.rdzv.key("health", NODE))
            assert snapshot["v"] == 1 and any(v["device"] == "gpu1" for v in snapshot["verdicts"])
            assert snapshot["taints"] == [tid]

            # A new generation runs the same AgentHealth again: the engine's state and our taints survive,
            # so recovery after the restart still removes the taint.
            async with running(health):
                write_readings(readings, [{"device": "gpu1", "metric": ECC, "value": 0}])
                await until(lambda: _empty(taints(agent)), "the taint to be deleted")
            assert [e["event"] for e in agent.recorded].count("health_untaint") == 1

    asyncio.run(scenario())


async def _empty(coro) -> bool:
    return not await coro


async def _published_taints(agent) -> bool:
    snapshot, _ = await agent.rdzv.store.get_json(agent.rdzv.key("health", NODE))
    return bool(snapshot and snapshot.get("taints"))


@pytest.mark.timeout(60)
def test_straggler_figures_in_the_reason_and_the_taint_follows_the_slot(etcd_server, run_id, tmp_path):
    async def scenario():
        async with fake_agent(etcd_server.endpoint, run_id, straggler_factor=3.0) as agent:
            agent.slots.step_seconds = {0: 0.01, 1: 0.011, 2: 0.2, 3: 0.012}
            health = AgentHealth(agent, sensors=[])
            async with running(health):
                found = await until(lambda: taints(agent), "a straggler taint")
                (tid, doc), = found.items()
                assert (doc["rank"], doc["slot"], doc["metric"]) == (2, 2, "step_time")
                assert "straggler: rank 2 median step 0.2s" in doc["reason"]
                assert "x the median of 3 other rank(s)" in doc["reason"]

                # The coordinator moves rank 2 to the spare (slot 4), which is fast.
                slots = agent.slots.slots
                slots[2].state, slots[2].rank = SlotState.QUARANTINED, None
                slots[4].state, slots[4].rank = SlotState.RUNNING, 2
                agent.slots.step_seconds[4] = 0.01
                await until(lambda: any(e["event"] == "health_verdict" and e["device"] == "rank2"
                                        and e["action"] == "keep" and e["slot"] == 4 for e in agent.recorded),
                            "the moved rank's verdict")
                assert tid in await taints(agent)    # the slow slot stays tainted

    asyncio.run(scenario())


EXCLUDE_AND_FAIL = {"v": 1, "rules": [
    {"metric": "row_remap_failure", "op": ">=", "threshold": 1, "effect": "exclude", "name": "row remap failure"},
    {"metric": "xid", "op": "==", "threshold": 79, "effect": "fail", "status": "failing", "name": "XID 79"}]}


@pytest.mark.timeout(60)
def test_exclude_on_a_spare_and_fail_on_a_rank(etcd_server, run_id, tmp_path):
    readings = tmp_path / "health.json"
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(EXCLUDE_AND_FAIL))

    async def scenario():
        async with fake_agent(etcd_server.endpoint, run_id, health_config=str(policy)) as agent:
            agent.environ[healthd.E.TPASSRUN_HEALTH_FILE] = str(readings)   # the env var, not the flag
            health = AgentHealth(agent)
            async with running(health):
                write_readings(readings, [{"device": "gpu4", "metric": "row_remap_failure", "value": 1},
                                          {"device": "gpu3", "metric": "xid", "value": 79}])
                found = await _two_taints(agent)
                # the kill follows the FAIL taint's write (so the coordinator never plans a migration for it)
                await until(lambda: any(e["event"] == "health_kill" for e in agent.recorded), "the kill")
            by_device = {d["device"]: d for d in found.values()}
            spare, failed = by_device["gpu4"], by_device["gpu3"]
            assert (spare["effect"], spare["rank"], spare["slot"]) == ("exclude", None, 4)
            assert (failed["effect"], failed["rank"], failed["handled_by"]) == ("fail", 3, healthd.KILLED)
            assert agent.slots.slots[3].proc.signals == [signal.SIGKILL]
            assert agent.slots.slots[4].proc.signals == []

    asyncio.run(scenario())


async def _two_taints(agent) -> dict[str, dict]:
    async def two():
        found = await taints(agent)
        return found if len(found) == 2 else None
    return await until(two, "two taints")
