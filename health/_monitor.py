"""The effectful part: poll sensors off the event loop, judge, and report verdicts that changed.

The agent runs :meth:`HealthMonitor.run` as one child of its TaskGroup and turns each reported
verdict with ``effect != NONE`` into a taint key in etcd (and deletes it when the verdict clears).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping, Sequence

from ._engine import PolicyEngine
from ._straggler import StragglerDetector
from ._types import SENSOR, HealthVerdict, Reading, Sensor, SensorUnavailable, Status, TaintEffect

_logger = logging.getLogger("tpassrun.health")


class HealthMonitor:
    """Every ``interval`` seconds: read all sensors in threads, observe, report changed verdicts.

    Args:
        sensors: what to poll; a sensor raising :class:`SensorUnavailable` is announced once and dropped.
        engine: the policy engine (its state lives as long as the monitor).
        interval: seconds between polls.
        on_verdicts: awaited with the verdicts whose (status, effect, metric) changed since the last
            report; a device starts out as healthy, so only news is reported. If it raises, the
            error is logged and the same news is offered again on the next poll.
        clock: the time verdicts are judged at (inject a fake one in tests).
        log: where one-line messages go.
        straggler / step_times: optional straggler detection over ``step_times()`` (rank -> seconds).
    """

    def __init__(self, sensors: Sequence[Sensor], engine: PolicyEngine, *, interval: float,
                 on_verdicts: Callable[[list[HealthVerdict]], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = _logger.info,
                 straggler: StragglerDetector | None = None,
                 step_times: Callable[[], Mapping[int, float | None]] | None = None) -> None:
        if interval <= 0:
            raise ValueError(f"health interval must be > 0, got {interval}")
        if (straggler is None) != (step_times is None):
            raise ValueError("straggler and step_times go together")
        self.sensors = list(sensors)
        self.engine = engine
        self.interval = interval
        self._on_verdicts = on_verdicts
        self._clock = clock
        self._log = log
        self._straggler, self._step_times = straggler, step_times
        self._reported: dict[str, _Key | tuple[None, None, None]] = {}
        self._verdicts: dict[str, HealthVerdict] = {}
        self._readings: dict[tuple[str, str], Reading] = {}
        self._sensor_metrics: dict[str, set[tuple[str, str]]] = {}   # what each sensor last reported
        self._sensor_failures: dict[str, str] = {}
        self.unavailable: dict[str, str] = {}                         # sensor name -> why it was dropped
        self.polls = 0

    async def run(self) -> None:
        """Poll until cancelled; closes sensors that have a ``close()`` on the way out."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = loop.time()
                await self.poll_once()
                await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))
        finally:
            for sensor in self.sensors:
                close = getattr(sensor, "close", None)
                if callable(close):
                    close()

    async def poll_once(self) -> list[HealthVerdict]:
        """One round (also handy in tests): returns the verdicts reported to ``on_verdicts``."""
        results = await asyncio.gather(*(asyncio.to_thread(_read_guarded, s) for s in self.sensors))
        now = self._clock()
        readings: list[Reading] = []
        for sensor, outcome in zip(list(self.sensors), results):
            readings.extend(self._absorb(sensor, outcome, now))
        verdicts = self.engine.observe(readings, now)
        if self._straggler is not None and self._step_times is not None:
            verdicts += self._straggler.observe(self._step_times(), now)
        self.polls += 1
        for reading in readings:
            self._readings[(reading.device, reading.metric)] = reading
        self._verdicts = {v.device: v for v in verdicts}
        changed = [v for v in verdicts if self._reported.get(v.device, _HEALTHY) != _key(v)]
        if changed:
            try:
                await self._on_verdicts(changed)
            except Exception as exc:  # noqa: BLE001 - a failed delivery is retried, not fatal
                self._log(f"health: delivering {len(changed)} verdict(s) failed, will retry: {exc!r}")
                return []
            for verdict in changed:
                self._reported[verdict.device] = _key(verdict)
        return changed

    def _absorb(self, sensor: Sensor, outcome: list[Reading] | BaseException, now: float) -> list[Reading]:
        if isinstance(outcome, SensorUnavailable):
            self.sensors.remove(sensor)
            self.unavailable[sensor.name] = str(outcome)
            self._log(f"health: {outcome}; running without sensor {sensor.name!r}")
            return []
        if isinstance(outcome, BaseException):
            why = f"{type(outcome).__name__}: {outcome}"
            if self._sensor_failures.get(sensor.name) != why:     # say it when it changes, not every poll
                self._log(f"health: sensor {sensor.name!r} failed: {why}")
            self._sensor_failures[sensor.name] = why
            # Everything this sensor vouched for is now unknown, and so is the sensor itself.
            unknown = [Reading(device, metric, None, now, error=f"sensor {sensor.name} failed: {why}")
                       for device, metric in sorted(self._sensor_metrics.get(sensor.name, ()))]
            return unknown + [Reading(sensor.name, SENSOR, None, now, error=why)]
        if self._sensor_failures.pop(sensor.name, None) is not None:
            self._log(f"health: sensor {sensor.name!r} reads again")
            outcome = outcome + [Reading(sensor.name, SENSOR, 0.0, now)]
        self._sensor_metrics[sensor.name] = {(r.device, r.metric) for r in outcome if r.metric != SENSOR}
        return outcome

    @property
    def verdicts(self) -> list[HealthVerdict]:
        """The latest verdict of every device (reported or not)."""
        return list(self._verdicts.values())

    def redeliver(self, devices: Iterable[str]) -> None:
        """Deliver the next verdict of each of ``devices`` whatever it is. For a consumer that holds effects
        of earlier verdicts (taints) which this monitor may not know it delivered: a run cancelled during a
        delivery never recorded it, and a recovery would then look like "no change" forever."""
        for device in devices:
            self._reported[device] = _UNSURE

    def snapshot(self) -> dict[str, Any]:
        """Versioned JSON for ``P health/<node_id>`` (what ``tpassctl status`` shows)."""
        return {
            "v": 1,
            "polls": self.polls,
            "unavailable": dict(self.unavailable),
            "readings": [r.to_json() for r in self._readings.values()],
            "verdicts": [v.to_json() for v in self._verdicts.values()],
        }


