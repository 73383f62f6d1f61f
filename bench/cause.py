"""A rank of a torchtitan-Trainer-shaped job SIGKILLed at a uniformly random instant, N times: live and exact?

tests/titan_trainer.py (4 ranks of FSDP2 + 1 warm spare, gloo, real etcd) steps as torchtitan 0.3.0's Trainer does:
loss and token count reduced through ``torchtitan.distributed.utils`` (functional collectives: a peer's death
surfaces as gloo's "Connection reset by peer" raised from ``torch/_ops.py``), grad clipping with
``dist_utils.clip_grad_norm_``. Each run kills a random rank at a uniformly random instant of the 0.3 s after it
logged a random step, and counts: live (exit 0, recovered by the spare, no fallback), exact (final state
``torch.equal`` to the same script under torchrun, every step's loss the reference's), and how many survivors'
exceptions the agent judged casualties (those raised outside torch.distributed: before issue 22 each of them
ended the job as a "user error").

    python bench/cause.py --runs 10 [--wait-in-script] [--seed N]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import uuid

from common import REPO, Workdir
from conftest import EtcdServer  # tests/ is on the path: common.py
from faults import faults_env, hold_at, pids_by_rank
from realjobs import assert_same_run, sigkill_at_random_instant, swap_pause_s, torchrun_job, tpassrun_job

SCRIPT = os.path.join(REPO, "tests", "titan_trainer.py")
WORLD = 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--wait-in-script", action="store_true", help="also a handle.wait() in the script's own file")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    more = ["--wait-in-script"] if args.wait_in_script else []
    print(f"cause: {args.runs} runs, {args.steps} steps, seed {seed}", flush=True)
    live = exact = casualties = 0
    etcd = EtcdServer().start()
    try:
        with Workdir() as work:
            ref = torchrun_job(work.sub("ref"), SCRIPT, WORLD, ["--steps", str(args.steps), *more]).start()
            assert ref.wait(300) == 0, ref.log()[-3000:]
            for i in range(args.runs):
                rank, at = rng.randrange(WORLD), rng.randint(2, args.steps - 5)
                late = hold_at(work.sub(f"hold{i}"), args.steps - 2, rank=(rank + 1) % WORLD)
                os.makedirs(late.dir, exist_ok=True)
                job = tpassrun_job(work.sub(f"run{i}"), SCRIPT, WORLD,
                                   ["--steps", str(args.steps), "--step-sleep", "0.05", *more],
                                   endpoint=etcd.endpoint, run_id=uuid.uuid4().hex[:8], env=faults_env(late.fault))
                job.start()
                try:
                    delay = sigkill_at_random_instant(job, rank, at, 0.3, rng)
                    late.release()
                    code = job.wait(300)
                finally:
                    late.release()
                    job.kill()
                events = job.events()
                names = [e["event"] for e in events]
                ok = code == 0 and "swap_resumed" in names and not {"fallback", "restart", "user_error"} & set(names)
                same, why = ok, ""
                if ok:
                    try:
                        assert_same_run(job, ref, WORLD, redone=True)
                        pids = pids_by_rank(job, WORLD)
                        assert all(len(pids[r]) == 1 for r in range(WORLD) if r != rank), pids
                    except AssertionError as exc:
                        same, why = False, str(exc)[:200]
                judged = [e for e in events if e["event"] == "exception_cause"]
                cas = sum(e["cause"] == "casualty" for e in judged)
                live, exact, casualties = live + ok, exact + same, casualties + cas
                print(f"  run {i:2d}: rank {rank} killed {delay:.3f} s after step {at}: exit {code}, "
                      f"live {'yes' if ok else 'NO'}, exact {'yes' if same else 'NO'}, casualties {cas}"
                      + (f", pause {swap_pause_s(job):.2f} s" if ok else "")
                      + (f" [{why}]" if why else "")
                      + ("" if ok else "\n" + job.log()[-1500:]), flush=True)
    finally:
        etcd.cleanup()
    print(f"cause: live {live}/{args.runs}, exact {exact}/{args.runs}, survivors judged casualties {casualties} "
          f"(seed {seed})", flush=True)
    sys.exit(0 if live == exact == args.runs else 1)


if __name__ == "__main__":
    main()
