"""Vocabulary of the health monitor: readings in, verdicts out.

A *reading* is one number a sensor saw (or the reason it could not see it). A *verdict* is the
monitor's judgement of one device, with the taint effect the agent should apply and a reason a
human can act on. Verdicts are never a bare bool: a check that cannot run is ``UNKNOWN``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar, Protocol, runtime_checkable

from tpassrun.schema import Record, Schema, wire


class Status(str, Enum):
    """How a device is doing, from best to worst (``UNKNOWN`` sits between: it is not healthy)."""

    HEALTHY = "healthy"
    UNKNOWN = "unknown"
    DEGRADED = "degraded"
    FAILING = "failing"


class TaintEffect(str, Enum):
    """What the agent does with a tainted device, from mildest to harshest.

    ``EXCLUDE``: keep running, but never hand this slot out as a spare.
    ``MIGRATE``: move the rank to a spare at the next step boundary (planned swap).
    ``FAIL``: treat the rank as failed now (unplanned swap).
    """

    NONE = "none"
    EXCLUDE = "exclude"
    MIGRATE = "migrate"
    FAIL = "fail"


STATUS_SEVERITY = {Status.HEALTHY: 0, Status.UNKNOWN: 1, Status.DEGRADED: 2, Status.FAILING: 3}
EFFECT_SEVERITY = {TaintEffect.NONE: 0, TaintEffect.EXCLUDE: 1, TaintEffect.MIGRATE: 2, TaintEffect.FAIL: 3}


@dataclass(frozen=True)
class Reading(Record):
    """One observation. ``value is None`` exactly when ``error`` says why it could not be read."""

    SCHEMA: ClassVar[Schema] = Schema(what="health reading")

    device: str
    metric: str
    value: float | None
    time: float
    error: str | None = field(default=None, metadata=wire(omit_default=True))


@dataclass(frozen=True)
class HealthVerdict(Record):
    """The current judgement of one device (``gpu0``, ``rank3``, ...)."""

    SCHEMA: ClassVar[Schema] = Schema(what="health verdict", version=1)

    device: str
    status: Status
    effect: TaintEffect
    reason: str
    metric: str | None
    time: float

    @property
    def taints(self) -> bool:
        return self.effect is not TaintEffect.NONE



def worse(a: HealthVerdict, b: HealthVerdict) -> bool:
    """True when ``a`` is a harsher verdict than ``b`` (effect first: it is what the agent acts on)."""
    return (EFFECT_SEVERITY[a.effect], STATUS_SEVERITY[a.status]) > (EFFECT_SEVERITY[b.effect], STATUS_SEVERITY[b.status])


class SensorUnavailable(Exception):
    """Raised by ``Sensor.read`` when the sensor can never work on this machine (e.g. no GPU).

    The monitor says so once and stops polling that sensor; the other sensors keep running.
    """


@runtime_checkable
class Sensor(Protocol):
    """Something that produces readings. ``read`` may block: the monitor calls it in a thread."""

    name: str

    def read(self) -> list[Reading]: ...


def fmt(value: float) -> str:
    """Numbers in reasons: integers without a trailing ``.0``, the rest with 3 significant digits."""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.3g}"


# --- metric names the NVML sensor emits (a FileSensor may use these or its own) ---
GPU_LOST = "gpu_lost"                                   # 1 when NVML says the GPU fell off the bus
TEMPERATURE = "temperature_c"
POWER = "power_w"
ECC_CORRECTED_VOLATILE = "ecc_corrected_volatile"
ECC_UNCORRECTED_VOLATILE = "ecc_uncorrected_volatile"
ECC_CORRECTED_AGGREGATE = "ecc_corrected_aggregate"
ECC_UNCORRECTED_AGGREGATE = "ecc_uncorrected_aggregate"
RETIRED_PAGES_SBE = "retired_pages_sbe"
RETIRED_PAGES_DBE = "retired_pages_dbe"
RETIRED_PAGES_PENDING = "retired_pages_pending"
REMAPPED_ROWS_CORRECTABLE = "remapped_rows_correctable"
REMAPPED_ROWS_UNCORRECTABLE = "remapped_rows_uncorrectable"
ROW_REMAP_PENDING = "row_remap_pending"
ROW_REMAP_FAILURE = "row_remap_failure"
XID = "xid"                                             # the XID code of a critical event; 0 = none this poll
CLOCKS_EVENT_REASONS = "clocks_event_reasons"           # raw bitmask, for display
THROTTLE_HW_SLOWDOWN = "throttle_hw_slowdown"
THROTTLE_HW_THERMAL = "throttle_hw_thermal"
THROTTLE_SW_THERMAL = "throttle_sw_thermal"
THROTTLE_HW_POWER_BRAKE = "throttle_hw_power_brake"
PCIE_REPLAY = "pcie_replay_count"
NVLINK_REPLAY = "nvlink_replay_errors"
NVLINK_RECOVERY = "nvlink_recovery_errors"
NVLINK_CRC_FLIT = "nvlink_crc_flit_errors"
NVLINK_CRC_DATA = "nvlink_crc_data_errors"
NVLINK_ECC_DATA = "nvlink_ecc_data_errors"
NVLINK_LINKS_DOWN = "nvlink_links_down"                 # links that were up when the monitor started
RECOVERY_ACTION = "recovery_action"                     # NVML_GPU_RECOVERY_ACTION_* value
SENSOR = "sensor"                                       # pseudo-metric: a whole sensor failed to read
STEP_TIME = "step_time"                                 # straggler detector
