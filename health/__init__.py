"""Health monitor: sensors, policies, verdicts, straggler detection.

Readings (from :class:`NvmlSensor`, :class:`FileSensor` or any :class:`Sensor`) go through a
:class:`PolicyEngine` that applies a :class:`Policy` of :class:`Rule` s and returns one typed
:class:`HealthVerdict` per device; :class:`StragglerDetector` does the same for per-rank step
times. :class:`HealthMonitor` is the only part that does I/O: it polls the sensors in threads and
hands the verdicts that changed to the agent, which turns taints into etcd keys.

This package imports nothing from the rest of tpassrun, and ``pynvml`` only when NVML is first used.
"""

from ._engine import PolicyEngine
from ._filesensor import FileSensor
from ._monitor import HealthMonitor, device_for_local_rank
from ._nvml import NvmlSensor, nvml_device_count
from ._policy import RECOVERY_ACTION_EFFECTS, XID_EFFECTS, LinkPolicy, Policy, Rule
from ._straggler import StragglerDetector
from ._types import HealthVerdict, Reading, Sensor, SensorUnavailable, Status, TaintEffect

__all__ = [
    "FileSensor",
    "HealthMonitor",
    "HealthVerdict",
    "NvmlSensor",
    "LinkPolicy",
    "Policy",
    "PolicyEngine",
    "RECOVERY_ACTION_EFFECTS",
    "Reading",
    "Rule",
    "Sensor",
    "SensorUnavailable",
    "Status",
    "StragglerDetector",
    "TaintEffect",
    "XID_EFFECTS",
    "device_for_local_rank",
    "nvml_device_count",
]
