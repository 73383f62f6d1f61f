"""Where an exception raised by a step came from (the worker's side of failure classification).

Read from the exception's type and its raising frame, never its message. The distributed kinds park the worker
for a recovery; in a world of several ranks a managed worker asks its agent about any other exception (a peer's
failure surfaces in the script's or a framework's own files too) and parks for a recovery when the agent saw a peer
fail first (``CASUALTY``). The agent's side is :mod:`tpassrun.plan.failkind` and :mod:`tpassrun.agent.cause`.
"""

from __future__ import annotations

import enum
import os


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
