#!/usr/bin/env bash
# The live-swap demo: 4 ranks + 1 warm spare on the embedded (private) etcd. At step ~60 rank 1 is tainted
# with `tpassctl taint`; watch it move to the spare while ranks 0, 2, 3 keep their processes and memory.
set -euo pipefail
cd "$(dirname "$0")/.."
# only what the demo needs (torch CPU, tpassrun, etcd); the test command installs the frameworks too
bash scripts/bootstrap.sh --core
PY=.venv/bin/python
WORK=$(mktemp -d -t tpassrun-demo-XXXX)
trap 'kill -- -$JOB 2>/dev/null || true; rm -rf "$WORK"' EXIT

echo "== tpassrun --standalone --nproc-per-node 4 --spares-per-node 1 examples/train_ddp.py --steps 200"
setsid .venv/bin/tpassrun --standalone --nproc-per-node 4 --spares-per-node 1 \
    --log-dir "$WORK/logs" --event-log "$WORK/events.jsonl" \
    examples/train_ddp.py --steps 200 --step-sleep 0.05 --out "$WORK/out" &
JOB=$!

"$PY" - "$WORK" <<'PYEOF'
import json, os, subprocess, sys, time
work = sys.argv[1]
events, out = os.path.join(work, "events.jsonl"), os.path.join(work, "out")

def read_events():
    try:
        with open(events) as fh:
            return [json.loads(l) for l in fh if l.strip()]
    except OSError:
        return []

def step(rank=0):
    try:
        with open(os.path.join(out, f"loss_rank{rank}.jsonl")) as fh:
            rows = [json.loads(l) for l in fh if l.strip()]
        return rows[-1]["step"] if rows else -1
    except OSError:
        return -1

deadline = time.time() + 300
while step() < 60:
    if time.time() > deadline:
        sys.exit("the job did not reach step 60")
    time.sleep(0.2)
start = next(e for e in read_events() if e["event"] == "agent_started")
ctl = [sys.executable, "-m", "tpassrun.ops.ctl"]
addr = ["--rdzv-endpoint", start["endpoint"], "--rdzv-id", start["run_id"]]
print(f"\n== step {step()}: tpassctl taint --rank 1 --reason 'demo: GPU 1 is failing'", flush=True)
subprocess.run(ctl + ["taint", *addr, "--rank", "1", "--reason", "demo: GPU 1 is failing"], check=True)
while not any(e["event"] == "swap_resumed" for e in read_events()):
    if time.time() > deadline:
        sys.exit("the swap did not finish")
    time.sleep(0.1)
print("\n== tpassctl status", flush=True)
subprocess.run(ctl + ["status", *addr])
ev = read_events()
t0 = next(e["time"] for e in ev if e["event"] == "swap_decided")
print("\n== the swap, from the event log")
for e in ev:
    if e["event"].startswith("swap_") and e["event"] != "swap_phase" or e["event"] == "generation_committed":
        extra = {k: e[k] for k in ("step", "nbytes", "seconds", "reason") if k in e}
        print(f"  +{e['time'] - t0:7.3f}s  {e['event']:<24} {extra if extra else ''}")
PYEOF

wait $JOB
echo
"$PY" - "$WORK/out" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
for r in range(4):
    rows = [json.loads(l) for l in open(os.path.join(out, f"loss_rank{r}.jsonl"))]
    pids = sorted({x["pid"] for x in rows})
    steps = [x["step"] for x in rows]
    ok = steps == list(range(len(steps)))
    print(f"rank {r}: {len(steps)} steps, none lost or repeated: {ok}; pids {pids}"
          + ("  <- moved to the spare" if len(pids) > 1 else "  (same process throughout)"))
PYEOF
