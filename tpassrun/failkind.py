"""What kind of failure a worker's death is, from the worker's own report (pure).

The distinction that matters: an **infrastructure** failure (the process was killed by a signal, it hung and
our watchdog killed it, it lost a peer in a collective, it exited without telling us why) may be survived by
handing the rank to a spare; a **user error** (the script raised an ordinary exception in its step) would only
raise again on the spare, so the job takes torchrun's path at once: failure report, ``--max-restarts``, exit 1.

The worker says which it is through the shared-memory channel before the exception leaves the step loop
(``WorkerPhase.RAISED``), so the agent reads it synchronously when it reaps the process, never racing a socket
message and never parsing error messages. This is the one place that turns those facts into a kind.
"""

from __future__ import annotations

import enum
import signal

from .channel import WorkerPhase


class FailureKind(str, enum.Enum):
    USER_ERROR = "user_error"    # the step raised an ordinary exception: torchrun's path, never a spare
    SIGNAL = "signal"            # killed by a signal (SIGKILL, OOM killer, segfault, our hang watchdog)
    EXIT_CODE = "exit_code"      # a non-zero exit the worker did not explain (os._exit, sys.exit in a step)
    COLLECTIVE = "collective"    # it exited while failed in a collective (a peer went away)


#: kinds a spare may take over (the rest follow torchrun's path)
RECOVERABLE = frozenset({FailureKind.SIGNAL, FailureKind.EXIT_CODE, FailureKind.COLLECTIVE})


def classify_death(code: int, phase: WorkerPhase | int) -> tuple[FailureKind, str]:
    """The kind of a managed worker's non-zero exit ``code`` (negative: killed by that signal), given the
    last phase it wrote into the channel, and a one-line why."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return FailureKind.SIGNAL, f"killed by {name}"
    if phase == WorkerPhase.RAISED:
        return FailureKind.USER_ERROR, f"the training script raised an exception (exit code {code})"
    if phase == WorkerPhase.FAILED:
        return FailureKind.COLLECTIVE, f"exited with {code} after a collective failed"
    return FailureKind.EXIT_CODE, f"exited with code {code}"


def recoverable(kind: FailureKind) -> bool:
    return kind in RECOVERABLE
