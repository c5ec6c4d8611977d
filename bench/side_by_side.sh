#!/usr/bin/env bash
# Steps an hour, side by side: the ninth round's recipe run alone for STEPS steps by this tree and by
# an older one (OLD_TREE: `git archive <commit> | tar -x -C .old`, carried), one after the other on one
# GPU, each followed by the held-out pass@1 of its final policy (INSTANCES x SAMPLES at T=0.7).
# After `multi_gpu.sh stage NN` and `prepare` (the model in $NANO_MILES_CACHE, the wheels in /tmp/site):
#
#   start   the runs in one background process (setsid) that outlives the device call
#   watch   wait up to WATCH seconds (or until done), print progress; $OUT gets each arm's metrics,
#           eval log and bench/side_by_side.py's summary rows
#
# ARMS names the arms in the order they run: `old` is OLD_TREE (.old), any other name this tree with
# the --set pairs in EXTRA_<name> beside the recipe, e.g.
#   ARMS="carry old plain" EXTRA_carry="rollout.carry_over=true max_staleness=3" bash bench/side_by_side.sh start
# Knobs: STEPS (100), MODEL, DEVICE (cuda:0, else cpu), INSTANCES (8), SAMPLES (4), SEED (1), RECIPE_EXTRA
# (--set pairs for every arm: a CPU rehearsal's smaller batch).
set -uo pipefail
phase="${1:?usage: side_by_side.sh start|watch}"
OUT="${OUT:-/tmp/mg/out}" SBS="${SBS_DIR:-/tmp/mg/sbs}"; mkdir -p "$OUT" "$SBS"
export NANO_MILES_CACHE="${NANO_MILES_CACHE:-/tmp/mg/cache}" PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
root="$(pwd)"
py=python3; [ -x .venv/bin/python ] && py="$root/.venv/bin/python"
site=""; [ -d /tmp/site ] && site=":/tmp/site"
STEPS="${STEPS:-100}" MODEL="${MODEL:-qwen2.5-coder-0.5b-instruct}" SEED="${SEED:-1}"
DEVICE="${DEVICE:-$("$py" -c 'import torch; print("cuda:0" if torch.cuda.is_available() else "cpu")')}"
read -r -a arms <<<"${ARMS:-new old}"

# the recipe is bench/loop_step.py's `ninth` (its model, devices and seed overridden here); the old
# tree takes it too, but for the skills catalog's module, which moved
ninth=$(PYTHONPATH="$root" "$py" -c 'from bench.loop_step import NINTH; print(" ".join(NINTH))') || exit 1
recipe() {
    echo "$ninth model=$MODEL trainer_device=$DEVICE engine.device=$DEVICE seed=$SEED steps=$STEPS" \
         "checkpoint_every=100000 $([ "$DEVICE" != cpu ] || echo engine.num_kv_blocks=none) $*"
}

# run_arm NAME: train in its tree, then pass@1 of the final policy on held-out
run_arm() {
    local name=$1 tree=$root extra=() dir="$SBS/$1" pairs="EXTRA_$1"
    if [ "$name" = old ]; then
        tree="$root/${OLD_TREE:-.old}" extra=(tasks_module=nano_miles.task_catalog_skills)
    else
        read -r -a extra <<<"${!pairs:-}"
    fi
    rm -rf "$dir"; mkdir -p "$dir"
    local sets=(); for kv in $(recipe "${RECIPE_EXTRA:-}") "${extra[@]}"; do sets+=(--set "$kv"); done
    echo "=== $name: train ${sets[*]}" | tee "$dir/train.log"
    (cd "$tree" && PYTHONPATH="$tree$site" "$py" -m nano_miles.cli train "${sets[@]}" --set run_dir="$dir/run") 2>&1 \
        | grep --line-buffered -v "/s\]$\|s/ep\]$" >>"$dir/train.log"
    (cd "$tree" && PYTHONPATH="$tree$site" "$py" -m nano_miles.cli eval --model "$dir/run/final" --tasks heldout \
        --samples "${SAMPLES:-4}" --set instances="${INSTANCES:-8}" --set rollout.temperature=0.7 \
        --set engine.device="$DEVICE" --results-jsonl "$dir/evals.jsonl") 2>&1 | tr '\r' '\n' | grep -v "/s\]$" >"$dir/eval.log"
    touch "$dir/done"
}

case "$phase" in
start)
    # the runs use a copy of the tree: a later device call's copy of the working tree must not change
    # the modules a running arm has yet to import
    rm -rf "$SBS"/* "$SBS.tree"; mkdir -p "$SBS.tree"
    tar -c --exclude=./.stage --exclude=./.git . | tar -x -C "$SBS.tree"
    (cd "$SBS.tree" && setsid nohup bash bench/side_by_side.sh run </dev/null >"$SBS/run.log" 2>&1 &)
    sleep "${WATCH:-30}"; tail -3 "$SBS"/*/train.log ;;
run)
    for a in "${arms[@]}"; do run_arm "$a"; done
    touch "$SBS/done" ;;
watch)
    for _ in $(seq "${WATCH:-500}"); do [ -f "$SBS/done" ] && break; sleep 1; done
    for a in "${arms[@]}"; do
        d="$SBS/$a"; [ -d "$d" ] || continue
        echo "=== $a: $(grep -c '"step_s"' "$d/run/metrics.jsonl" 2>/dev/null || echo 0) steps"
        tail -2 "$d/train.log"; grep -h "^all " "$d/eval.log" 2>/dev/null
        cp "$d/run/metrics.jsonl" "$OUT/${a}_metrics.jsonl" 2>/dev/null
        cp "$d/train.log" "$OUT/${a}_train.log"; cp "$d/eval.log" "$OUT/${a}_eval.log" 2>/dev/null
        cp "$d/evals.jsonl" "$OUT/${a}_evals.jsonl" 2>/dev/null
    done
    [ -f "$SBS/done" ] && echo "=== side by side done"
    tail -3 "$SBS/run.log" ;;
*) echo "unknown phase $phase"; exit 2 ;;
esac
true
