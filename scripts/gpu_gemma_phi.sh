#!/usr/bin/env bash
# Gemma 2, Gemma 3 and Phi-3 on a CUDA machine: their GPU tests (float32 greedy vs HF on Triton
# with graphs and on SDPA; bf16 Triton / FlashInfer vs SDPA), then offline throughput on the
# gemma-2-2b, gemma-3-1b and phi-3-mini-4k shapes (dummy bf16 weights, nano-vllm's workload, no
# HF baseline). Phi-3-mini's head size is 96, which neither Triton nor FlashInfer takes: it runs
# on SDPA (no CUDA graphs); the JSON says which backend ran. The log is $OUT/gemma_phi.log.
# Usage: scripts/gpu_gemma_phi.sh [PART...]   parts: tests (<= 5 min), bench (<= 5 min)
set -u
LOG_NAME=gemma_phi.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
NANO="--num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 4096"
for part in ${*:-tests bench}; do
  case $part in
    tests) stage gemma_phi_gpu_tests 300 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
             --durations=10 tests/test_gpu_gemma_phi.py --junitxml="$OUT/gemma_phi_tests.xml" ;;
    bench) for model in gemma-2-2b gemma-3-1b phi-3-mini-4k; do
             stage "bench_$model" 100 $BENCH --model "ember/configs/$model" --dtype bfloat16 \
               $NANO --no-baseline --single-output-len 256 --out "$OUT/$model.json"
           done ;;
    *) echo "unknown part $part" ;;
  esac
done
tail -c 3000 "$LOG"
for model in gemma-2-2b gemma-3-1b phi-3-mini-4k; do
  [ -f "$OUT/$model.json" ] && cat "$OUT/$model.json"
done
