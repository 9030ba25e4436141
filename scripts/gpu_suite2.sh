#!/usr/bin/env bash
# Second, shorter device run: the GPU tests not yet shown, and a per-phase step profile of the
# Qwen3-0.6B throughput run and of batch-1 decode (EMBER_STEP_TIMING=1).
set -u
LOG_NAME=suite2.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
stage gpu_tests 140 python3 -m pytest -v -m gpu tests/test_gpu_engine.py -p no:cacheprovider \
  -k "not flashinfer_matches_sdpa" --junitxml="$OUT/gpu_tests.xml"
EMBER_STEP_TIMING=1 stage qwen3_profile 55 $BENCH --model ember/configs/qwen3-0.6b \
  --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 4096 \
  --no-baseline --single-output-len 512 --out "$OUT/qwen3_profile.json"
EMBER_STEP_TIMING=1 stage smollm 50 $BENCH --model ember/configs/smollm2-135m --num-prompts 64 \
  --input-len 128 --output-len 128 --max-model-len 4096 --hf-num-requests 16 --hf-output-len 32 \
  --single-output-len 512 --hf-single-output-len 32 --out "$OUT/smollm.json"
grep -E "PASS|FAIL|ERROR|passed|failed" "$LOG" | tail -20
