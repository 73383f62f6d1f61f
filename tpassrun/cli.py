"""``tpassrun`` console script: parse a torchrun command line, hand it to the agent.

Exit codes are torchrun's: 0 success; 1 workers failed, the agent failed, or a value was rejected (torchrun
raises from ``main`` and exits 1; tpassrun prints a :class:`~tpassrun.launch.config.ConfigError` on one line
instead of a traceback); 2 an argparse usage error (unknown flag, a value argparse itself rejects).
"""

from __future__ import annotations

import os
import sys

from tpassrun.launch import parse_args, preflight
from tpassrun.ops import clean
from tpassrun.settings import ConfigError
from tpassrun.settings import envnames as E

USAGE_ERROR = 2     # argparse's code, as torchrun
REJECTED_VALUE = 1  # torchrun's code when run.py raises on a value (unknown backend, bad --nnodes, ...)


def _check_devices(cfg) -> None:  # a LaunchConfig
    """A layout whose spares need more GPUs than the node has is refused before anything starts."""
    if cfg.spares_per_node <= 0:
        return
    from tpassrun.launch import check_layout, node_devices

    try:
        devices = node_devices(os.environ, slots=cfg.nproc_per_node + cfg.spares_per_node)
    except Exception:  # noqa: BLE001 - NVML broken: the agent says so; the layout is not refused for it
        return
    error = check_layout(cfg.nproc_per_node, cfg.spares_per_node, devices)
    if error:
        raise ConfigError(error)


def main(argv: list[str] | None = None) -> int:
    """Run the launcher; returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(args, os.environ)
        preflight(cfg)
        _check_devices(cfg)
    except ConfigError as exc:
        print(clean(f"tpassrun: error: {exc}"), file=sys.stderr)   # it quotes the command line: anyone's text
        return REJECTED_VALUE
    except SystemExit as exc:  # argparse: usage line already printed (or --help)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR

    # gRPC reads its settings when it is first imported (by the agent's etcd client, below): quieted for this
    # process here, while the agent is given the environment as it was, which its workers inherit
    given = dict(os.environ)
    for name, value in E.GRPC_QUIET.items():
        os.environ.setdefault(name, value)
    from tpassrun.agent import run_launcher  # keeps `tpassrun --help` fast

    return run_launcher(cfg, environ=given)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
