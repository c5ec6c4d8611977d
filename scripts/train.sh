#!/usr/bin/env bash
# The main job: GRPO on the shell tasks with the packaged default model, on CPU unless a GPU is there.
# Extra arguments go to `nano-miles train` (e.g. --set steps=2).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/venv.sh"
cd "$root"
exec .venv/bin/nano-miles train "$@"
