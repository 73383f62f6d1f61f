"""A sensor that reads JSON a site's own tool writes, so any detector can taint a device.

Format (write it atomically: to a temporary file, then ``rename``)::

    {"v": 1, "readings": [{"device": "gpu0", "metric": "ecc_uncorrected_volatile", "value": 3},
                          {"device": "gpu1", "metric": "temperature_c", "value": null, "error": "sensor offline"}]}

A missing file means "nothing to say" (no readings). A file that cannot be parsed yields one
``UNKNOWN`` reading for the pseudo-device ``file:<path>``, so the problem is visible in
``tpassctl status`` instead of silently ignored; the next good parse clears it.

With ``max_age``, a file not rewritten for that many seconds turns every reading in it into an
error ("stale"): a site tool that died must not keep vouching for a device.

A path that blocks (a FIFO, a hung network file system) must not hold the agent: the file is opened
non-blocking, anything but a regular file is an error, and the read runs on its own daemon thread for at
most ``read_timeout`` seconds; past that it is reported as an error, and no second read starts while the first
is still stuck (so a hung mount costs one thread, and never keeps the agent from exiting).
"""

from __future__ import annotations

import json
import math
import os
import stat
import threading
import time
from typing import Callable

from ._types import SENSOR, Reading


class FileSensor:
    """Polls one JSON file. ``read`` does blocking file I/O (the monitor runs it in a thread)."""

    def __init__(self, path: str, *, max_age: float | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, read_timeout: float = 5.0) -> None:
        self.path = path
        self.name = f"file:{path}"
        self.max_age = max_age
        self._clock = clock
        self._wall_clock = wall_clock   # file mtimes are wall-clock times
        self._was_malformed = False
        self.read_timeout = read_timeout
        self._stuck: threading.Thread | None = None

    def read(self) -> list[Reading]:
        now = self._clock()
        if self._stuck is not None and self._stuck.is_alive():
            return [self._malformed(now, f"cannot read: an earlier read of {self.path} is still blocked")]
        self._stuck = None
        box: dict[str, object] = {}
        reader = threading.Thread(target=self._read_into, args=(box,), name="tpassrun-health-file", daemon=True)
        reader.start()
        reader.join(self.read_timeout)
        if reader.is_alive():
            self._stuck = reader
            return [self._malformed(now, f"cannot read: blocked for more than {self.read_timeout:g}s "
                                         f"(a FIFO or a hung file system?)")]
        exc = box.get("error")
        if isinstance(exc, FileNotFoundError):
            return self._recovered(now)
        if isinstance(exc, OSError):
            return [self._malformed(now, f"cannot read: {exc.strerror or exc}")]
        raw, mtime = box["raw"], box["mtime"]
        assert isinstance(raw, bytes) and isinstance(mtime, float)
        age = self._wall_clock() - mtime
        try:
            readings = _parse(raw, now)
        except ValueError as exc:
            return [self._malformed(now, str(exc))]
        if self.max_age is not None and age > self.max_age:
            why = f"stale: {self.path} not rewritten for {age:.0f}s (max_age {self.max_age:g}s)"
            readings = [Reading(r.device, r.metric, None, now, error=why) for r in readings]
        return self._recovered(now) + readings

    def _read_into(self, box: dict[str, object]) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise OSError(f"{self.path} is not a regular file")
                chunks, size = [], 0
                while size < _MAX_BYTES:
                    chunk = os.read(fd, 1 << 20)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
                box["raw"], box["mtime"] = b"".join(chunks), float(info.st_mtime)
            finally:
                os.close(fd)
        except OSError as exc:
            box["error"] = exc

    def _malformed(self, now: float, why: str) -> Reading:
        self._was_malformed = True
        return Reading(self.name, SENSOR, None, now, error=why)

    def _recovered(self, now: float) -> list[Reading]:
        # Only after a failure: a good reading of the pseudo-device clears its UNKNOWN.
        if not self._was_malformed:
            return []
        self._was_malformed = False
        return [Reading(self.name, SENSOR, 0.0, now)]


_MAX_BYTES = 16 << 20   # a health file is a few KiB; a runaway writer must not cost the agent its memory


def _parse(raw: bytes, now: float) -> list[Reading]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not valid JSON: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict) or data.get("v") != 1:
        raise ValueError("expected an object with \"v\": 1")
    items = data.get("readings")
    if not isinstance(items, list):
        raise ValueError("\"readings\" must be a list")
    readings = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"reading {i} is not an object")
        device, metric, value = item.get("device"), item.get("metric"), item.get("value")
        error = item.get("error")
        if not isinstance(device, str) or not device or not isinstance(metric, str) or not metric:
            raise ValueError(f"reading {i}: \"device\" and \"metric\" must be non-empty strings")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or math.isnan(value)):
            raise ValueError(f"reading {i}: \"value\" must be a number or null, got {value!r}")
        if error is not None and not isinstance(error, str):
            raise ValueError(f"reading {i}: \"error\" must be a string")
        error = error or None   # an empty string explains nothing
        if value is None or error is not None:
            readings.append(Reading(device, metric, None, now, error=error or "no value given"))
        else:
            readings.append(Reading(device, metric, float(value), now))
    return readings
