"""HealthMonitor loop with a FileSensor, fake clock and short interval; FileSensor; device mapping."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tpassrun.health import (
    FileSensor,
    HealthMonitor,
    HealthVerdict,
    NvmlSensor,
    Policy,
    PolicyEngine,
    Reading,
    Rule,
    Status,
    StragglerDetector,
    TaintEffect,
    device_for_local_rank,
)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def write_readings(path, readings) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"v": 1, "readings": readings}, f)
    os.replace(tmp, path)       # atomic, as the FileSensor docstring asks of site tools


ECC_RULE = Rule("ecc_uncorrected_volatile", ">=", 1, effect=TaintEffect.MIGRATE, clear_after=5)


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[HealthVerdict]] = []
        self.event = asyncio.Event()
        self.fail_next = 0

    async def __call__(self, verdicts: list[HealthVerdict]) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError("etcd unavailable")
        self.batches.append(verdicts)
        self.event.set()


# --- FileSensor ---

def test_file_sensor_missing_file_has_no_readings(tmp_path):
    assert FileSensor(str(tmp_path / "none.json")).read() == []


def test_file_sensor_reads_values_and_errors(tmp_path):
    path = tmp_path / "h.json"
    write_readings(path, [{"device": "gpu0", "metric": "ecc_uncorrected_volatile", "value": 3},
                          {"device": "slot2", "metric": "ib_link", "value": None, "error": "port down"}])
    sensor = FileSensor(str(path), clock=FakeClock(5.0))
    assert sensor.read() == [Reading("gpu0", "ecc_uncorrected_volatile", 3.0, 5.0),
                             Reading("slot2", "ib_link", None, 5.0, error="port down")]


def test_file_sensor_empty_error_is_no_explanation(tmp_path):
    """A reading with no value and ``"error": ""`` once raised TypeError out of ``read`` (``float(None)``: the empty
    string counted as "no error" for the value and as "an error" for the check before it), so the site tool's file
    read as a failing sensor instead of a device without a value; found when mypy --strict came to health/."""
    path = tmp_path / "h.json"
    write_readings(path, [{"device": "gpu0", "metric": "m", "value": None, "error": ""},
                          {"device": "gpu1", "metric": "m", "value": 2, "error": ""}])
    sensor = FileSensor(str(path), clock=FakeClock(5.0))
    assert sensor.read() == [Reading("gpu0", "m", None, 5.0, error="no value given"), Reading("gpu1", "m", 2.0, 5.0)]


@pytest.mark.parametrize("content,why", [
    ("{nope", "not valid JSON"),
    ('{"v": 2, "readings": []}', '"v": 1'),
    ('{"v": 1, "readings": {}}', "must be a list"),
    ('{"v": 1, "readings": [{"device": "gpu0", "value": 1}]}', "non-empty strings"),
    ('{"v": 1, "readings": [{"device": "gpu0", "metric": "x", "value": "hot"}]}', "number or null"),
])
def test_file_sensor_malformed_is_one_unknown_reading_then_recovers(tmp_path, content, why):
    path = tmp_path / "h.json"
    path.write_text(content)
    sensor = FileSensor(str(path))
    (reading,) = sensor.read()
    assert reading.device == f"file:{path}" and reading.value is None and why in reading.error
    engine = PolicyEngine(Policy(()))
    (verdict,) = engine.observe([reading], 0)
    assert verdict.status is Status.UNKNOWN
    write_readings(path, [])
    (recovered,) = sensor.read()
    assert recovered.device == reading.device and recovered.error is None
    (verdict,) = engine.observe([recovered], 1)
    assert verdict.status is Status.HEALTHY


def test_file_sensor_stale_file_makes_readings_unknown(tmp_path):
    path = tmp_path / "h.json"
    write_readings(path, [{"device": "gpu0", "metric": "temperature_c", "value": 50}])
    mtime = os.stat(path).st_mtime
    sensor = FileSensor(str(path), max_age=60, wall_clock=lambda: mtime + 10)
    assert sensor.read()[0].value == 50
    sensor = FileSensor(str(path), max_age=60, wall_clock=lambda: mtime + 61)
    (reading,) = sensor.read()
    assert reading.value is None and reading.error.startswith("stale:")


# --- the monitor ---

@pytest.mark.timeout(30)
def test_run_reports_only_changes_and_clears_with_hysteresis(tmp_path):
    path = tmp_path / "h.json"
    clock = FakeClock()
    recorder = Recorder()

    async def scenario():
        monitor = HealthMonitor([FileSensor(str(path))], PolicyEngine(Policy((ECC_RULE,))), interval=0.01,
                                on_verdicts=recorder, clock=clock)
        task = asyncio.create_task(monitor.run())
        try:
            write_readings(path, [{"device": "gpu0", "metric": "ecc_uncorrected_volatile", "value": 0}])
            while monitor.polls < 3:
                await asyncio.sleep(0.01)
            assert recorder.batches == [], "healthy from the start is not news"
            write_readings(path, [{"device": "gpu0", "metric": "ecc_uncorrected_volatile", "value": 2}])
            await asyncio.wait_for(recorder.event.wait(), 10)
            (raised,) = recorder.batches[0]
            assert (raised.device, raised.effect, raised.status) == ("gpu0", TaintEffect.MIGRATE, Status.DEGRADED)
            recorder.event.clear()
            polls = monitor.polls
            while monitor.polls < polls + 3:
                await asyncio.sleep(0.01)
            assert len(recorder.batches) == 1, "an unchanged taint is not reported again"
            write_readings(path, [{"device": "gpu0", "metric": "ecc_uncorrected_volatile", "value": 0}])
            polls = monitor.polls
            while monitor.polls < polls + 3:
                await asyncio.sleep(0.01)
            assert len(recorder.batches) == 1, "hysteresis: clear_after (5 s) has not passed on the clock"
            clock.now += 10
            await asyncio.wait_for(recorder.event.wait(), 10)
            (cleared,) = recorder.batches[1]
            assert (cleared.status, cleared.effect) == (Status.HEALTHY, TaintEffect.NONE)
            snapshot = json.loads(json.dumps(monitor.snapshot()))
            assert snapshot["v"] == 1 and snapshot["verdicts"][0]["device"] == "gpu0"
            assert snapshot["readings"][0]["metric"] == "ecc_uncorrected_volatile"
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(scenario())


class ClosableSensor:
    name = "closable"

    def __init__(self) -> None:
        self.closed = False

    def read(self) -> list[Reading]:
        return []

    def close(self) -> None:
        self.closed = True


def test_no_gpu_is_said_once_and_the_rest_keeps_running(tmp_path):
    """The real pynvml here has no driver: the monitor logs it once and polls the file sensor."""
    path = tmp_path / "h.json"
    write_readings(path, [{"device": "slot0", "metric": "ecc_uncorrected_volatile", "value": 4}])
    messages: list[str] = []
    recorder = Recorder()
    closable = ClosableSensor()

    async def scenario():
        monitor = HealthMonitor([NvmlSensor(), FileSensor(str(path)), closable],
                                PolicyEngine(Policy((ECC_RULE,))), interval=0.01,
                                on_verdicts=recorder, clock=FakeClock(), log=messages.append)
        for _ in range(4):
            await monitor.poll_once()
        assert [m for m in messages if "no GPU" in m] == [
            "health: no GPU (NVML Shared Library Not Found); running without sensor 'nvml'"]
        assert "nvml" in monitor.unavailable
        assert [v.device for batch in recorder.batches for v in batch] == ["slot0"]
        task = asyncio.create_task(monitor.run())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closable.closed, "run() closes its sensors on the way out"

    asyncio.run(scenario())


class FlakySensor:
    name = "flaky"

    def __init__(self) -> None:
        self.broken = False

    def read(self) -> list[Reading]:
        if self.broken:
            raise OSError("ipmitool timed out")
        return [Reading("gpu1", "temperature_c", 60.0, 0.0)]


def test_failing_sensor_makes_its_devices_unknown_then_recovers():
    sensor, recorder, messages = FlakySensor(), Recorder(), []

    async def scenario():
        monitor = HealthMonitor([sensor], PolicyEngine(Policy((Rule("temperature_c", ">=", 90),))),
                                interval=0.01, on_verdicts=recorder, clock=FakeClock(), log=messages.append)
        assert await monitor.poll_once() == []
        sensor.broken = True
        changed = {v.device: v for v in await monitor.poll_once()}
        assert changed["gpu1"].status is Status.UNKNOWN and "ipmitool timed out" in changed["gpu1"].reason
        assert changed["flaky"].status is Status.UNKNOWN
        await monitor.poll_once()
        assert sum("failed" in m for m in messages) == 1, "the same failure is logged once"
        sensor.broken = False
        changed = {v.device: v.status for v in await monitor.poll_once()}
        assert changed == {"gpu1": Status.HEALTHY, "flaky": Status.HEALTHY}

    asyncio.run(scenario())


def test_failed_delivery_is_retried_on_the_next_poll(tmp_path):
    path = tmp_path / "h.json"
    write_readings(path, [{"device": "gpu0", "metric": "ecc_uncorrected_volatile", "value": 1}])
    recorder, messages = Recorder(), []
    recorder.fail_next = 1

    async def scenario():
        monitor = HealthMonitor([FileSensor(str(path))], PolicyEngine(Policy((ECC_RULE,))), interval=0.01,
                                on_verdicts=recorder, clock=FakeClock(), log=messages.append)
        assert await monitor.poll_once() == []
        assert "will retry" in messages[0]
        (verdict,) = await monitor.poll_once()
        assert verdict.effect is TaintEffect.MIGRATE
        assert await monitor.poll_once() == []

    asyncio.run(scenario())


def test_straggler_verdicts_come_through_the_monitor():
    recorder = Recorder()
    times = {0: 1.0, 1: 1.0, 2: 3.0}

    async def scenario():
        monitor = HealthMonitor([], PolicyEngine(Policy.default()), interval=0.01, on_verdicts=recorder,
                                clock=FakeClock(), straggler=StragglerDetector(factor=1.5, window=2, min_steps=2,
                                                                              patience=2),
                                step_times=lambda: times)
        for _ in range(4):
            await monitor.poll_once()
        tainted = [v for batch in recorder.batches for v in batch if v.taints]
        assert [v.device for v in tainted] == ["rank2"] and "3x the median" in tainted[0].reason

    asyncio.run(scenario())


def test_monitor_arguments_are_checked():
    async def sink(_):
        return None

    with pytest.raises(ValueError):
        HealthMonitor([], PolicyEngine(Policy(())), interval=0, on_verdicts=sink)
    with pytest.raises(ValueError):
        HealthMonitor([], PolicyEngine(Policy(())), interval=1, on_verdicts=sink,
                      straggler=StragglerDetector(factor=2))


# --- device mapping ---

@pytest.mark.parametrize("local_rank,visible,device", [
    (0, None, "gpu0"), (3, None, "gpu3"),
    (0, "2,3", "gpu2"), (1, "2, 3", "gpu3"),
    (0, "GPU-8f6c1c2e-aaaa", "GPU-8f6c1c2e-aaaa"),
])
def test_device_for_local_rank(local_rank, visible, device):
    assert device_for_local_rank(local_rank, visible) == device


@pytest.mark.parametrize("local_rank,visible", [(0, ""), (2, "0,1"), (-1, None), (0, "-1")])
def test_device_for_local_rank_errors(local_rank, visible):
    with pytest.raises(ValueError):
        device_for_local_rank(local_rank, visible)


# --- package boundary ---

def test_health_imports_neither_torch_nor_pynvml_nor_other_tpassrun_modules():
    """Other than the one JSON codec (tpassrun.schema: standard library only, docs/layout.toml lets health import it)."""
    import subprocess
    import sys

    code = ("import sys, tpassrun.health; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pynvml', 'tpassrun'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert all(m == "tpassrun" or m.startswith(("tpassrun.health", "tpassrun.schema")) for m in loaded), loaded


def test_redeliver_sends_the_next_verdict_even_when_it_looks_unchanged(tmp_path):
    """A consumer that holds a taint the monitor never recorded delivering (its run was cancelled mid-delivery)
    asks for redelivery: a healthy reading then reaches it, so the taint can be removed."""
    path = tmp_path / "h.json"
    recorder = Recorder()

    async def scenario():
        monitor = HealthMonitor([FileSensor(str(path))], PolicyEngine(Policy((ECC_RULE,))), interval=0.01,
                                on_verdicts=recorder, clock=FakeClock())
        write_readings(path, [{"device": "gpu0", "metric": "ecc_uncorrected_volatile", "value": 0}])
        assert await monitor.poll_once() == []               # healthy, and nothing was reported: no news
        monitor.redeliver({"gpu0"})
        (again,) = await monitor.poll_once()
        assert (again.device, again.status) == ("gpu0", Status.HEALTHY)
        assert await monitor.poll_once() == []               # once only

    asyncio.run(scenario())
