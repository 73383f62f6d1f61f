"""tpassrun.launch: starting and following worker processes (tpassrun.launch.procs), their environment and argv
(tpassrun.launch.workerenv). The door holds what other packages use to start a child of their own."""

from tpassrun.launch.procs import die_with_parent, inherit_only

__all__ = ["die_with_parent", "inherit_only"]
