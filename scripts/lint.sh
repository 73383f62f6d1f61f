#!/usr/bin/env bash
# ruff everywhere; mypy --strict on the typed core (plan, records, channel, settings; the rest follows: issue 23).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
"$PY" -m ruff check .
"$PY" -m mypy --strict --follow-imports=silent tpassrun/plan tpassrun/records tpassrun/channel tpassrun/settings
"$PY" -m mypy --strict --follow-imports=silent tpassrun/worker

echo "lint: ruff and mypy passed"
