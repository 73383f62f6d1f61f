"""What a worker tells its agent about a failed step, and where its own lines about it go: the kind of failure
(:class:`StepFailure`, the ``failure`` of a :class:`~tpassrun.channel.protocol.Failed`) and the log file both sides
name (:func:`worker_log_file`). The worker classifies (:mod:`tpassrun.worker.failure`); the agent judges
(:mod:`tpassrun.agent.cause`)."""

from __future__ import annotations

import enum
import os

#: the file beside a worker's ``error.json`` tpassrun's own lines about it go to when its stderr has no log file
DETAIL_LOG = "tpassrun.log"


class StepFailure(str, enum.Enum):
    """Where an exception in a step came from, read from its type and its raising frame (never its message).

    Only the distributed kinds park the worker for a recovery; a ``USER`` error takes torchrun's failure
    path (a swap cannot fix a bug in the script).
    """

    DIST_ERROR = "dist_error"      # torch.distributed.DistError or a subclass (typed by torch itself)
    COLLECTIVE = "collective"      # raised inside torch.distributed or DDP's own code (gloo raises RuntimeError)
    BACKWARD = "backward"          # raised by autograd's engine in a distributed job: DDP all-reduces in its hooks
    CASUALTY = "casualty"          # anything else, but the agent saw a peer of its world fail first (tpassrun/agent/cause.py)
    USER = "user"                  # anything else

    @property
    def distributed(self) -> bool:
        return self is not StepFailure.USER


def worker_log_file(error_file: str | None) -> str | None:
    """The log file of the worker whose ``TORCHELASTIC_ERROR_FILE`` is ``error_file``: its ``stderr.log`` when
    ``--redirects``/``--tee`` gave its stderr one, else :data:`DETAIL_LOG` beside it; ``None`` without a log
    directory (``--log-dir /dev/null``). The agent names the same file in its events."""
    if not error_file:
        return None
    wdir = os.path.dirname(error_file)
    stderr_log = os.path.join(wdir, "stderr.log")
    return stderr_log if os.path.exists(stderr_log) else os.path.join(wdir, DETAIL_LOG)
