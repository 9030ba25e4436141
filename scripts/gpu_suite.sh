#!/usr/bin/env bash
# One device run (the lent H200): GPU tests, attention-kernel and engine benchmarks.
# Usage there: scripts/gpu_suite.sh  (with .whl carried; results under $OUT)
set -u
LOG_NAME=suite.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
stage ceilings 40 python3 benchmarks/ceilings.py "$OUT/ceilings.json"
stage gpu_tests 150 python3 -m pytest -q -m gpu tests/test_gpu_engine.py -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml"
stage qwen3 110 $BENCH --model ember/configs/qwen3-0.6b --num-prompts 256 --input-len 100 1024 \
  --output-len 100 1024 --max-model-len 4096 --hf-num-requests 64 --hf-output-len 64 \
  --single-output-len 512 --out "$OUT/qwen3.json"
stage llama8b 150 $BENCH --model ember/configs/llama-3.1-8b --num-prompts 256 --input-len 100 1024 \
  --output-len 100 1024 --max-model-len 4096 --hf-num-requests 32 --hf-output-len 32 \
  --single-output-len 512 --out "$OUT/llama8b.json"
stage smollm 45 $BENCH --model ember/configs/smollm2-135m --num-prompts 64 --input-len 128 \
  --output-len 128 --max-model-len 4096 --hf-num-requests 16 --hf-output-len 32 \
  --single-output-len 512 --out "$OUT/smollm.json"
stage kernels 50 python3 benchmarks/attention_kernels.py --quick --block-sizes 16 \
  --out "$OUT/kernels.json"
tail -c 3000 "$LOG"
