#!/usr/bin/env bash
# The test suite (the README's test command runs this through .ci/run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONDONTWRITEBYTECODE=1
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
rc=$?
# pytest's 5 means "no tests collected": a broken suite, not a pass.
if [ $rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi
exit $rc
