#!/bin/bash
# The frames of docs/pool.md's one-machine recipe (a pool node, two jobs drawing from it), taken with tmux:
#   pool-wait-console-120x40.txt   jobB's launcher (tpassrun --tui: its console lines above, the live panel below)
#                                  while it waits for the pool that jobA holds
#   pool-wait-watch-80x24.txt      tpassctl status --watch of jobB at the same moment
# Run from the repository's root, under the shared lock (9 processes with torch):
#   flock /work/heavy.lock bash docs/frames/make-pool-frames.sh
# The commands are docs/pool.md's, with tpassrun's examples/train_ddp.py as train.py.
set -euo pipefail
REPO=$(pwd)
W=$(mktemp -d /tmp/pool-frames-XXXX)
export PATH="$REPO/.venv/bin:$PATH"
cd "$W"
cp "$REPO/examples/train_ddp.py" train.py
PIDS=()
cleanup() {   # what this script started, by pid: SIGTERM (a launcher stops its workers), then SIGKILL
    tmux kill-session -t pfB 2>/dev/null || true
    tmux kill-session -t pfW 2>/dev/null || true
    for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
    sleep 5
    for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
trap cleanup EXIT
set -m    # each background job in a process group of its own (its pid): cleanup ends each whole

etcd --data-dir pool-etcd --listen-client-urls http://127.0.0.1:23791 --advertise-client-urls http://127.0.0.1:23791 \
     --listen-peer-urls http://127.0.0.1:23801 > etcd.log 2>&1 &
PIDS+=($!)
export ETCD=127.0.0.1:23791
until etcdctl --endpoints $ETCD endpoint health > /dev/null 2>&1; do sleep 0.2; done
openssl rand -hex 32 > pool.key && chmod 600 pool.key
export TPASSRUN_POOL_KEY=$(cat pool.key)
tpassctl pool create gpu-pool --rdzv-endpoint $ETCD
tpassctl pool join gpu-pool --rdzv-endpoint $ETCD --nproc-per-node 2 > pool-node.log 2>&1 &
PIDS+=($!)
tpassrun --nnodes 1 --nproc-per-node 2 --rdzv-backend etcd --rdzv-endpoint $ETCD --rdzv-id jobA \
         --spare-pool gpu-pool --pool-wait 60 --max-restarts 1 train.py --steps 4000 --step-sleep 0.1 --out outA \
         > jobA.log 2>&1 &
PIDS+=($!)
tmux new-session -d -s pfB -x 120 -y 40 "PATH=$PATH TPASSRUN_POOL_KEY=$TPASSRUN_POOL_KEY tpassrun --tui --nnodes 1 \
    --nproc-per-node 2 --rdzv-backend etcd --rdzv-endpoint $ETCD --rdzv-id jobB --spare-pool gpu-pool --pool-wait 60 \
    --max-restarts 1 --log-dir $W/logsB --event-log $W/jobB.events train.py --steps 4000 --step-sleep 0.1 --out outB; \
    sleep 600"
rank_pid() {   # the pid running rank $2 of job $1
    tpassctl status --rdzv-endpoint $ETCD --rdzv-id $1 --json 2>/dev/null | python3 -c 'import json, sys
d = json.load(sys.stdin)
print(next(w["pid"] for s in d["status"].values() for w in s["workers"] if w["rank"] == int(sys.argv[1]) and not w["spare"] and w["state"] == "running"))' $2
}
wait_for() {   # until file $1 has a line matching $2 (at most $3 s)
    for _ in $(seq $(( $3 * 5 ))); do grep -q -- "$2" "$1" 2>/dev/null && return 0; sleep 0.2; done
    echo "no '$2' in $1 within $3 s" >&2; tail -20 "$1" >&2; return 1
}
wait_for jobA.log "started 2 worker" 120
wait_for jobB.events '"workers_started"' 120
sleep 20                                   # both train
kill -9 "$(rank_pid jobA 1)"               # jobA claims the pool node
wait_for jobA.log "recovered and resumed" 240
kill -9 "$(rank_pid jobB 1)"               # jobB finds it taken: it waits
wait_for jobB.events '"pool_waiting".*"waited": 1[0-9]' 60
tmux new-session -d -s pfW -x 80 -y 24 "PATH=$PATH tpassctl status --watch --rdzv-endpoint $ETCD --rdzv-id jobB; sleep 600"
sleep 3
tmux capture-pane -t pfB -p > "$REPO/docs/frames/pool-wait-console-120x40.txt"
tmux capture-pane -t pfW -p > "$REPO/docs/frames/pool-wait-watch-80x24.txt"
tpassctl pool status gpu-pool --rdzv-endpoint $ETCD > "$REPO/docs/frames/pool-wait-pool-status.txt"
grep -v "^step \|^\[" jobA.log > "$REPO/docs/frames/pool-wait-jobA-console.txt" || true
echo "frames written; work dir $W"
