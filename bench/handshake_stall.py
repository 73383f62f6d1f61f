"""A planned swap's pause with strangers on every listener, and with the leaver's handshake cut (issues 22, 27).

    python bench/handshake_stall.py --trials 2

Modes, each a real job (2 gloo ranks and a spare, real etcd), rank 1 tainted at step 5:

* ``plain``: nothing else.
* ``attack``: 70 silent connections and 2 drippers (one would-be proof byte a second, reconnecting when
  dropped) on the agent's mirror server and on the workers' store from the start, and 40 silent connections and
  3 drippers on the spare's state-transfer listener as soon as it listens (found the way an attacker on the host
  would: its listening socket in /proc).
* ``cut``: the leaver's first connection to the spare is cut after 18 of its 68 handshake bytes (the fault
  ``send``/``cut_handshake``: issue 22's 144 s stall).
* ``attack+cut``: both.

The job is held at step 5 until the swap's boundary is fixed (so a slow spare start cannot let it end first).
Prints per trial the pause (boundary reached -> resumed, as ``bench/swap.py``), the strangers the spare
dropped, transfer retries (attempts after the first), and whether the two DDP replicas ended ``torch.equal``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import EtcdServer, Job, faults_env, taint
from faults import Strangers, hold_at, listening_ports, storeserver_pids

MODES = ("plain", "attack", "cut", "attack+cut")
STEPS = 20


def trial(etcd: Any, mode: str, out: str) -> dict[str, Any]:
    import torch

    run_id = "stall-" + uuid.uuid4().hex[:8]
    cut = {"rank": 1, "step": 0, "where": "send", "action": "cut_handshake", "marker": os.path.join(out, "cut")}
    os.makedirs(out)
    hold = hold_at(out, 5)      # the job waits at step 5 until the swap is decided (however slow the spare's start)
    job = Job.tpassrun(os.path.join(out, "job"), endpoint=etcd.endpoint, run_id=run_id, nproc=2, spares=1,
                       steps=STEPS, step_sleep=0.5,
                       env=faults_env(hold.fault, *([cut] if "cut" in mode else []))).start()
    attacks: list[Strangers] = []
    spare_attacked: list[float] = []
    stop = threading.Event()

    def spare_listener(pid: int) -> None:
        while not stop.is_set():
            ports = listening_ports(pid)
            if ports:
                attacks.append(Strangers(ports[0], silent=40, drippers=3))
                spare_attacked.append(time.time())
                return
            time.sleep(0.01)

    watcher = None
    try:
        hold.wait_reached(job)
        assert job.proc is not None
        if "attack" in mode:
            for port in listening_ports(job.proc.pid) + [p for pid in storeserver_pids(job.proc.pid)
                                                          for p in listening_ports(pid)]:
                attacks.append(Strangers(port, silent=70, drippers=2))
            started = job.wait_event("workers_started")[0]
            spare_pid = next(s["pid"] for s in started["slots"] if s["state"] == "spare")
            watcher = threading.Thread(target=spare_listener, args=(spare_pid,), daemon=True)
            watcher.start()
        if taint(etcd.endpoint, run_id, rank=1, reason="bench") != 0:
            raise RuntimeError("tpassctl taint failed")
        hold.release_after(job, "swap_boundary")
        code = job.wait(600)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(10)
        for a in attacks:
            a.stop()
        hold.release()
        job.kill()
    events = job.events()

    def first(name: str) -> dict[str, Any] | None:
        return next((e for e in events if e["event"] == name), None)

    reached, resumed = first("swap_boundary_reached"), first("swap_resumed")
    equal = code == 0 and all(torch.equal(v, job.final(1)["model"][k]) for k, v in job.final(0)["model"].items())
    return {"mode": mode, "code": code,
            "paused_s": resumed["time"] - reached["time"] if reached and resumed else None,
            "strangers": sum(e["event"] == "swap_transfer_stranger" for e in events),
            "retries": sum(e["event"] == "swap_phase" and e.get("phase") == "send" for e in events) - 1,
            "failed": sum(e["event"] == "swap_transfer_failed" for e in events),
            # the spare's strangers were in before the leaver was told to send (SEND phase)
            "spare_attacked_first": bool(spare_attacked) and any(
                e["event"] == "swap_phase" and e.get("phase") == "send" and e["time"] > spare_attacked[0]
                for e in events),
            "equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    modes = args.modes.split(",")
    results: dict[str, list[float]] = {m: [] for m in modes}
    etcd = EtcdServer().start()
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        for i in range(args.trials):
            for mode in modes:
                r = trial(etcd, mode, os.path.join(tmp, f"{mode}-{i}"))
                print(r, flush=True)
                if r["paused_s"] is not None:
                    results[mode].append(r["paused_s"])
    etcd.stop()
    for mode, values in results.items():
        if values:
            print(f"{mode:>11}: paused median {statistics.median(values):.2f} s "
                  f"(min {min(values):.2f}, max {max(values):.2f}, n={len(values)})")


if __name__ == "__main__":
    main()
