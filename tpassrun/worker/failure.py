"""Where an exception raised by a step came from (the worker's side of failure classification).

Read from the exception's type and its raising frame, never its message. The distributed kinds park the worker
for a recovery; in a world of several ranks a managed worker asks its agent about any other exception (a peer's
failure surfaces in the script's or a framework's own files too) and parks for a recovery when the agent saw a peer
fail first (``CASUALTY``). The agent's side is :mod:`tpassrun.plan.failkind` and :mod:`tpassrun.agent.cause`.
"""

from __future__ import annotations

import logging
import os

from tpassrun.channel import StepFailure, worker_log_file
from tpassrun.settings import envnames as E

log = logging.getLogger("tpassrun.worker")

_COLLECTIVE_DIRS = (os.sep.join(("torch", "distributed", "")), os.sep.join(("torch", "nn", "parallel", "")))
_AUTOGRAD_DIR = os.sep.join(("torch", "autograd", ""))


def classify_failure(exc: BaseException) -> StepFailure:
    """Classify ``exc`` raised by a step: by type first, then by the innermost frame that raised it."""
    import traceback

    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return StepFailure.DIST_ERROR
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not frames:
        return StepFailure.USER
    innermost = frames[-1].filename
    if any(d in innermost for d in _COLLECTIVE_DIRS):
        return StepFailure.COLLECTIVE
    if _AUTOGRAD_DIR in innermost and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return StepFailure.BACKWARD
    return StepFailure.USER


def is_distributed_failure(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a collective (a peer may have gone away), not out of the user's code."""
    return classify_failure(exc).distributed


def note_interrupted(rank: int, what: str, kind: StepFailure, exc: BaseException) -> None:
    """A survivor's own line about its failed collective (``what``: "step 5", "the replica check at step 5"): into
    the worker's log file, never onto the console. Its text is gloo's view of a peer's death (three terminal lines
    ending in "GLHF!"); the agent's console line says what interrupted the step (``step_interrupted``). A user's own
    error never comes here: it is re-raised (torchrun's path, its traceback on the console)."""
    text = f"tpassrun: rank {rank}: {what} failed ({kind.value}, {type(exc).__name__}: {exc}); waiting for recovery\n"
    path = worker_log_file(os.environ.get(E.TORCHELASTIC_ERROR_FILE))
    if path is not None:
        try:
            with open(path, "a", encoding="utf-8", errors="replace") as fh:
                fh.write(text)
            return
        except OSError as err:
            log.debug("cannot write %s: %s", path, err)
    log.debug("%s", text.rstrip("\n"))
