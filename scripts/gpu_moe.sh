#!/usr/bin/env bash
# Mixture of experts on a CUDA machine: ember.bench.moe on the Qwen3-30B-A3B shape (dummy bf16
# weights, ~61 GB): nano-vllm's workload and batch-1 decode, each as a fraction of the bandwidth
# limit, then a fused-MoE kernel sweep; and the MoE gpu tests. One JSON line in $OUT/moe.json
# (written after each part), the log in $OUT/moe.log.
# Usage: scripts/gpu_moe.sh [PART...]   parts: bench (default; <= 5 min), tests (<= 4 min)
set -u
LOG_NAME=moe.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
for part in ${*:-bench}; do
  case $part in
    tests) stage moe_gpu_tests 240 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
             --durations=10 tests/test_moe.py tests/test_moe_models.py \
             --junitxml="$OUT/moe_tests.xml" ;;
    bench) stage moe_bench 420 python3 -m ember.bench.moe --model ember/configs/qwen3-30b-a3b \
             --kernel --kernel-tokens 1 2 4 8 64 512 4096 --out "$OUT/moe.json" ;;
    *) echo "unknown part $part" ;;
  esac
done
tail -c 3000 "$LOG"
[ -f "$OUT/moe.json" ] && cat "$OUT/moe.json"
