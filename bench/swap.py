"""Planned swap of a rank with ~300 MB of tracked state vs. torchrun's whole-group restart on the same job.

    python bench/swap.py [--trials 2] [--state-mb 300] [--quick]

tpassrun: 4 ranks + 1 spare of ``examples/train_ddp.py`` with ``--hidden`` chosen so that model + AdamW state
is about ``--state-mb`` MB, on an external etcd (started here, like tests/conftest.py's). At step
``--taint-at`` the bench runs ``tpassctl taint --rank 1`` (tests/faults.taint). From the taint's own ``time``
(written by tpassctl) and the agent's event log it splits the swap into phases: decided, boundary reached
(the survivors pause there), transfer start/end, world re-formed, resumed, and the boundary step finished on
all ranks. The transfer's throughput (nbytes / seconds of ``swap_transfer_end``) is compared with raw loopback
TCP (sendall / recv_into of a buffer of the same size between two processes, bench/transfer.py's code),
measured right after each tpassrun trial, on the same host load.

torchrun: the same job (4 ranks) with ``--max-restarts 1`` and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(torchrun 2.13's default restart fails, torchrun.md 3.7), SIGKILL of rank 1 in backward of the step at
which the preceding tpassrun trial swapped: kill -> next step done on all ranks, and steps lost (the job has
no checkpoint, so every step done before the kill is done again).

Like for like with torchrun's "kill -> next step on all ranks", tpassrun's interruption is "boundary reached
(training stopped) -> boundary step done on all ranks"; both include one step of compute.

Targets: swap (taint -> resumed) <= 1 s + transfer time; transfer >= 70% of raw TCP; >= 5x faster than
torchrun's restart (printed both like for like and against taint -> resumed); 0 steps lost.
Trials alternate tpassrun, torchrun. Figures only; the last line is JSON.
"""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from common import (
    TORCHRUN_RESTART_ENV,
    EtcdServer,
    Job,
    Series,
    Workdir,
    add_common_args,
    alternate,
    events,
    faults_env,
    first_event,
    hidden_for_state,
    kill_at,
    marker_time,
    next_step_after,
    print_json,
    ratio_line,
    run_to_end,
    step_done_all,
    steps_lost,
    tail,
    taint,
    taint_times,
    tracked_state_bytes,
)
from transfer import raw_receiver, send_raw, start_receiver

LAUNCHERS = ("tpassrun", "torchrun")
WORLD = 4
VICTIM = 1
PHASES = ("swap_decided", "swap_boundary_reached", "swap_transfer_start", "swap_transfer_end",
          "swap_world_reformed", "swap_resumed")


def raw_tcp_gbps(nbytes: int) -> float:
    """One sendall / recv_into of ``nbytes`` over loopback between this process and a fresh one."""
    proc, _reports, port = start_receiver(raw_receiver, nbytes, 1)
    try:
        payload = memoryview(bytearray(b"\x5a" * nbytes))
        return nbytes / send_raw(port, payload) / 1e9
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()


def swap_trial(out: str, etcd: EtcdServer, args: argparse.Namespace, hidden: int) -> dict[str, Any]:
    """Run the tpassrun job, taint rank 1 at ``--taint-at``; the swap's timeline in seconds after the taint."""
    run_id = "bench-" + uuid.uuid4().hex[:8]
    job = Job.tpassrun(out, endpoint=etcd.endpoint, run_id=run_id, nproc=WORLD, spares=1, steps=args.steps,
                       step_sleep=0.0, script_args=["--hidden", str(hidden)])

    def taint_when_warm(job: Job) -> None:
        job.wait_step(args.taint_at, timeout=600)
        if taint(etcd.endpoint, run_id, rank=VICTIM, reason="bench") != 0:
            raise RuntimeError("tpassctl taint failed")

    code, _started = run_to_end(job, timeout=900, during=taint_when_warm)
    result: dict[str, Any] = {"code": code, "log": tail(job)}
    times = taint_times(etcd.endpoint, run_id)
    evs = events(out)
    if code != 0 or not times or first_event(evs, "swap_resumed") is None:
        return result
    origin = times[0]
    timeline = {name: ev["time"] - origin for name in PHASES if (ev := first_event(evs, name))}
    boundary = first_event(evs, "swap_boundary_reached")["step"]
    done = step_done_all(out, WORLD)
    if boundary not in done:
        return result
    timeline["boundary step done on all ranks"] = done[boundary] - origin
    end = first_event(evs, "swap_transfer_end")
    reform = first_event(evs, "swap_reform_timings")
    result.update(
        timeline=timeline, boundary=boundary, nbytes=end["nbytes"], transfer_s=end["seconds"],
        transfer_gbps=end["nbytes"] / end["seconds"] / 1e9,
        paused_s=timeline["swap_resumed"] - timeline["swap_boundary_reached"],
        # like torchrun's kill -> next step: from training stopping to the next step done everywhere
        interrupted_s=timeline["boundary step done on all ranks"] - timeline["swap_boundary_reached"],
        reform_callbacks_s=max((r.get("callbacks_s", 0.0) for r in reform["ranks"].values()), default=None)
        if reform else None,
        lost=steps_lost(out, WORLD, args.steps))
    return result


