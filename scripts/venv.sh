#!/usr/bin/env bash
# Create or reuse .venv at the repo root and install the project into it.
# Re-installs only when pyproject.toml or the CI pins change (stamp file).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=".venv/.installed-$(cat pyproject.toml scripts/requirements-ci.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    echo "installing into .venv (first run takes a few minutes)..." >&2
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -r scripts/requirements-ci.txt
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile -e ".[test]"
    # Byte-compile on every core at once (pip compiles one file at a time: half the install's wall).
    # Every process a job or test starts imports torch; without .pyc files that costs seconds each.
    # Files written for newer Pythons fail to compile here, as they do under pip: not an error.
    .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        >/dev/null 2>&1 || true
    touch "$stamp"
fi
