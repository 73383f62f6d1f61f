#!/bin/bash
# Frames of a node lost on one machine (three agents of one job sharing a host: every one of them is "vm"):
#   node-loss-console-120x40.txt   node A's launcher (tpassrun --tui: its console lines above, the live panel below)
#                                  after node B (agent and workers) was SIGKILLed and its ranks moved to the spare node
#   node-loss-watch-80x24.txt      tpassctl status --watch at the same moment
# Run from the repository's root, under the shared lock (3 agents, 6 workers):
#   flock /work/heavy.lock bash docs/frames/make-node-loss-frames.sh
set -euo pipefail
REPO=$(pwd)
W=$(mktemp -d /tmp/node-frames-XXXX)
export PATH="$REPO/.venv/bin:$PATH"
cd "$W"
cp "$REPO/examples/train_ddp.py" train.py
PIDS=()
cleanup() {   # what this script started, by pid: SIGTERM (a launcher stops its workers), then SIGKILL
    tmux kill-session -t nfA 2>/dev/null || true
    tmux kill-session -t nfW 2>/dev/null || true
    for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
    sleep 5
    for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
trap cleanup EXIT
set -m

etcd --data-dir etcd-data --listen-client-urls http://127.0.0.1:23792 --advertise-client-urls http://127.0.0.1:23792 \
     --listen-peer-urls http://127.0.0.1:23802 > etcd.log 2>&1 &
PIDS+=($!)
export ETCD=127.0.0.1:23792
until etcdctl --endpoints $ETCD endpoint health > /dev/null 2>&1; do sleep 0.2; done
LINE="--nnodes 2 --nproc-per-node 2 --rdzv-backend etcd --rdzv-endpoint $ETCD --rdzv-id job1 --rdzv-conf lease_ttl=3"
LINE="$LINE --max-restarts 1"     # one line: it goes into tmux's command as it is
ARGS="train.py --steps 4000 --step-sleep 0.1"
tmux new-session -d -s nfA -x 120 -y 40 "PATH=$PATH tpassrun --tui $LINE --event-log $W/a.events $ARGS --out outA; sleep 600"
sleep 2
tpassrun $LINE --event-log $W/b.events $ARGS --out outB > b.log 2>&1 &
B=$!
PIDS+=($B)
tpassrun $LINE --spare-node --event-log $W/c.events $ARGS --out outC > c.log 2>&1 &
PIDS+=($!)
wait_for() {   # until file $1 has a line matching $2 (at most $3 s)
    for _ in $(seq $(( $3 * 5 ))); do grep -q -- "$2" "$1" 2>/dev/null && return 0; sleep 0.2; done
    echo "no '$2' in $1 within $3 s" >&2; tail -20 "$1" >&2; return 1
}
wait_for c.events '"spare_ready"' 240
sleep 15
kill -9 $B                                  # node B: its agent; its workers follow it (PDEATHSIG), as a host's
wait_for a.events '"node_recovered"' 240
tmux new-session -d -s nfW -x 80 -y 24 "PATH=$PATH tpassctl status --watch --rdzv-endpoint $ETCD --rdzv-id job1; sleep 600"
sleep 4
tmux capture-pane -t nfA -p > "$REPO/docs/frames/node-loss-console-120x40.txt"
tmux capture-pane -t nfW -p > "$REPO/docs/frames/node-loss-watch-80x24.txt"
echo "frames written; work dir $W"
