"""``tpassrun.scheduler``: the cluster scheduler's side of a run (the one import for the rest of tpassrun).

* :mod:`~tpassrun.scheduler.base`: the :class:`SchedulerPlugin` interface (watch node states, drain/resume a node,
  annotate the job) and its types;
* :mod:`~tpassrun.scheduler.slurm`: a Slurm step's allocation as rendezvous settings (``srun tpassrun`` needs no
  rendezvous flags) and the plugin over ``scontrol``;
* :mod:`~tpassrun.scheduler.watch`: the leader's watcher task that turns scheduler drains into planned migrations
  and tells the scheduler about the nodes the run tainted or lost (its decisions pure, in ``decide``).

A Kubernetes plugin would be one more module next to ``slurm`` (see docs/kubernetes.md).
"""

from __future__ import annotations

from tpassrun.scheduler.base import NodeState, SchedJob, SchedNode, SchedulerError, SchedulerPlugin
from tpassrun.scheduler.slurm import SlurmPlugin, allocation_from_env, expand_hostlist
from tpassrun.scheduler.watch import SchedulerHost, SchedulerWatch, decide, poll_interval


def watcher_for(host: SchedulerHost) -> SchedulerWatch | None:
    """The watcher of an agent started in a scheduler's step (``cfg.scheduler``), or None."""
    if host.cfg.scheduler != "slurm":
        return None
    try:
        alloc = allocation_from_env(host.environ)
    except ValueError:
        return None
    if alloc is None:
        return None
    return SchedulerWatch(host, SlurmPlugin(alloc.job_id), alloc.nodes, interval=poll_interval(host.environ))


__all__ = ["NodeState", "SchedJob", "SchedNode", "SchedulerError", "SchedulerHost", "SchedulerPlugin", "SchedulerWatch",
           "SlurmPlugin", "allocation_from_env", "decide", "expand_hostlist", "watcher_for"]
