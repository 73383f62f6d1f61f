"""Process snapshots with CRIU for the transparent mode (docs/transparent.md): is a usable CRIU here (``probe``),
dump and restore a worker's process tree, stop and continue process groups. The decisions are pure
(:mod:`tpassrun.snapshot.plan`); the effects are the thin :mod:`tpassrun.snapshot.criu`."""

from tpassrun.snapshot.criu import (
                                    NetworkLock,
                                    SnapshotError,
                                    continue_groups,
                                    dump,
                                    probe,
                                    restore,
                                    signal_groups,
                                    stdio_pipes,
                                    stop_groups,
                                    tcp_ports,
                                    wait_gone,
                                    wait_stopped,
)
from tpassrun.snapshot.plan import (
                                    DEFAULT_CRIU,
                                    MIN_VERSION,
                                    WORKER_ENV,
                                    Availability,
                                    Decision,
                                    Move,
                                    Verdict,
                                    criu_candidates,
                                    dump_argv,
                                    first_usable,
                                    judge,
                                    lock_ruleset,
                                    on_death,
                                    on_taint,
                                    parse_version,
                                    restore_argv,
                                    snapshot_due,
)

__all__ = ["DEFAULT_CRIU", "MIN_VERSION", "WORKER_ENV", "Availability", "Decision", "Move", "NetworkLock",
           "SnapshotError", "Verdict", "continue_groups", "criu_candidates", "dump", "dump_argv", "first_usable", "judge",
           "lock_ruleset", "on_death", "on_taint", "tcp_ports",
           "parse_version", "probe", "restore", "restore_argv", "signal_groups", "snapshot_due", "stdio_pipes",
           "stop_groups", "wait_gone", "wait_stopped"]
