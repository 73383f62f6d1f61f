"""torchrun's failure report, ``error.json`` handling and exit codes.

The report text is byte-for-byte torchrun's ``ChildFailedError.format_msg``
(torch/distributed/elastic/multiprocessing/errors/__init__.py), so log scrapers keep working.
This module imports nothing from tpassrun.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from string import Template
from typing import Any

log = logging.getLogger(__name__)

NOT_AVAILABLE = "<N/A>"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # same name as envnames.TORCHELASTIC_ERROR_FILE
NO_TRACEBACK_HINT = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

_FAILURE_TEMPLATE = """[${idx}]:
  time      : ${time}
  host      : ${hostname}
  rank      : ${rank} (local_rank: ${local_rank})
  exitcode  : ${exitcode} (pid: ${pid}) ${signal_name}
  error_file: ${error_file}
  traceback : ${message}"""

# The blank first line is torchrun's: the text follows "ChildFailedError: " in its traceback.
_REPORT_TEMPLATE = """
${border}
${title}
${section}
Failures:
${other_failures}
${section}
Root Cause (first observed failure):
${root_failure}
${border}"""


@dataclass(frozen=True)
class ProcessFailure:
    """One failed worker. ``message`` is the error file's ``message`` (a dict with ``extraInfo``
    for ``@record``-written files) or a generated string; ``error_file`` is ``<N/A>`` when absent."""

    local_rank: int
    rank: int
    pid: int
    exitcode: int
    error_file: str
    timestamp: int
    message: str | dict[str, Any]

    @classmethod
    def from_exit(
        cls,
        *,
        local_rank: int,
        rank: int,
        pid: int,
        exitcode: int,
        error_file: str,
        now: Callable[[], float] = time.time,
    ) -> "ProcessFailure":
        """Build it the way torchrun does: read ``error_file`` if the worker wrote one.

        A torn or foreign file (a worker killed mid-write, a script that wrote its own) is logged and then
        treated as no file. torchrun 2.13 raises here ("Failed to parse reply file"), which kills its agent
        with a traceback and never uses ``--max-restarts``; the worker's death is what matters, not its note.
        """
        if error_file and os.path.isfile(error_file):
            try:
                message, timestamp = _read_error_file(error_file)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("Failed to parse reply file: %s (%s: %s); reporting the failure without it",
                            error_file, type(exc).__name__, exc)
            else:
                if message:
                    return cls(local_rank, rank, pid, exitcode, error_file, timestamp, message)
                return cls(local_rank, rank, pid, exitcode, error_file, timestamp, _generated_message(exitcode, pid))
        return cls(local_rank, rank, pid, exitcode, NOT_AVAILABLE, int(now()), _generated_message(exitcode, pid))

    def signal_name(self) -> str:
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return NOT_AVAILABLE
        return NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """``YYYY-MM-DD_HH:MM:SS`` in local time, like torchrun."""
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")


def _read_error_file(path: str) -> tuple[str | dict[str, Any], int]:
    """(message, timestamp) of a ``@record`` error file; raises on anything that is not one."""
    with open(path) as fp:
        data = json.load(fp)
    message = data["message"]
    if isinstance(message, str):
        return message, int(data.get("timestamp", 0))
    if not isinstance(message, dict):
        raise TypeError(f"'message' is a {type(message).__name__}")
    return message, int(message["extraInfo"]["timestamp"])


def _generated_message(exitcode: int, pid: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = NOT_AVAILABLE
        return f"Signal {-exitcode} ({name}) received by PID {pid}"
    return NO_TRACEBACK_HINT


def root_cause(failures: Sequence[ProcessFailure]) -> ProcessFailure:
    """The first observed failure: smallest timestamp, first in order on a tie."""
    return min(failures, key=lambda f: f.timestamp)


def _format_failure(idx: int, f: ProcessFailure, hostname: str) -> tuple[str, int]:
    msg = f.message
    if isinstance(msg, dict):
        msg = msg.get("extraInfo", {}).get("py_callstack", msg.get("message", NOT_AVAILABLE)).replace("\n", "\n  ")
    sig = f.signal_name()
    text = Template(_FAILURE_TEMPLATE).substitute(
        idx=idx, time=f.timestamp_isoformat(), hostname=hostname, rank=f.rank, local_rank=f.local_rank,
        exitcode=f.exitcode, pid=f.pid, signal_name=f" ({sig})" if sig != NOT_AVAILABLE else "",
        error_file=f.error_file, message=msg,
    )
    return text, max(len(line) for line in text.split("\n"))


def format_failure_report(script_name: str, failures: Sequence[ProcessFailure], *, hostname: str | None = None) -> str:
    """torchrun's report: every failure of the last attempt, root cause last. ``failures`` is in
    torchrun's order (the first observed, then the workers stopped because of them, by local rank); ``hostname``
    defaults to ``socket.getfqdn()``."""
    if not failures:
        raise ValueError("a failure report needs at least one failure")
    host = socket.getfqdn() if hostname is None else hostname
    title = f"{script_name} FAILED"
    root = root_cause(failures)
    root_fmt, others, width = "", [], len(title)
    for idx, f in enumerate(failures):
        text, w = _format_failure(idx, f, host)
        width = max(width, w)
        if f is root:
            root_fmt = text
        else:
            others.append(text)
    width = min(width, 60)
    return Template(_REPORT_TEMPLATE).substitute(
        border="=" * width, title=title, section="-" * width, root_failure=root_fmt,
        other_failures="\n".join(others or ["  <NO_OTHER_FAILURES>"]),
    )


def copy_root_cause_error_file(failures: Sequence[ProcessFailure], environ: Mapping[str, str]) -> str | None:
    """What torchrun's ``@record`` does for the launcher: if the launcher itself has
    ``TORCHELASTIC_ERROR_FILE``, copy the root cause's error file there with ``errorCode`` set.

    Returns the path written, or ``None`` (no parent error file, or the root cause left none).
    """
    target = environ.get(ERROR_FILE_ENV)
    if not failures or not target:
        return None
    root = root_cause(failures)
    if root.error_file == NOT_AVAILABLE or not os.path.isfile(root.error_file):
        log.info("local_rank %s FAILED with no error file. Decorate your entrypoint fn with @record "
                 "for traceback info. See: https://pytorch.org/docs/stable/elastic/errors.html", root.rank)
        return None
    try:
        with open(root.error_file) as fp:
            data = json.load(fp)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
    except (OSError, ValueError, TypeError) as exc:
        log.warning("not copying %s to %s: %s", root.error_file, target, exc)
        return None
    # The child cannot record its own code when a signal killed it: the launcher knows it.
    if root.exitcode and isinstance(data.get("message"), dict):
        data["message"]["errorCode"] = root.exitcode
    if os.path.isfile(target):
        os.remove(target)
    with open(target, "w") as fp:
        fp.write(json.dumps(data))
    return target


class RunOutcome(str, enum.Enum):
    SUCCEEDED = "succeeded"
    WORKERS_FAILED = "workers_failed"  # restarts/spares exhausted
    AGENT_ERROR = "agent_error"  # rendezvous closed/timeout, store errors
    SIGNALLED = "signalled"  # a --signals-to-handle signal after workers started


def exit_code(outcome: RunOutcome) -> int:
    """torchrun's exit codes: 0 on success, 1 for everything else, whatever the worker's own code."""
    return 0 if outcome is RunOutcome.SUCCEEDED else 1
