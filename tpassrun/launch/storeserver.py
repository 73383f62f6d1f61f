"""A fresh bootstrap TCPStore for one generation, in its own process.

torchrun 2.13 reuses one agent-owned TCPStore across restarts, so a restarted worker can read the previous
attempt's gloo addresses (torchrun.md §3.7). tpassrun starts one of these per generation on the node of group
rank 0 and kills it when the generation ends, so no key can outlive its generation. Swaps inside a
generation use it too, each re-formed world under its own key prefix.

Run as ``python -m tpassrun.launch.storeserver HOST PORT``; prints ``ready PORT`` once listening.
"""

from __future__ import annotations

import signal
import sys
from datetime import timedelta


def main(argv: list[str]) -> int:
    host, port = argv[0], int(argv[1])
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=24))
    print(f"ready {store.port}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
