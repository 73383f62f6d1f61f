"""What kind of failure a worker's death is, from the worker's own report (pure).

The distinction that matters: an **infrastructure** failure (the process was killed by a signal, it hung and
our watchdog killed it, it lost a peer in a collective, it exited without telling us why) may be survived by
handing the rank to a spare; a **user error** (the script raised an ordinary exception in its step) would only
raise again on the spare, so the job takes torchrun's path at once: failure report, ``--max-restarts``, exit 1.

The worker says which it is through the shared-memory channel before the exception leaves the step loop
(``WorkerPhase.RAISED``), so the agent reads it synchronously when it reaps the process, never racing a socket
message and never parsing error messages. This is the one place that turns those facts into a kind.

Before that, a survivor whose exception does not come from torch.distributed (a peer's death surfaces in a
framework's or the script's own files too) asks its agent whose fault it is: :func:`cause_of` judges what the agent
saw around it (:class:`Around`), :mod:`tpassrun.agent.cause` gathers it and answers.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from tpassrun.channel import WorkerPhase


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


# --------------------------------------------------------------------------- a survivor's exception: whose fault
#: How long a worker whose step raised an exception it cannot prove distributed waits, parked with its collectives
#: left open, for a peer failure to show up before its exception is taken for a user error (torchrun's path). A
#: peer SIGKILLed resets the survivors' connections at once, before its own agent has even reaped it; the death
#: then reaches the survivors' agents in milliseconds (their own child, or a failure record in etcd), a second or
#: two on a loaded host. The user error pays this once, at the end of the job.
CAUSE_GRACE_S = 3.0


class Cause(str, enum.Enum):
    CASUALTY = "casualty"        # a peer of its world failed around it: it waits for the recovery (FAILED)
    ROOT_CAUSE = "root_cause"    # nothing failed around it: its own exception, a user error (RAISED, torchrun's path)
    PENDING = "pending"          # not known yet: ask again


@dataclass(frozen=True)
class Around:
    """What the agent knows, ``waited_s`` after a worker of its world raised an exception it could not prove
    distributed: the failures of other ranks of that world (each a one-line why), a recovery of it under way,
    nodes of it that do not answer (cut off or down: their lease will tell) and how long their lease is."""

    waited_s: float
    dead: tuple[str, ...] = ()          # ranks of the world dead of a failure a spare may take over (signal, exit, ...)
    lost_nodes: tuple[str, ...] = ()    # nodes of the world declared lost
    failed_peers: tuple[int, ...] = ()  # other ranks parked FAILED: their collective failed (a connection reset)
    recovering: bool = False            # an unplanned recovery of the world is under way
    silent_nodes: tuple[str, ...] = ()  # member nodes whose agent does not answer
    lease_s: float = 0.0


def interrupted_by(around: Around) -> str:
    """What interrupted a survivor's failed collective, as the console says it ("rank 1's death (killed by
    SIGKILL)", "node n2 lost", "the failure being recovered"); "" while nothing is known of it (pure)."""
    if around.dead:
        return around.dead[0]
    if around.lost_nodes:
        return f"node {around.lost_nodes[0]} lost"
    if around.recovering:
        return "the failure being recovered"
    return ""


def cause_of(around: Around, grace_s: float = CAUSE_GRACE_S) -> tuple[Cause, str]:
    """Whether a worker's exception is a casualty of a peer's failure or the root cause itself, and why (pure).

    Torchelastic's rule, "the first failure is the root cause": while the worker waits for this answer its
    collectives stay open, so nothing it did can have made a peer fail; a peer that died, a node lost, a peer whose
    collective failed, or a recovery under way all mean a failure elsewhere came first. Nothing of the kind within
    ``grace_s`` (plus the lease of a node that does not answer, which may be down): the exception is its own.
    """
    if around.dead:
        return Cause.CASUALTY, f"a casualty of {around.dead[0]}"
    if around.lost_nodes:
        return Cause.CASUALTY, f"a casualty of node {around.lost_nodes[0]} lost"
    if around.recovering:
        return Cause.CASUALTY, "a casualty of the failure being recovered"
    if around.failed_peers:
        return Cause.CASUALTY, f"rank {around.failed_peers[0]}'s collective failed too: a peer's failure"
    limit = grace_s + (around.lease_s if around.silent_nodes else 0.0)
    if around.waited_s < limit:
        return Cause.PENDING, ""
    return Cause.ROOT_CAUSE, f"no other rank failed within {limit:g} s of it: the script's own error"
