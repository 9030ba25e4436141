#!/usr/bin/env bash
# Second, shorter device run: the GPU tests not yet shown, and a per-phase step profile of the
# Qwen3-0.6B throughput run and of batch-1 decode (EMBER_STEP_TIMING=1).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ember-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_CUDA_ARCH_LIST=9.0a EMBER_DISABLE_PROGRESS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
LOG=$OUT/suite2.log
stage() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
}
BENCH="python3 -m ember.entrypoints.cli bench throughput --load-format dummy --no-tqdm"
stage gpu_tests 140 python3 -m pytest -v -m gpu tests/test_gpu_engine.py -p no:cacheprovider \
  -k "not flashinfer_matches_sdpa" --junitxml="$OUT/gpu_tests.xml"
EMBER_STEP_TIMING=1 stage qwen3_profile 55 $BENCH --model ember/configs/qwen3-0.6b \
  --num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 4096 \
  --no-baseline --single-output-len 512 --out "$OUT/qwen3_profile.json"
EMBER_STEP_TIMING=1 stage smollm 50 $BENCH --model ember/configs/smollm2-135m --num-prompts 64 \
  --input-len 128 --output-len 128 --max-model-len 4096 --hf-num-requests 16 --hf-output-len 32 \
  --single-output-len 512 --hf-single-output-len 32 --out "$OUT/smollm.json"
grep -E "PASS|FAIL|ERROR|passed|failed" "$LOG" | tail -20
