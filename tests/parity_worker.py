#!/usr/bin/env python
"""Parity worker: dumps its environment and command line to $PARITY_OUT, prints a line per stream.

Script args (after any others): ``--exit-code N --exit-rank R``: global rank R exits with N, after
every worker of its attempt has dumped (so the set of dumps is deterministic). ``--linger``: the other ranks
then wait (up to 60 s) to be stopped by the launcher, so they are the failure report's other failures.
``--file-timer``: the dump is written inside a 60 s timer of torch's ``FileTimerClient`` on
``$TORCHELASTIC_TIMER_FILE`` (acquired and released, as a script guarding a step does).
``--tcp-init ADDR:PORT`` (``env`` for ``$MASTER_ADDR:$MASTER_PORT``): first ``init_process_group("gloo",
init_method="tcp://ADDR:PORT")`` and an all-reduce of ``RANK + 1``, whose result goes in the dump.
No torch import without these.
"""

import json
import os
import sys
import time


def _opt(name: str, default: str) -> str:
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has exited; only its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _tcp_init(where: str) -> float:
    import torch
    import torch.distributed as dist

    if where == "env":
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    dist.init_process_group("gloo", init_method=f"tcp://{where}", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    t = torch.tensor([float(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


def main() -> int:
    if "--file-timer" in sys.argv[1:]:
        from torch.distributed.elastic.timer import FileTimerClient, configure, expires

        configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        with expires(after=60, scope="parity"):
            return _main()
    return _main()


def _main() -> int:
    out_dir = os.environ["PARITY_OUT"]
    rank = os.environ.get("RANK", "?")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    tcp = _opt("--tcp-init", "")
    dump = {
        "env": dict(os.environ),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "write_through": sys.stdout.write_through,
        "cwd": os.getcwd(),
    }
    if tcp:
        dump["all_reduce"] = _tcp_init(tcp)
    # Print first, in one write each (under -u, print() writes the newline separately and lines of
    # two workers could interleave); a peer that sees our dump knows our lines are out.
    sys.stdout.write(f"hello-out rank {rank} attempt {attempt}\n")
    sys.stdout.flush()
    sys.stderr.write(f"hello-err rank {rank} attempt {attempt}\n")
    sys.stderr.flush()
    tmp = os.path.join(out_dir, f".{rank}_{attempt}_{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(dump, f)
    os.rename(tmp, os.path.join(out_dir, f"{rank}_{attempt}_{os.getpid()}.json"))

    code = int(_opt("--exit-code", "0"))
    if code and rank == _opt("--exit-rank", "0"):
        peers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            mine = [n for n in os.listdir(out_dir) if n.endswith(".json") and n.split("_")[1] == attempt]
            if len(mine) >= peers:
                break
            time.sleep(0.02)
        if "--linger" not in sys.argv[1:]:
            # ...and until they have exited (0): a launcher that reacts faster than torchrun's 0.1 s poll must
            # not catch one of them still shutting down and report it as stopped.
            pids = [int(n[:-5].split("_")[2]) for n in os.listdir(out_dir)
                    if n.endswith(".json") and n.split("_")[1] == attempt]
            while time.monotonic() < deadline and any(_running(p) for p in pids if p != os.getpid()):
                time.sleep(0.02)
        sys.stdout.flush()
        os._exit(code)
    if code and "--linger" in sys.argv[1:]:
        time.sleep(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
