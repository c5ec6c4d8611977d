#!/usr/bin/env bash
# Legs 2 and 3 of the CPU suite (scripts/test.sh runs leg 1): the sandbox tests again,
#   leg 2: with namespaces denied by a seccomp filter, as in a rootless container: the fallback tier
#          must engage (NANO_OPENSHELL_EXPECT_TIER=fallback is checked by a test) and pass;
#   leg 3: as a non-root user (created with useradd when missing).
# Each leg asserts which tier really ran, so no leg can pass by skipping its isolation tests.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$root/.venv/bin/python"
tests=tests/nano_openshell
common=(-q -p no:cacheprovider "$tests")

echo "== leg 2: $tests with namespaces denied by seccomp (fallback tier expected)"
NANO_OPENSHELL_EXPECT_TIER=fallback PYTHONDONTWRITEBYTECODE=1 \
    "$py" -c "import sys; from nano_openshell.seccomp import main; sys.exit(main())" \
    --deny-namespaces -- "$py" -m pytest "${common[@]}"

if [ "$(id -u)" != 0 ]; then
    echo "== leg 3: skipped: leg 1 already ran as the non-root user $(id -un)"
    exit 0
fi
user="${NANO_OPENSHELL_TEST_USER:-nanotest}"
id "$user" >/dev/null 2>&1 || useradd --no-create-home --shell /bin/bash "$user"
# The venv's interpreter may live under a private home (pyenv in /root): let the user traverse
# (o+x, no listing) the directories on the way to it and to the repo, and say so.
for target in "$(readlink -f "$py")" "$root/.venv" "$root"; do
    dir=""
    for part in $(dirname "$target" | tr / ' '); do  # top down: a parent first, then its child
        dir="$dir/$part"
        if ! runuser -u "$user" -- test -x "$dir"; then
            echo "leg 3: chmod o+x $dir (so $user can reach $target)"
            chmod o+x "$dir"
        fi
    done
done
echo "== leg 3: $tests as $user (namespaced tier expected)"
runuser -u "$user" -- env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 \
    NANO_OPENSHELL_EXPECT_TIER="${NANO_OPENSHELL_LEG3_TIER:-namespaced}" PYTHONDONTWRITEBYTECODE=1 \
    "$py" -m pytest "${common[@]}"
