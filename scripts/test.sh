#!/usr/bin/env bash
# The CPU test suite. CI runs exactly this (.ci/run).
# Leg 1: everything, as the current user.
# Leg 2: the sandbox tests with namespaces denied by a seccomp filter (the fallback tier must engage).
# Leg 3: the sandbox tests as a non-root user.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/venv.sh"
cd "$root"
py=.venv/bin/python
echo "== leg 1: full suite as $(id -un)"
$py -m pytest -q "$@"
if [ -f scripts/test_legs.sh ]; then
    bash scripts/test_legs.sh
fi
