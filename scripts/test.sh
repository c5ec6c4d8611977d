#!/usr/bin/env bash
# The CPU test suite. CI runs exactly this (.ci/run).
# Leg 1: everything, as the current user (two workers; the sandbox tests after, beside legs 2 and 3).
# Leg 2: the sandbox tests with namespaces denied by a seccomp filter (the fallback tier must engage).
# Leg 3: the sandbox tests as a non-root user.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/venv.sh"
cd "$root"
py=.venv/bin/python
echo "== leg 1: full suite as $(id -un)"
if [ $# -gt 0 ]; then
    $py -m pytest -q "$@"
else
    # The engine, trainer and run tests mostly wait on the processes they start (an engine, ranks, a
    # sandbox): two workers share the two cores.
    $py -m pytest -q -n 2 --ignore tests/nano_openshell --ignore tests/scripts
    # Alone: it runs scripts/test_legs.sh, which creates users and opens directory modes, as leg 3 does.
    $py -m pytest -q tests/scripts
    # The sandbox tests time deadlines and kill process trees, but wait on them far more than they use
    # the CPU: leg 1's run of them goes beside legs 2 and 3, each leg in a temp dir of its own.
    leg1_log="$(mktemp)"
    # a background job of a script ignores Ctrl-C: on any early exit it is stopped here
    trap 'if [ -n "${leg1_pid:-}" ]; then kill "$leg1_pid" 2>/dev/null || true; fi; rm -f "$leg1_log"' EXIT
    trap 'exit 130' INT TERM
    $py -m pytest -q tests/nano_openshell >"$leg1_log" 2>&1 &
    leg1_pid=$!
fi
status=0
if [ -f scripts/test_legs.sh ]; then
    bash scripts/test_legs.sh || status=$?
fi
if [ -n "${leg1_pid:-}" ]; then
    wait "$leg1_pid" || status=$?
    leg1_pid=""
    echo "== leg 1, the sandbox tests (ran beside legs 2 and 3):"; cat "$leg1_log"
fi
exit "$status"
