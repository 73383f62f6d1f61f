#!/usr/bin/env bash
# The test suite (the README's test command runs this through .ci/run).
#   bash scripts/test.sh                 lint, then the fast tier, then the e2e tier; stops at the first that fails and
#                                        prints each tier's time at the end
#   bash scripts/test.sh -m "not e2e"    the fast tier alone (no real multi-process job; minutes)
#   bash scripts/test.sh ARGS...         pytest ARGS (a file, -k, -x ...), no lint
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONDONTWRITEBYTECODE=1

pytest_run() {
    .venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
    local rc=$?
    # pytest's 5 means "no tests collected": a broken suite, not a pass.
    if [ $rc -eq 5 ]; then echo "no tests were collected"; return 1; fi
    return $rc
}

if [ $# -gt 0 ]; then
    pytest_run "$@"
    exit $?
fi

times=()
tier() {    # tier NAME COMMAND...: runs it, records its time; the suite stops at the first tier that fails
    local name=$1 start=$SECONDS rc
    shift
    echo "=== tier: $name"
    "$@"
    rc=$?
    times+=("$name $((SECONDS - start)) s$([ $rc -eq 0 ] || echo " (failed, exit $rc)")")
    return $rc
}
summary() { echo "=== tier times: $(IFS=,; echo "${times[*]}" | sed 's/,/, /g')"; }

rc=0
tier lint bash scripts/lint.sh || rc=$?
[ $rc -eq 0 ] && { tier fast pytest_run -m "not e2e" || rc=$?; }
[ $rc -eq 0 ] && { tier e2e pytest_run -m e2e || rc=$?; }
summary
exit $rc