def restart_trial(out: str, args: argparse.Namespace, hidden: int, kill_step: int) -> dict[str, Any]:
    marker = out + "-marker"
    job = Job.torchrun(out, nproc=WORLD, steps=args.steps, step_sleep=0.0, extra=["--max-restarts", "1"],
                       env={**faults_env(kill_at(VICTIM, kill_step, marker)), **TORCHRUN_RESTART_ENV})
    job.argv += ["--hidden", str(hidden)]  # Job.torchrun takes no script arguments; the script's come last
    code, _started = run_to_end(job, timeout=900)
    kill_wall = marker_time(marker)
    took = next_step_after(out, WORLD, kill_wall) if kill_wall is not None else None
    return {"code": code, "log": tail(job), "restart_s": took, "kill_step": kill_step,
            "lost": steps_lost(out, WORLD, args.steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, trials=2)
    parser.add_argument("--state-mb", type=float, default=300, help="model + AdamW state to move, MB")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--taint-at", type=int, default=3, help="rank 0's step at which to taint rank 1")
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    hidden = hidden_for_state(int(args.state_mb * 1e6))
    state = tracked_state_bytes(hidden)

    swap_s, transfer_s, over_s = Series("taint -> resumed", "s"), Series("transfer", "s"), Series(
        "swap minus transfer", "s")
    paused = Series("paused (boundary reached -> resumed)", "s")
    interrupted = Series("stopped -> next step on all ranks", "s")
    gbps = Series("throughput", "GB/s")
    lost = Series("steps lost (redone + missing)", "steps")
    trials_out: list[dict[str, Any]] = []
    failures: list[str] = []
    print(f"{WORLD} ranks + 1 spare, --hidden {hidden}: model + AdamW {state / 1e6:.0f} MB; {args.steps} steps, "
          f"taint at step {args.taint_at}; {trials} trial(s) per launcher")
    last_boundary = args.taint_at + 1
    etcd = EtcdServer().start()
    try:
        with Workdir(keep=args.keep) as work:
            for trial, launcher in alternate(LAUNCHERS, trials):
                out = work.sub(f"{launcher}-{trial}")
                if launcher == "tpassrun":
                    r = swap_trial(out, etcd, args, hidden)
                    if "timeline" not in r:
                        failures.append(f"tpassrun trial {trial}: exit {r['code']}\n{r['log']}")
                        print(f"  trial {trial} tpassrun  FAILED (exit {r['code']})")
                        continue
                    last_boundary = r["boundary"]
                    r["raw_gbps"] = raw_tcp_gbps(r["nbytes"])
                    swap_s.add("tpassrun", r["timeline"]["swap_resumed"])
                    transfer_s.add("tpassrun", r["transfer_s"])
                    over_s.add("tpassrun", r["timeline"]["swap_resumed"] - r["transfer_s"])
                    paused.add("tpassrun", r["paused_s"])
                    interrupted.add("tpassrun", r["interrupted_s"])
                    gbps.add("handoff", r["transfer_gbps"])
                    gbps.add("raw TCP", r["raw_gbps"])
                    lost.add("tpassrun", r["lost"]["redone"] + r["lost"]["missing"])
                    print(f"  trial {trial} tpassrun  boundary step {r['boundary']}, {r['nbytes'] / 1e6:.0f} MB in "
                          f"{r['transfer_s']:.3f} s = {r['transfer_gbps']:.2f} GB/s (raw TCP {r['raw_gbps']:.2f}); "
                          f"paused {r['paused_s']:.3f} s; DDP rebuild {r['reform_callbacks_s']} s; lost {r['lost']}")
                    print("      " + "  ".join(f"{k} +{v:.3f}s" for k, v in r["timeline"].items()))
                else:
                    r = restart_trial(out, args, hidden, last_boundary)
                    if r["code"] != 0 or r["restart_s"] is None:
                        failures.append(f"torchrun trial {trial}: exit {r['code']}\n{r['log']}")
                        print(f"  trial {trial} torchrun  FAILED (exit {r['code']})")
                        continue
                    interrupted.add("torchrun", r["restart_s"])
                    lost.add("torchrun", r["lost"]["redone"] + r["lost"]["missing"])
                    print(f"  trial {trial} torchrun  kill at step {r['kill_step']}: next step after "
                          f"{r['restart_s']:.2f} s; lost {r['lost']}")
                trials_out.append({k: v for k, v in r.items() if k != "log"} | {"launcher": launcher})
    finally:
        etcd.cleanup()

    print(swap_s.line("tpassrun"))
    print(transfer_s.line("tpassrun"))
    print(over_s.line("tpassrun"))
    print(paused.line("tpassrun"))
    print(gbps.line("handoff", 2))
    print(gbps.line("raw TCP", 2))
    print(interrupted.line("tpassrun"))
    print(interrupted.line("torchrun"))
    print(lost.line("tpassrun", 0))
    print(lost.line("torchrun", 0))
    transfer_ratio = gbps.ratio("handoff", "raw TCP")
    speedup = interrupted.ratio("torchrun", "tpassrun")
    speedup_vs_taint = (interrupted.median("torchrun") / swap_s.median("tpassrun")
                        if interrupted.median("torchrun") and swap_s.median("tpassrun") else None)
    print(ratio_line("swap minus transfer time (median), s", over_s.median("tpassrun"), 1.0, at_most=True))
    print(ratio_line("transfer / raw TCP throughput (medians)", transfer_ratio, 0.70, at_most=False))
    print(ratio_line("speed-up, stopped -> next step (torchrun/tpassrun)", speedup, 5.0, at_most=False))
    print(ratio_line("speed-up, torchrun restart / taint -> resumed", speedup_vs_taint, 5.0, at_most=False))
    print(ratio_line("tpassrun steps lost (median)", lost.median("tpassrun"), 0, at_most=True))
    for failure in failures:
        print(failure)
    print_json({"bench": "swap", "hidden": hidden, "state_bytes": state, "trials": trials_out,
                "transfer_ratio": transfer_ratio, "speedup": speedup, "speedup_vs_taint": speedup_vs_taint, "failures": len(failures),
                "torchrun_env": TORCHRUN_RESTART_ENV})


if __name__ == "__main__":
    main()
