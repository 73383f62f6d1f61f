"""NvmlSensor against a stand-in for ``pynvml`` built from the real module's names.

The stand-in reuses nvidia-ml-py's constants, error classes and ctypes structures (field values,
event data, device handles), and every function it answers must exist in the real module with a
compatible signature, so a misspelt NVML call fails here rather than on a GPU node.
"""

from __future__ import annotations

import ctypes
import inspect
from dataclasses import dataclass, field

import pynvml as real
import pytest

from tpassrun.health import NvmlSensor, Policy, PolicyEngine, SensorUnavailable, Status, TaintEffect


@dataclass
class FakeGpu:
    temperature: int = 55
    power_mw: int = 250_000
    ecc: dict = field(default_factory=dict)             # (error_type, counter_type) -> count
    retired_sbe: list = field(default_factory=list)
    retired_dbe: list = field(default_factory=list)
    retired_pending: int = 0
    remapped: tuple = (0, 0, 0, 0)
    clocks_mask: int = 0
    pcie_replay: int = 0
    nvlink_up: list = field(default_factory=list)       # per link: True/False; [] = no NVLink
    nvlink_errors: dict = field(default_factory=dict)   # (link, counter) -> count
    recovery_action: int | None = 0                     # None: driver does not have the field
    lost: bool = False
    not_supported: set = field(default_factory=set)     # NVML function names answering NOT_SUPPORTED


