"""The scheduler plugin interface: what tpassrun asks of a cluster scheduler (Slurm today, Kubernetes later).

Three arrows, each one method:

* scheduler -> tpassrun: :meth:`SchedulerPlugin.nodes` reads the state of the job's nodes (up, draining, down, with
  who asked and why); the watcher (:mod:`tpassrun.scheduler.watch`) turns a drain into a planned migration of the
  node's ranks, a down node into a lost one, a node back up into spare capacity;
* tpassrun -> scheduler: :meth:`SchedulerPlugin.drain` / :meth:`SchedulerPlugin.resume` a node the job found
  unhealthy or lost (so nothing new lands there) and gave back;
* the job's record: :meth:`SchedulerPlugin.annotate` writes what the job did (its swaps) where an operator of that
  scheduler looks;
* a node handed back: :meth:`SchedulerPlugin.allocation` reads the job's nodes, :meth:`SchedulerPlugin.release`
  takes nodes the job no longer uses (an operator's drained node whose ranks and agent have left) out of the job.

Every method is blocking (a command line tool or an HTTP call); the watcher calls them off the event loop.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence


class NodeState(str, enum.Enum):
    UP = "up"            # schedulable (idle, allocated, mixed)
    DRAIN = "drain"      # an operator asked for the node back: no new work; its current work should move off
    DOWN = "down"        # the scheduler gave up on the node (not responding, failed): its work is lost
    UNKNOWN = "unknown"  # not in the scheduler's answer (a transient error, a name it does not know)


@dataclass(frozen=True)
class SchedNode:
    """One node as the scheduler sees it."""

    name: str
    state: NodeState
    reason: str = ""     # the operator's words (Slurm's Reason=), without who and when
    who: str = ""        # who set it (Slurm's ``[user@time]`` suffix), when the scheduler says
    raw_state: str = ""  # the scheduler's own spelling (ALLOCATED+DRAIN), for the console
    drain: bool = False  # no new work goes there, whatever the state (Slurm's DOWN+DRAIN: drained and down)


@dataclass(frozen=True)
class SchedJob:
    """The job's allocation as the scheduler sees it now."""

    nodes: tuple[str, ...]       # the nodes allocated to the job (Slurm's NodeList=), in order
    batch_host: str = ""         # the node that runs the batch script (Slurm cannot take it out of the job)


class SchedulerError(Exception):
    """A scheduler command failed (its one-line message: permission denied, unknown node, ...)."""


class SchedulerPlugin(Protocol):
    """What the watcher needs of a scheduler. ``name``: how the console names it (``Slurm``)."""

    name: str
    job_id: str

    def nodes(self, names: Sequence[str]) -> Mapping[str, SchedNode]:
        """The state of these nodes; a node missing from the answer is left out. Raises SchedulerError."""
        ...

    def drain(self, node: str, reason: str) -> None:
        """Take the node out of scheduling with this reason. Raises SchedulerError (e.g. not allowed)."""
        ...

    def resume(self, node: str) -> None:
        """Give a node drained by :meth:`drain` back to scheduling. Raises SchedulerError."""
        ...

    def annotate(self, text: str) -> None:
        """Record ``text`` on the job, replacing what the last call wrote. Raises SchedulerError."""
        ...

    def allocation(self) -> SchedJob:
        """The job's nodes now. Raises SchedulerError."""
        ...

    def release(self, keep: Sequence[str]) -> None:
        """Shrink the job's allocation to ``keep`` (a subset of its nodes): the others go back to the scheduler.
        Only for nodes where no process of the job runs any more (Slurm SIGKILLs what still runs there). Raises
        SchedulerError."""
        ...


__all__ = ["NodeState", "SchedJob", "SchedNode", "SchedulerError", "SchedulerPlugin"]