_Key = tuple[Status, TaintEffect, str | None]   # what a verdict is reported on (not its live figures)
_HEALTHY: _Key = (Status.HEALTHY, TaintEffect.NONE, None)
_UNSURE = (None, None, None)   # equal to no verdict's key: the next verdict is delivered


def _key(verdict: HealthVerdict) -> _Key:
    # Reasons carry live figures; reporting on every figure change would flood etcd.
    if verdict.status is Status.HEALTHY:
        return _HEALTHY
    return (verdict.status, verdict.effect, verdict.metric)


def _read_guarded(sensor: Sensor) -> list[Reading] | BaseException:
    try:
        return list(sensor.read())
    except Exception as exc:  # noqa: BLE001 - judged by the caller: unavailable vs failed
        return exc


def device_for_local_rank(local_rank: int, visible: str | None) -> str:
    """The device name (as :class:`NvmlSensor` names it) of the GPU a worker with this local rank uses.

    ``visible`` is the agent's ``CUDA_VISIBLE_DEVICES`` (None: unset). Worker ``i`` uses the
    ``i``-th visible GPU. Integer entries are NVML indices, which match CUDA's only with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (what clusters set); UUID/MIG entries are returned as-is.
    """
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    if visible is None:
        return f"gpu{local_rank}"
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if not entries:
        raise ValueError("CUDA_VISIBLE_DEVICES is empty: no GPU is visible")
    if local_rank >= len(entries):
        raise ValueError(f"local rank {local_rank} but CUDA_VISIBLE_DEVICES={visible!r} has {len(entries)} GPU(s)")
    entry = entries[local_rank]
    try:
        index = int(entry)
    except ValueError:
        return entry
    if index < 0:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} hides GPU {local_rank} (entry {entry})")
    return f"gpu{index}"