class FakeNvml:
    """Answers the NVML functions NvmlSensor calls; everything else comes from the real pynvml."""

    def __init__(self, gpus: list[FakeGpu], init_error: int | None = None, events_supported: bool = True):
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlClocks")):
                setattr(self, name, getattr(real, name))
        self.gpus = gpus
        self.init_error = init_error
        self.events_supported = events_supported
        self.handles = [ctypes.cast(ctypes.c_void_p(0x1000 + 16 * i), real.c_nvmlDevice_t) for i in range(len(gpus))]
        self.pending_events: list[tuple[int, int]] = []    # (gpu index, xid)
        self.calls: list[str] = []
        self.initialized = False

    def _gpu(self, handle, fn: str) -> FakeGpu:
        self.calls.append(fn)
        address = ctypes.cast(handle, ctypes.c_void_p).value
        index = [ctypes.cast(h, ctypes.c_void_p).value for h in self.handles].index(address)
        gpu = self.gpus[index]
        if gpu.lost:
            raise real.NVMLError(real.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.not_supported:
            raise real.NVMLError_NotSupported()
        return gpu

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise real.NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self):
        self.calls.append("nvmlShutdown")
        self.initialized = False

    def nvmlDeviceGetCount(self):
        self.calls.append("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self.calls.append("nvmlDeviceGetHandleByIndex")
        if self.gpus[index].lost:
            raise real.NVMLError_GpuIsLost()
        return self.handles[index]

    def nvmlDeviceGetTemperature(self, handle, sensor):
        assert sensor == real.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperature").temperature

    def nvmlDeviceGetPowerUsage(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetTotalEccErrors(self, handle, errorType, counterType):
        return self._gpu(handle, "nvmlDeviceGetTotalEccErrors").ecc.get((errorType, counterType), 0)

    def nvmlDeviceGetRetiredPages(self, device, sourceFilter):
        gpu = self._gpu(device, "nvmlDeviceGetRetiredPages")
        sbe = sourceFilter == real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
        return list(gpu.retired_sbe if sbe else gpu.retired_dbe)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device):
        return self._gpu(device, "nvmlDeviceGetRetiredPagesPendingStatus").retired_pending

    def nvmlDeviceGetRemappedRows(self, device):
        return self._gpu(device, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clocks_mask

    def nvmlDeviceGetPcieReplayCounter(self, handle):
        return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replay

    def nvmlDeviceGetNvLinkState(self, device, link):
        gpu = self._gpu(device, "nvmlDeviceGetNvLinkState")
        if link >= len(gpu.nvlink_up):
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT if gpu.nvlink_up else real.NVML_ERROR_NOT_SUPPORTED)
        return real.NVML_FEATURE_ENABLED if gpu.nvlink_up[link] else real.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, device, link, counter):
        return self._gpu(device, "nvmlDeviceGetNvLinkErrorCounter").nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetFieldValues(self, handle, fieldIds):
        gpu = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = (real.c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            assert field_id == real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
            values[i].fieldId = field_id
            if gpu.recovery_action is None:
                values[i].nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
            else:
                values[i].nvmlReturn = real.NVML_SUCCESS
                values[i].valueType = real.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = gpu.recovery_action
        return values

    def nvmlEventSetCreate(self):
        self.calls.append("nvmlEventSetCreate")
        return real.c_nvmlEventSet_t()

    def nvmlDeviceRegisterEvents(self, handle, eventTypes, eventSet):
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        assert eventTypes & real.nvmlEventTypeXidCriticalError
        if not self.events_supported:
            raise real.NVMLError_NotSupported()

    def nvmlEventSetWait_v2(self, eventSet, timeoutms):
        self.calls.append("nvmlEventSetWait_v2")
        assert timeoutms == 0, "the sensor must never block on events"
        if not self.pending_events:
            raise real.NVMLError_Timeout()
        index, xid = self.pending_events.pop(0)
        data = real.c_nvmlEventData_t()
        data.device = self.handles[index]
        data.eventType = real.nvmlEventTypeXidCriticalError
        data.eventData = xid
        return data

    def nvmlEventSetFree(self, eventSet):
        self.calls.append("nvmlEventSetFree")


def test_stand_in_only_answers_real_nvml_functions():
    for name, method in inspect.getmembers(FakeNvml, inspect.isfunction):
        if name.startswith("nvml"):
            assert hasattr(real, name), f"{name} is not a pynvml function"
            ours = list(inspect.signature(method).parameters)[1:]   # drop self
            theirs = list(inspect.signature(getattr(real, name)).parameters)
            assert ours == theirs, f"{name}{tuple(ours)} != pynvml.{name}{tuple(theirs)}"


def by_metric(readings, device="gpu0"):
    return {r.metric: r for r in readings if r.device == device}


def judge(sensor, engine=None, now=0.0):
    engine = engine or PolicyEngine(Policy.default())
    readings = sensor.read()
    return {v.device: v for v in engine.observe(readings, now)}, readings


def test_healthy_gpu_reads_every_metric():
    fake = FakeNvml([FakeGpu(nvlink_up=[True, True], ecc={(1, 0): 0, (0, 1): 7}, retired_sbe=[0x10])])
    sensor = NvmlSensor(nvml_module=fake)
    verdicts, readings = judge(sensor)
    got = by_metric(readings)
    assert got["temperature_c"].value == 55 and got["power_w"].value == 250.0
    assert got["ecc_corrected_aggregate"].value == 7 and got["retired_pages_sbe"].value == 1
    assert got["recovery_action"].value == 0 and got["xid"].value == 0 and got["gpu_lost"].value == 0
    assert got["nvlink_links_down"].value == 0 and "nvlink_replay_errors" in got
    assert all(r.error is None for r in readings)
    assert verdicts["gpu0"].status is Status.HEALTHY, verdicts["gpu0"].reason
    assert all(hasattr(real, name) for name in fake.calls)
    assert fake.calls.count("nvmlInit") == 1
    sensor.read()
    assert fake.calls.count("nvmlInit") == 1, "NVML is initialised once per sensor"
    sensor.close()
    assert fake.calls[-2:] == ["nvmlEventSetFree", "nvmlShutdown"]


def test_not_supported_metric_is_unknown_never_healthy():
    gpu = FakeGpu(not_supported={"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows"})
    verdicts, readings = judge(NvmlSensor(nvml_module=FakeNvml([gpu])))
    got = by_metric(readings)
    assert got["ecc_uncorrected_volatile"].value is None
    assert got["ecc_uncorrected_volatile"].error == "NVML: Not Supported"
    assert got["row_remap_failure"].error == "NVML: Not Supported"
    assert got["temperature_c"].value == 55          # one unsupported metric does not hide the others
    verdict = verdicts["gpu0"]
    assert verdict.status is Status.UNKNOWN and verdict.effect is TaintEffect.NONE
    assert "ecc_uncorrected_volatile: NVML: Not Supported" in verdict.reason


def test_features_a_gpu_lacks_produce_no_reading():
    gpu = FakeGpu(recovery_action=None, nvlink_up=[])  # old driver, PCIe-only board
    verdicts, readings = judge(NvmlSensor(nvml_module=FakeNvml([gpu])))
    got = by_metric(readings)
    assert "recovery_action" not in got and "nvlink_links_down" not in got
    assert verdicts["gpu0"].status is Status.HEALTHY


def test_gpu_lost_fails_that_gpu_only():
    fake = FakeNvml([FakeGpu(), FakeGpu()])
    sensor = NvmlSensor(nvml_module=fake)
    engine = PolicyEngine(Policy.default())
    judge(sensor, engine, 0)
    fake.gpus[1].lost = True
    verdicts, readings = judge(sensor, engine, 1)
    assert [(r.metric, r.value) for r in readings if r.device == "gpu1"] == [("gpu_lost", 1.0)]
    assert (verdicts["gpu1"].status, verdicts["gpu1"].effect) == (Status.FAILING, TaintEffect.FAIL)
    assert verdicts["gpu0"].status is Status.HEALTHY


def test_gpu_lost_before_the_first_handle():
    fake = FakeNvml([FakeGpu(lost=True), FakeGpu()])
    verdicts, _ = judge(NvmlSensor(nvml_module=fake))
    assert verdicts["gpu0"].effect is TaintEffect.FAIL and verdicts["gpu1"].status is Status.HEALTHY


def test_xid_events_are_drained_without_blocking():
    fake = FakeNvml([FakeGpu(), FakeGpu()])
    sensor = NvmlSensor(nvml_module=fake)
    engine = PolicyEngine(Policy.default())
    judge(sensor, engine, 0)
    fake.pending_events = [(1, 13), (1, 79)]
    verdicts, readings = judge(sensor, engine, 1)
    assert sorted(r.value for r in readings if r.metric == "xid" and r.device == "gpu1") == [13, 79]
    assert by_metric(readings, "gpu0")["xid"].value == 0
    assert verdicts["gpu1"].effect is TaintEffect.FAIL and "XID 79" in verdicts["gpu1"].reason
    verdicts, _ = judge(sensor, engine, 1000)
    assert verdicts["gpu1"].effect is TaintEffect.FAIL, "a fatal XID stays until an operator clears it"


def test_xid_events_unsupported_is_unknown():
    verdicts, readings = judge(NvmlSensor(nvml_module=FakeNvml([FakeGpu()], events_supported=False)))
    assert by_metric(readings)["xid"].error.startswith("XID events unavailable")
    assert verdicts["gpu0"].status is Status.UNKNOWN


@pytest.mark.parametrize("action,effect", [
    (real.NVML_GPU_RECOVERY_ACTION_NONE, TaintEffect.NONE),
    (real.NVML_GPU_RECOVERY_ACTION_GPU_RESET, TaintEffect.FAIL),
    (real.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, TaintEffect.FAIL),
    (real.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P, TaintEffect.MIGRATE),
    (real.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET, TaintEffect.MIGRATE),
])
def test_recovery_action_field(action, effect):
    verdicts, readings = judge(NvmlSensor(nvml_module=FakeNvml([FakeGpu(recovery_action=action)])))
    assert by_metric(readings)["recovery_action"].value == action
    assert verdicts["gpu0"].effect is effect


def test_uncorrected_ecc_increase_migrates():
    key = (real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, real.NVML_VOLATILE_ECC)
    fake = FakeNvml([FakeGpu(ecc={key: 1})])
    sensor, engine = NvmlSensor(nvml_module=fake), PolicyEngine(Policy.default())
    assert judge(sensor, engine, 0)[0]["gpu0"].status is Status.HEALTHY     # baseline
    fake.gpus[0].ecc[key] = 2
    verdict = judge(sensor, engine, 1)[0]["gpu0"]
    assert verdict.effect is TaintEffect.MIGRATE and "ecc_uncorrected_volatile +1" in verdict.reason


def test_row_remap_and_retired_pages():
    fake = FakeNvml([FakeGpu(remapped=(3, 1, 0, 1), retired_pending=0)])
    verdicts, readings = judge(NvmlSensor(nvml_module=fake))
    got = by_metric(readings)
    assert (got["remapped_rows_correctable"].value, got["row_remap_failure"].value) == (3, 1)
    assert verdicts["gpu0"].effect is TaintEffect.EXCLUDE


def test_nvlink_link_down_and_throttle_bits():
    gpu = FakeGpu(nvlink_up=[True, True, True],
                  nvlink_errors={(0, real.NVML_NVLINK_ERROR_DL_REPLAY): 4, (2, real.NVML_NVLINK_ERROR_DL_REPLAY): 1},
                  clocks_mask=real.nvmlClocksEventReasonHwThermalSlowdown | real.nvmlClocksEventReasonGpuIdle)
    fake = FakeNvml([gpu])
    sensor = NvmlSensor(nvml_module=fake)
    engine = PolicyEngine(Policy.default())
    _, readings = judge(sensor, engine, 0)
    got = by_metric(readings)
    assert got["nvlink_replay_errors"].value == 5 and got["nvlink_links_down"].value == 0
    assert got["throttle_hw_thermal"].value == 1 and got["throttle_hw_slowdown"].value == 0
    gpu.nvlink_up[1] = False
    verdicts, readings = judge(sensor, engine, 1)
    assert by_metric(readings)["nvlink_links_down"].value == 1
    assert verdicts["gpu0"].effect is TaintEffect.MIGRATE and "nvlink" in verdicts["gpu0"].reason


def test_device_subset():
    _, readings = judge(NvmlSensor(nvml_module=FakeNvml([FakeGpu(), FakeGpu()]), devices=[1]))
    assert {r.device for r in readings} == {"gpu1"}


@pytest.mark.parametrize("code", [real.NVML_ERROR_LIBRARY_NOT_FOUND, real.NVML_ERROR_DRIVER_NOT_LOADED])
def test_no_driver_is_sensor_unavailable(code):
    with pytest.raises(SensorUnavailable, match="no GPU"):
        NvmlSensor(nvml_module=FakeNvml([], init_error=code)).read()


def test_zero_gpus_is_sensor_unavailable():
    with pytest.raises(SensorUnavailable, match="0 devices"):
        NvmlSensor(nvml_module=FakeNvml([])).read()


def test_other_init_error_is_retried_not_unavailable():
    fake = FakeNvml([FakeGpu()], init_error=real.NVML_ERROR_NO_PERMISSION)
    sensor = NvmlSensor(nvml_module=fake)
    with pytest.raises(real.NVMLError_NoPermission):
        sensor.read()
    fake.init_error = None
    assert by_metric(sensor.read())["gpu_lost"].value == 0


def test_real_pynvml_without_driver_says_no_gpu():
    """The real nvidia-ml-py on this GPU-less machine: NVMLError_LibraryNotFound -> SensorUnavailable."""
    try:
        real.nvmlInit()
    except real.NVMLError_LibraryNotFound:
        pass
    else:  # pragma: no cover - only on a machine with a driver
        real.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    sensor = NvmlSensor()
    with pytest.raises(SensorUnavailable, match="NVML Shared Library Not Found"):
        sensor.read()
    sensor.close()   # never started: a no-op
