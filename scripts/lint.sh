#!/usr/bin/env bash
# ruff everywhere; mypy --strict on the typed packages (the rest follows: issue 23).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m ruff check .

# `rendezvous/` and `health/` are installed as `tpassrun.rendezvous` / `tpassrun.health` (pyproject.toml's
# package-dir), a mapping mypy cannot read: it checks a tree of symlinks laid out as installed, so every package sees
# the real types of the others. Its messages name the files in the source tree.
TREE=.mypy_cache/src
rm -rf "$TREE"
mkdir -p "$TREE/tpassrun"
for entry in tpassrun/*; do
    case "$entry" in *__pycache__*) continue ;; esac
    ln -s "$PWD/$entry" "$TREE/$entry"
done
ln -s "$PWD/rendezvous" "$TREE/tpassrun/rendezvous"
ln -s "$PWD/health" "$TREE/tpassrun/health"
STRICT=(schema plan records channel settings rendezvous health mirror scheduler store launch pool transfer swapper ops worker agent adapters)
ARGS=()
for package in "${STRICT[@]}"; do ARGS+=(-p "tpassrun.$package"); done
status=0
out=$(MYPYPATH="$TREE" "$PY" -m mypy --strict --follow-imports=silent "${ARGS[@]}" 2>&1) || status=$?
printf '%s\n' "$out" | sed -e "s#^$TREE/tpassrun/rendezvous/#rendezvous/#" -e "s#^$TREE/tpassrun/health/#health/#" \
    -e "s#^$TREE/##"
[ "$status" -eq 0 ]

echo "lint: ruff and mypy passed"
