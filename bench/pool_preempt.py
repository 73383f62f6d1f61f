"""Time from a node's SIGKILL to its ranks training again: a pool node pre-empted from a lower-priority job vs a
dedicated ``--spare-node`` of the job's own (issue 24, item 3's closing figure).

Each trial is a real run on one etcd (``tests/test_pool_preempt_e2e.py``): the high job is 2 nodes x 2 ranks
(``examples/train_ddp.py``); node B is SIGKILLed once every rank reached step 3; "training again" is the leader's
``node_recovered`` event, on the same host's monotonic clock as the kill.

- pre-empt: one pool node runs a low-priority elastic job's member (``--nnodes 1:2 --pool-members 1``); the high
  job (``--spare-pool``, ``--priority 5``, no spares of its own) asks it to leave, claims it when idle, its spare
  node starts there and takes B's ranks live (a cold spare: the tpassrun agent and its workers start after the kill).
- idle pool: the same pool node idle (no lower-priority job): the claim without a pre-emption, so that
  pre-empt minus idle pool is what the pre-emption itself costs.
- spare node: a third agent started with ``--spare-node`` at the job's start (warm: its workers are up before the
  kill).

    python bench/pool_preempt.py [--trials 3]

Trials alternate; the load (``uptime``) is printed with each, since no figure taken on shared cores is final.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import uuid
from pathlib import Path

from common import EtcdServer  # puts tests/ on the path
from faults import sigkill_node
from test_pool_e2e import _with_a_pool_node
from test_pool_preempt_e2e import preempt_run, spare_node_run, training_again


def idle_pool_run(tmp: Path, endpoint: str, run_id: str) -> dict:
    return _with_a_pool_node(tmp, endpoint, run_id, lambda b, _train: (sigkill_node(b), b.worker_pids()))


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    server = EtcdServer().start()
    got: dict[str, list[float]] = {"pre-empt": [], "idle pool": [], "spare node": []}
    try:
        for t in range(args.trials):
            for name, run in (("pre-empt", preempt_run), ("idle pool", idle_pool_run), ("spare node", spare_node_run)):
                with tempfile.TemporaryDirectory(prefix="pool-preempt-") as tmp:
                    load = _load()
                    out = run(Path(tmp), server.endpoint, "b-" + uuid.uuid4().hex[:8])
                    got[name].append(training_again(out))
                    extra = ""
                    if name == "pre-empt":
                        ev = {e["event"]: e["mono"] - out["t_kill"] for e in reversed(out["events"])}
                        extra = (f" (pre-emption asked at {ev.get('pool_preempting', float('nan')):.2f} s, pool node "
                                 f"claimed at {ev.get('pool_claimed', float('nan')):.2f} s)")
                    print(f"trial {t + 1} {name:>10}: training again {got[name][-1]:6.2f} s after the SIGKILL"
                          f"{extra}; load {load} -> {_load()}", flush=True)
    finally:
        server.cleanup()
    print(f"\n{'':>12}  {'median':>8}  {'min':>8}  {'max':>8}   (s from B's SIGKILL to its ranks training again)")
    for name, xs in got.items():
        if xs:
            print(f"{name:>12}  {statistics.median(xs):8.2f}  {min(xs):8.2f}  {max(xs):8.2f}   {len(xs)} trial(s)")


if __name__ == "__main__":
    main()
