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
    .venv/bin/python -m pip install -q --disable-pip-version-check -r scripts/requirements-ci.txt
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
    touch "$stamp"
fi
