#!/usr/bin/env bash
# The CPU test suite. CI runs exactly this (.ci/run).
# Leg 1: everything, as the current user (two workers; the sandbox tests after, alone).
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
    # sandbox): two workers share the two cores. The sandbox's own tests time deadlines and kill
    # process trees, so they run after, alone on the machine.
    $py -m pytest -q -n 2 --ignore tests/nano_openshell --ignore tests/scripts
    $py -m pytest -q tests/nano_openshell tests/scripts
fi
if [ -f scripts/test_legs.sh ]; then
    bash scripts/test_legs.sh
fi
