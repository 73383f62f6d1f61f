"""``tpassrun`` console script: parse a torchrun command line, hand it to the agent.

Exit codes: 0 success, 1 workers failed or the agent failed (torchrun's rule), 2 bad command line
(argparse usage error, or a :class:`~tpassrun.config.ConfigError` printed on one line).
"""

from __future__ import annotations

import os
import sys

from .config import ConfigError, parse_args

USAGE_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    """Run the launcher; returns the process exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_args(args, os.environ)
    except ConfigError as exc:
        print(f"tpassrun: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # argparse: usage line already printed (or --help)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR

    from .agent import run_launcher  # noqa: PLC0415  (keeps `tpassrun --help` fast)

    return run_launcher(cfg)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
