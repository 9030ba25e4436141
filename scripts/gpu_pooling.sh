#!/usr/bin/env bash
# Pooling models on a CUDA machine: the pooling GPU test (a random BERT on the GPU against
# transformers on the CPU), then embeddings per second of the BERT-large shape with dummy weights
# and the fraction of the matmul limit (ember.bench.embed; one JSON line, also $OUT/embed.json).
# Usage: scripts/gpu_pooling.sh [PART...]   parts: tests embed (default: both); results under $OUT
set -u
LOG_NAME=pooling.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
for part in ${*:-tests embed}; do
  case $part in
    tests) stage pooling_gpu_tests 120 python3 -m pytest -v -s -m gpu -p no:cacheprovider -rfE \
             tests/test_pooling.py -k cuda --junitxml="$OUT/pooling_gpu_tests.xml" ;;
    embed) stage embed 110 python3 -m ember.bench.embed --model ember/configs/bert-large \
             --n 1000 --large-n 16000 --repeats 3 --out "$OUT/embed.json" ;;
    *) echo "unknown part $part" ;;
  esac
done
grep -h '^{"bench": "embed"' "$LOG" | tail -1
