#!/usr/bin/env bash
# Same-machine A/B on the device: an older tree against the working tree, same workloads, so the
# large machine-to-machine spread of the H200 hosts drops out. Prepare the old tree here first:
#   mkdir -p ab/old && git archive <rev> ember | tar x -C ab/old     (ab/ is git-ignored)
# then run on the device with carry [".whl", "ab"]:  scripts/gpu_ab.sh [MODEL...]
# AB_WORKLOAD replaces nano-vllm's workload (e.g. a short one when batch 1 is what is compared).
set -u
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/ab.log
NANO="--num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 4096"
MODELS=${*:-qwen3-0.6b llama-3.1-8b smollm2-135m}
ROOT=$PWD
for variant in new old; do
  dir=$ROOT; [ "$variant" = old ] && dir=$ROOT/ab/old
  for model in $MODELS; do
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir EMBER_COMMIT=$variant stage "${variant}_$model" 150 \
      python3 -m ember.entrypoints.cli bench throughput --load-format dummy --no-tqdm \
      --model "ember/configs/$model" ${AB_WORKLOAD:-$NANO} --no-baseline --single-output-len 512 \
      --out "$OUT/ab_${variant}_${model}.json")
  done
done
for f in "$OUT"/ab_*.json; do
  python3 -c "import json,sys; e=json.load(open(sys.argv[1]))['ember']; print(sys.argv[1].split('/')[-1], round(e['output_tok_s']), round(e['single_stream_decode_tok_s'], 1))" "$f"
done
