"""GPU readings through NVML (nvidia-ml-py, module ``pynvml``), imported lazily.

Every call uses nvidia-ml-py's real names so a stand-in module with the same names can replace
it in tests (``NvmlSensor(nvml_module=fake)``). Error handling, by NVML return code:

* ``LIBRARY_NOT_FOUND`` / ``DRIVER_NOT_LOADED`` at init -> :class:`SensorUnavailable` ("no GPU"):
  the monitor says so once and runs without this sensor.
* ``GPU_IS_LOST`` on any call -> ``gpu_lost = 1`` for that GPU (the default policy: FAIL).
* ``NOT_SUPPORTED`` -> a reading with an error (the check cannot run: ``UNKNOWN``, never healthy),
  except for features a GPU may simply not have (NVLink, the driver's recovery-action field),
  which produce no reading at all.
* anything else -> a reading with the NVML error text.

XID events come from an event set polled with timeout 0, so a read never blocks on them.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from . import _types as m
from ._types import Reading, SensorUnavailable

Probe = Callable[[Any, Any], Iterable[tuple[str, float]]]

# Bits of nvmlDeviceGetCurrentClocksEventReasons worth a metric of their own (the others, like
# GpuIdle or SwPowerCap, are normal operation). Name in nvidia-ml-py -> metric.
THROTTLE_BITS = {
    "nvmlClocksEventReasonHwSlowdown": m.THROTTLE_HW_SLOWDOWN,
    "nvmlClocksEventReasonHwThermalSlowdown": m.THROTTLE_HW_THERMAL,
    "nvmlClocksEventReasonSwThermalSlowdown": m.THROTTLE_SW_THERMAL,
    "nvmlClocksEventReasonHwPowerBrakeSlowdown": m.THROTTLE_HW_POWER_BRAKE,
}
NVLINK_COUNTERS = {
    "NVML_NVLINK_ERROR_DL_REPLAY": m.NVLINK_REPLAY,
    "NVML_NVLINK_ERROR_DL_RECOVERY": m.NVLINK_RECOVERY,
    "NVML_NVLINK_ERROR_DL_CRC_FLIT": m.NVLINK_CRC_FLIT,
    "NVML_NVLINK_ERROR_DL_CRC_DATA": m.NVLINK_CRC_DATA,
    "NVML_NVLINK_ERROR_DL_ECC_DATA": m.NVLINK_ECC_DATA,
}
# c_nvmlValue_t member for each NVML_VALUE_TYPE_* (field values come back as a C union).
VALUE_TYPE_MEMBERS = {
    "NVML_VALUE_TYPE_DOUBLE": "dVal", "NVML_VALUE_TYPE_UNSIGNED_INT": "uiVal",
    "NVML_VALUE_TYPE_UNSIGNED_LONG": "ulVal", "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": "ullVal",
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": "sllVal", "NVML_VALUE_TYPE_SIGNED_INT": "siVal",
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": "usVal",
}
MAX_EVENTS_PER_READ = 256   # an XID storm must not keep one read busy forever


def nvml_device_count(nvml_module: Any = None) -> int | None:
    """How many GPUs NVML sees (NVML initialised and shut down again), or None when there is no NVML:
    nvidia-ml-py not installed, no driver, no library. Any other NVML error is raised (a broken driver must
    not look like a CPU-only node)."""
    nv = nvml_module
    if nv is None:
        try:
            import pynvml  # lazy, like NvmlSensor
        except ImportError:
            return None
        nv = pynvml
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        if _code(exc) in (nv.NVML_ERROR_LIBRARY_NOT_FOUND, nv.NVML_ERROR_DRIVER_NOT_LOADED):
            return None
        raise
    try:
        return int(nv.nvmlDeviceGetCount())
    finally:
        nv.nvmlShutdown()


class _Optional(Exception):
    """The GPU lacks this feature: no reading (as opposed to a check that failed)."""


class NvmlSensor:
    """Per-GPU readings (device names ``gpu<NVML index>``). Initialises NVML once, on the first read."""

    name = "nvml"

    def __init__(self, nvml_module: Any = None, devices: Sequence[int] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nv = nvml_module
        self._wanted = list(devices) if devices is not None else None
        self._clock = clock
        # close() may run (agent shutdown) while a cancelled poll is still reading in its thread.
        self._lock = threading.Lock()
        self._started = False
        self._indices: list[int] = []
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        self._xid_ready: dict[int, str | None] = {}      # index -> None when registered, else why not
        self._nvlinks: dict[int, list[int]] = {}         # index -> links that were up at discovery
        self._probes: list[tuple[tuple[str, ...], Probe, bool]] = [
            ((m.TEMPERATURE,), _temperature, False),
            ((m.POWER,), _power, False),
            ((m.ECC_UNCORRECTED_VOLATILE,), _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"), False),
            ((m.ECC_CORRECTED_VOLATILE,), _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"), False),
            ((m.ECC_UNCORRECTED_AGGREGATE,), _ecc("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"), False),
            ((m.ECC_CORRECTED_AGGREGATE,), _ecc("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"), False),
            ((m.RETIRED_PAGES_SBE, m.RETIRED_PAGES_DBE), _retired_pages, False),
            ((m.RETIRED_PAGES_PENDING,), _retired_pending, False),
            ((m.REMAPPED_ROWS_CORRECTABLE, m.REMAPPED_ROWS_UNCORRECTABLE, m.ROW_REMAP_PENDING,
              m.ROW_REMAP_FAILURE), _remapped_rows, False),
            ((m.CLOCKS_EVENT_REASONS, *THROTTLE_BITS.values()), _clock_reasons, False),
            ((m.PCIE_REPLAY,), _pcie_replay, False),
            ((m.RECOVERY_ACTION,), _recovery_action, True),
            ((m.NVLINK_LINKS_DOWN, *NVLINK_COUNTERS.values()), self._nvlink, True),
        ]

    # --- lifecycle ---

    def _module(self) -> Any:
        if self._nv is None:
            try:
                import pynvml  # nvidia-ml-py; lazy so that importing tpassrun.health costs nothing
            except ImportError as exc:
                raise SensorUnavailable(f"no GPU monitoring: nvidia-ml-py is not installed ({exc})") from None
            self._nv = pynvml
        return self._nv

    def _start(self, nv: Any) -> None:
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            if _code(exc) in (nv.NVML_ERROR_LIBRARY_NOT_FOUND, nv.NVML_ERROR_DRIVER_NOT_LOADED):
                raise SensorUnavailable(f"no GPU ({exc})") from None
            raise
        count = nv.nvmlDeviceGetCount()
        self._indices = [i for i in (self._wanted if self._wanted is not None else range(count)) if i < count]
        if not self._indices:
            nv.nvmlShutdown()
            raise SensorUnavailable(f"no GPU: NVML sees {count} device(s), none of {self._wanted} among them"
                                    if self._wanted is not None else "no GPU: NVML sees 0 devices")
        self._started = True
        self._register_xid_events(nv)

    def _register_xid_events(self, nv: Any) -> None:
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            self._xid_ready = {i: f"cannot create an NVML event set: {exc}" for i in self._indices}
            return
        for index in self._indices:
            try:
                nv.nvmlDeviceRegisterEvents(self._handle(nv, index), nv.nvmlEventTypeXidCriticalError, self._events)
                self._xid_ready[index] = None
            except nv.NVMLError as exc:
                self._xid_ready[index] = f"XID events unavailable: {exc}"

    def close(self) -> None:
        """Free the event set and shut NVML down (safe to call when never started)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if not self._started:
            return
        nv, self._started = self._nv, False
        try:
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass  # shutting down: nothing useful to do with a failure here
        self._events, self._handles, self._nvlinks = None, {}, {}

    def _handle(self, nv: Any, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = nv.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    # --- reading ---

    def read(self) -> list[Reading]:
        with self._lock:
            return self._read()

    def _read(self) -> list[Reading]:
        nv = self._module()
        if not self._started:
            self._start(nv)
        now = self._clock()
        readings: list[Reading] = []
        lost: set[int] = set()
        for index in self._indices:
            device_readings = self._read_device(nv, index, now)
            if any(r.metric == m.GPU_LOST and r.value == 1.0 for r in device_readings):
                lost.add(index)
            readings.extend(device_readings)
        readings.extend(self._drain_xids(nv, now, lost))
        return readings

    def _read_device(self, nv: Any, index: int, now: float) -> list[Reading]:
        device = f"gpu{index}"
        try:
            handle = self._handle(nv, index)
        except nv.NVMLError as exc:
            if _code(exc) == nv.NVML_ERROR_GPU_IS_LOST:
                return [Reading(device, m.GPU_LOST, 1.0, now)]
            return [Reading(device, m.GPU_LOST, None, now, error=f"no NVML handle: {exc}")]
        readings: list[Reading] = []
        for metrics, probe, optional in self._probes:
            try:
                values = list(probe(nv, (index, handle)))
            except _Optional:
                continue
            except nv.NVMLError as exc:
                code = _code(exc)
                if code == nv.NVML_ERROR_GPU_IS_LOST:
                    # Everything else we read from it is meaningless now.
                    return [Reading(device, m.GPU_LOST, 1.0, now)]
                if optional and code == nv.NVML_ERROR_NOT_SUPPORTED:
                    continue
                readings.extend(Reading(device, metric, None, now, error=f"NVML: {exc}") for metric in metrics)
                continue
            readings.extend(Reading(device, metric, float(value), now) for metric, value in values)
        readings.append(Reading(device, m.GPU_LOST, 0.0, now))
        return readings

    def _drain_xids(self, nv: Any, now: float, lost: set[int]) -> list[Reading]:
        readings: list[Reading] = []
        with_event: set[int] = set()
        by_key = {_handle_key(h): i for i, h in self._handles.items()}
        failure: str | None = None
        if self._events is not None and any(why is None for why in self._xid_ready.values()):
            for _ in range(MAX_EVENTS_PER_READ):
                try:
                    data = nv.nvmlEventSetWait_v2(self._events, 0)
                except nv.NVMLError as exc:
                    if _code(exc) != nv.NVML_ERROR_TIMEOUT:   # TIMEOUT = no more events: the normal end
                        failure = f"waiting for XID events: {exc}"
                    break
                if not data.eventType & nv.nvmlEventTypeXidCriticalError:
                    continue
                index = by_key.get(_handle_key(data.device))
                if index is not None:
                    with_event.add(index)
                    readings.append(Reading(f"gpu{index}", m.XID, float(data.eventData), now))
        for index in self._indices:
            why = self._xid_ready.get(index, "XID events not registered")
            if index in with_event or index in lost:
                continue
            if why is None and failure is None:
                readings.append(Reading(f"gpu{index}", m.XID, 0.0, now))   # polled: no XID this time
            else:
                readings.append(Reading(f"gpu{index}", m.XID, None, now, error=why or failure))
        return readings

    def _nvlink(self, nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
        index, handle = target
        if index not in self._nvlinks:
            self._nvlinks[index] = _discover_links(nv, handle)
        links = self._nvlinks[index]
        if not links:
            raise _Optional          # a PCIe-only GPU: no NVLink checks to run
        down, totals = 0, {metric: 0.0 for metric in NVLINK_COUNTERS.values()}
        supported: set[str] = set()
        for link in links:
            if nv.nvmlDeviceGetNvLinkState(handle, link) != nv.NVML_FEATURE_ENABLED:
                down += 1
                continue
            for name, metric in NVLINK_COUNTERS.items():
                try:
                    totals[metric] += nv.nvmlDeviceGetNvLinkErrorCounter(handle, link, getattr(nv, name))
                    supported.add(metric)
                except nv.NVMLError as exc:
                    if _code(exc) != nv.NVML_ERROR_NOT_SUPPORTED:
                        raise
        return [(m.NVLINK_LINKS_DOWN, down)] + [(k, v) for k, v in totals.items() if k in supported]


def _discover_links(nv: Any, handle: Any) -> list[int]:
    links = []
    for link in range(nv.NVML_NVLINK_MAX_LINKS):
        try:
            if nv.nvmlDeviceGetNvLinkState(handle, link) == nv.NVML_FEATURE_ENABLED:
                links.append(link)
        except nv.NVMLError as exc:
            if _code(exc) == nv.NVML_ERROR_GPU_IS_LOST:
                raise
            # NOT_SUPPORTED / INVALID_ARGUMENT: no such link on this GPU
    return links


def _code(exc: BaseException) -> int | None:
    return getattr(exc, "value", None)


def _handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (a ctypes pointer compares by object, not address)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle


def _temperature(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    return [(m.TEMPERATURE, nv.nvmlDeviceGetTemperature(target[1], nv.NVML_TEMPERATURE_GPU))]


def _power(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    return [(m.POWER, nv.nvmlDeviceGetPowerUsage(target[1]) / 1000.0)]     # NVML reports milliwatts


def _ecc(error_type: str, counter_type: str) -> Probe:
    def probe(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
        value = nv.nvmlDeviceGetTotalEccErrors(target[1], getattr(nv, error_type), getattr(nv, counter_type))
        kind = "uncorrected" if error_type.endswith("UNCORRECTED") else "corrected"
        scope = "volatile" if counter_type == "NVML_VOLATILE_ECC" else "aggregate"
        return [(f"ecc_{kind}_{scope}", value)]
    return probe


def _retired_pages(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    sbe = nv.nvmlDeviceGetRetiredPages(target[1], nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    dbe = nv.nvmlDeviceGetRetiredPages(target[1], nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    return [(m.RETIRED_PAGES_SBE, len(sbe)), (m.RETIRED_PAGES_DBE, len(dbe))]


def _retired_pending(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    return [(m.RETIRED_PAGES_PENDING, nv.nvmlDeviceGetRetiredPagesPendingStatus(target[1]))]


def _remapped_rows(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    correctable, uncorrectable, pending, failure = nv.nvmlDeviceGetRemappedRows(target[1])
    return [(m.REMAPPED_ROWS_CORRECTABLE, correctable), (m.REMAPPED_ROWS_UNCORRECTABLE, uncorrectable),
            (m.ROW_REMAP_PENDING, pending), (m.ROW_REMAP_FAILURE, failure)]


def _clock_reasons(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    # "Throttle" was renamed "ClocksEvent" in newer drivers; older bindings only have the old name.
    get = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    mask = int(get(target[1]))
    out: list[tuple[str, float]] = [(m.CLOCKS_EVENT_REASONS, mask)]
    for name, metric in THROTTLE_BITS.items():
        bit = getattr(nv, name, None)
        if bit is None:
            bit = getattr(nv, name.replace("ClocksEventReason", "ClocksThrottleReason"))
        out.append((metric, 1.0 if mask & bit else 0.0))
    return out


def _pcie_replay(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    return [(m.PCIE_REPLAY, nv.nvmlDeviceGetPcieReplayCounter(target[1]))]


def _recovery_action(nv: Any, target: tuple[int, Any]) -> list[tuple[str, float]]:
    field_id = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        raise _Optional              # binding older than the field (driver >= 570 has it)
    (value,) = nv.nvmlDeviceGetFieldValues(target[1], [field_id])
    if value.nvmlReturn != nv.NVML_SUCCESS:
        raise nv.NVMLError(value.nvmlReturn)
    member = next((attr for name, attr in VALUE_TYPE_MEMBERS.items()
                   if getattr(nv, name, None) == value.valueType), "uiVal")
    return [(m.RECOVERY_ACTION, getattr(value.value, member))]
