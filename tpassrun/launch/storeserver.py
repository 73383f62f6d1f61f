"""A fresh workers' store for one generation, in its own process (tpassrun.store behind it).

torchrun 2.13 reuses one agent-owned TCPStore across restarts, so a restarted worker can read the previous
attempt's gloo addresses (torchrun.md §3.7). tpassrun starts one of these per generation on the node of group
rank 0 and kills it when the generation ends, so no key can outlive its generation. Swaps inside a
generation use it too, each re-formed world under its own key prefix.

Run as ``python -m tpassrun.launch.storeserver HOST PORT [--no-plain | --plain-on-demand]`` with the store key (hex)
as the first line of stdin (never on the command line); prints ``ready PORT`` once listening. HOST is the advertised
address (loopback for a single node: :func:`tpassrun.store.bind_host`), never every interface. ``--plain-on-demand``
(a standby store): torch, the plain door's, is imported only when a plain client first connects.
"""

from __future__ import annotations

import logging
import os
import signal
import sys


def main(argv: list[str]) -> int:
    from tpassrun.store import serve

    host, port = argv[0], int(argv[1])
    key = bytes.fromhex(sys.stdin.readline().strip())
    server = serve(host, port, key, plain="--no-plain" not in argv[2:], plain_on_demand="--plain-on-demand" in argv[2:])
    print(f"ready {server.port}", flush=True)
    _quiet_cxx_stderr()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


def _quiet_cxx_stderr() -> None:
    """torch's C++ TCPStore (the plain door's, on loopback) prints a warning with a 15-frame backtrace for every
    malformed message, and a port scan sends thousands: its fd 2 goes to /dev/null once the store listens, while
    this process's own log lines (the authenticated door's, throttled per source) keep the agent's stderr."""
    keep = os.fdopen(os.dup(2), "w", buffering=1)
    logging.basicConfig(stream=keep, level=logging.WARNING, format="%(message)s")
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.__stderr__):
            handler.setStream(keep)
    sys.stderr = keep
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
