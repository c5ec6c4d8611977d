#!/usr/bin/env bash
# Legs 2 and 3 of the CPU suite (scripts/test.sh runs leg 1): the sandbox tests again,
#   leg 2: with namespaces denied by a seccomp filter, as in a rootless container: the fallback tier
#          must engage (NANO_OPENSHELL_EXPECT_TIER=fallback is checked by a test) and pass;
#   leg 3: as root only, as a non-root user, beside leg 2.
# Each leg asserts which tier really ran, so no leg can pass by skipping its isolation tests.
#
#   bash scripts/test_legs.sh [PYTEST ARGS]   # default: tests/nano_openshell
#
# Leg 3 changes the host, and undoes it on exit (success, failure or Ctrl-C): it creates the user
# ($NANO_OPENSHELL_TEST_USER, default nanotest) with useradd when missing, and deletes it again
# (with its pytest temp dir) if it created it; it gives o+x to the directories on the way to the
# interpreter and the repo that the user cannot traverse, and restores each one's mode.
# $NANO_TEST_PYTHON picks the interpreter (default: the repo's .venv).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${NANO_TEST_PYTHON:-$root/.venv/bin/python}"
if [ $# -gt 0 ]; then selection=("$@"); else selection=(tests/nano_openshell); fi
common=(-q -p no:cacheprovider "${selection[@]}")

# ---- what this script changed on the host, and its undo -------------------------------------------
created_user=""
restore_modes=()  # "MODE DIR", in the order they were changed

undo_host_changes() {
    local status=$? i entry
    if [ -n "${leg2_pid:-}" ]; then  # ended early (an error, Ctrl-C): leg 2 goes too
        kill "$leg2_pid" 2>/dev/null || true; wait "$leg2_pid" 2>/dev/null || true; rm -rf "$leg2_log" "$leg2_tmp"
    fi
    rm -rf "${leg3_tmp:-}"  # leg 3's temp dir, however the script ended
    for ((i = ${#restore_modes[@]} - 1; i >= 0; i--)); do
        entry="${restore_modes[i]}"
        echo "undo: chmod ${entry%% *} ${entry#* }"
        chmod "${entry%% *}" "${entry#* }" || echo "undo: could not restore the mode of ${entry#* }" >&2
    done
    restore_modes=()
    if [ -n "$created_user" ]; then
        echo "undo: userdel $created_user"
        rm -rf "/tmp/pytest-of-$created_user"
        userdel "$created_user" || echo "undo: could not delete user $created_user: run userdel $created_user" >&2
        created_user=""
    fi
    exit "$status"  # the legs' own status, whatever the undo's commands returned
}
trap undo_host_changes EXIT
trap 'exit 130' INT TERM  # through the EXIT trap

# Create the leg-3 user unless it exists; remembered for the undo.
ensure_user() {
    id "$1" >/dev/null 2>&1 && return 0
    useradd --no-create-home --shell /bin/bash "$1"
    created_user="$1"
}

# Give user $1 traverse (o+x, no listing) on every directory above each of the following paths
# that it cannot traverse yet, top down (a parent first, then its child); each old mode remembered.
let_user_reach() {
    local user="$1" target dir part
    shift
    for target in "$@"; do
        dir=""
        for part in $(dirname "$target" | tr / ' '); do
            dir="$dir/$part"
            if ! runuser -u "$user" -- test -x "$dir"; then
                echo "leg 3: chmod o+x $dir (so $user can reach $target)"
                restore_modes+=("$(stat -c %a "$dir") $dir")
                chmod o+x "$dir"
            fi
        done
    done
}

# A temp dir of a leg's own, open to all as /tmp is (the sandbox's users write there): each leg's
# workspace-leak report (tests/conftest.py) then sees only its own sandboxes.
own_tmp() { local d; d="$(mktemp -d)"; chmod 1777 "$d"; echo "$d"; }

# ---- the legs ------------------------------------------------------------------------------------
# Leg 2 runs in the background beside leg 3 (its output printed when it ends): both legs spend their
# time waiting on sandboxes' deadlines, not on the CPU, so side by side they take the time of leg 3.
echo "== leg 2: ${selection[*]} with namespaces denied by seccomp (fallback tier expected)"
leg2_log="$(mktemp)" leg2_tmp="$(own_tmp)"
TMPDIR="$leg2_tmp" NANO_OPENSHELL_EXPECT_TIER=fallback PYTHONDONTWRITEBYTECODE=1 \
    "$py" -c "import sys; from nano_openshell.seccomp import main; sys.exit(main())" \
    --deny-namespaces -- "$py" -m pytest "${common[@]}" >"$leg2_log" 2>&1 &
leg2_pid=$!

# Wait for leg 2, print what it printed; its status is the function's.
finish_leg_2() {
    local status=0
    wait "$leg2_pid" || status=$?
    leg2_pid=""
    echo "== leg 2 (ran in the background, beside leg 3 when root):"; cat "$leg2_log"; rm -rf "$leg2_log" "$leg2_tmp"
    return "$status"
}

leg3_status=0
if [ "$(id -u)" != 0 ]; then
    echo "== leg 3: skipped: leg 1 already ran as the non-root user $(id -un)"
else
    user="${NANO_OPENSHELL_TEST_USER:-nanotest}"
    ensure_user "$user"
    # The interpreter may live under a private home (pyenv in /root).
    let_user_reach "$user" "$(readlink -f "$py")" "$root/.venv" "$root"
    leg3_tmp="$(own_tmp)"
    # The banner comes last, right before the run: bash 5.2 can garble the INT trap (a parse error,
    # exit 2) when Ctrl-C lands while it expands a $(...), and the Ctrl-C test signals on this line.
    echo "== leg 3: ${selection[*]} as $user (namespaced tier expected)"
    runuser -u "$user" -- env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp TMPDIR="$leg3_tmp" LANG=C.UTF-8 \
        NANO_OPENSHELL_EXPECT_TIER="${NANO_OPENSHELL_LEG3_TIER:-namespaced}" PYTHONDONTWRITEBYTECODE=1 \
        "$py" -m pytest "${common[@]}" || leg3_status=$?
fi
leg2_status=0
finish_leg_2 || leg2_status=$?
[ "$leg3_status" != 0 ] && exit "$leg3_status"
exit "$leg2_status"
