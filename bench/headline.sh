#!/usr/bin/env bash
# The headline runs of issue 6 on nvidia-h200-x2 (trainer cuda:0, engine cuda:1), one phase per
# device call, back to back (state lives under /tmp/headline while the machine stays warm):
#
#   (set BENCH_COMMIT to the tree's commit: the device's copy of .git is stale)
#   prepare  join the staged GGUF chunks (scripts/stage_model.sh), install the carried wheels,
#            `prepare-model qwen2.5-coder-0.5b-instruct` (carry .stage/parts.txt and .whl)
#   seed     eval the base model on the seed and held-out tasks (one engine), then the seed's
#            setting: 8 steps, 2 tasks x group 4 on the seed tasks, then eval its final policy on seed
#   long     >= 50 steps on the training set, 8 tasks x group 8 = 64 trajectories a step, then eval
#            the final policy on held-out (and train); interrupted by LONG_LIMIT with SIGINT (the run
#            checkpoints), a later `long` call resumes it
#
# Outputs (logs, metrics.jsonl, eval JSON) go to $OUT. Knobs: SEED_LR, LONG_LR, LONG_STEPS,
# LONG_LIMIT (seconds), MODEL (default the packaged Qwen; tiny-random-qwen2 rehearses on CPU),
# TRAINER_DEVICE / ENGINE_DEVICE (default: the train layout's own choice), EXTRA / EVAL_EXTRA
# (more train --set pairs / eval flags, for rehearsals).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
phase="${1:?usage: headline.sh prepare|seed|long}"
OUT="${OUT:-/tmp/headline/out}"; mkdir -p "$OUT"
HL="${HEADLINE_DIR:-/tmp/headline}"; mkdir -p "$HL"
export NANO_MILES_CACHE="${NANO_MILES_CACHE:-$HL/cache}"
MODEL="${MODEL:-qwen2.5-coder-0.5b-instruct}"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -x .venv/bin/python ] && [ ! -d /tmp/site/gguf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
[ ! -x .venv/bin/python ] && [ -d /tmp/site ] && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
export PYTHONPATH=".:${PYTHONPATH:-}"
py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
nm() { "$py" -m nano_miles.cli "$@"; }
ENGINE_DEVICE="${ENGINE_DEVICE:-$("$py" -c 'import torch; n=torch.cuda.device_count(); print("cuda:1" if n>1 else "cuda:0" if n else "cpu")')}"
layout=()
read -r -a extra <<<"${EXTRA:-}"        # more --set pairs for every train run (rehearsals)
read -r -a eval_extra <<<"${EVAL_EXTRA:-}"
[ -n "${TRAINER_DEVICE:-}" ] && layout+=(--set "trainer_device=$TRAINER_DEVICE" --set "engine.device=$ENGINE_DEVICE")

# eval MODEL_OR_DIR NAME TASKS...: one engine on $ENGINE_DEVICE, one eval per task split
evaluate() {
    local model=$1 name=$2; shift 2
    local port=$((30000 + RANDOM % 1000)) log="$OUT/engine_$name.log"
    # Started directly (no function, no subshell): $! is the server, and SIGTERM stops it cleanly
    # (a background job of a script ignores SIGINT).
    "$py" -m nano_miles.cli serve --model "$model" --device "$ENGINE_DEVICE" --port "$port" >"$log" 2>&1 &
    local pid=$!
    for _ in $(seq 600); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
        kill -0 $pid 2>/dev/null || { echo "engine for $name died"; tail -20 "$log"; return 1; }
        sleep 0.5
    done
    for split in "$@"; do
        echo "=== eval $name on $split"
        nm eval --model "$model" --engine-url "http://127.0.0.1:$port" --tasks "$split" --samples 8 \
            --results-jsonl "$OUT/evals.jsonl" "${eval_extra[@]}" 2>&1 | grep -v "it/s\]$"
    done
    kill -TERM $pid; wait $pid 2>/dev/null
    return 0
}

case "$phase" in
prepare)
    if [ ! -f /tmp/stage/parts/part06.bin ]; then bash scripts/stage_model.sh --assemble /tmp/stage || exit 1; fi
    export NANO_MILES_PARTS_DIR=/tmp/stage/parts
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
    time nm prepare-model "$MODEL" 2>&1 | tee "$OUT/prepare.log"
    ;;
seed)
    evaluate "$MODEL" base seed heldout
    rm -rf "$HL/seed"
    nm train --set model="$MODEL" --set tasks=seed --set steps=8 --set tasks_per_step=2 \
        --set rollout.group_size=4 --set optim.lr="${SEED_LR:-1e-5}" --set checkpoint_every=8 \
        --set run_dir="$HL/seed" "${layout[@]}" "${extra[@]}" 2>&1 | tee "$OUT/seed_train.log"
    cp "$HL/seed/metrics.jsonl" "$OUT/seed_metrics.jsonl"
    [ -d "$HL/seed/final" ] && evaluate "$HL/seed/final" seed_final seed
    ;;
long)
    run="$HL/long"
    if [ -f "$run/config.json" ]; then
        resume=(--resume "$run" --set steps="${LONG_STEPS:-50}")
    else
        resume=(--set model="$MODEL" --set tasks=train --set steps="${LONG_STEPS:-50}" --set tasks_per_step=8
                --set rollout.group_size=8 --set optim.lr="${LONG_LR:-5e-6}" --set checkpoint_every=10
                --set run_dir="$run" "${layout[@]}" "${extra[@]}")
    fi
    timeout -s INT -k 60 "${LONG_LIMIT:-420}" "$py" -m nano_miles.cli train "${resume[@]}" 2>&1 | tee -a "$OUT/long_train.log"
    cp "$run/metrics.jsonl" "$OUT/long_metrics.jsonl"
    [ -d "$run/final" ] && evaluate "$run/final" long_final heldout train
    ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
true
