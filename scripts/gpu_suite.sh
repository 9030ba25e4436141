#!/usr/bin/env bash
# GPU tests and benchmarks on a CUDA machine: the GPU-marked tests, the attention-kernel and
# engine benchmarks, each part under its own time limit.
# Usage: scripts/gpu_suite.sh [PART...]   (wheels from .whl/ installed first; results under $OUT)
# Parts: ceilings tests smollm qwen3 llama8b kernels compile profile1 linear linearpdl latency
# structured mp
# (default: the first six; ceilings also gives the shipped models' limits; profile1 profiles
# batch-1 decode of SmolLM2 and Llama-8B; linear times the small-batch linear kernel against
# cuBLAS; linearpdl: its configs with PDL off and on, alone and after a norm; latency times
# decode attention per layer at batch 1 and 4; mp runs the GPU tests of tests/test_distributed.py
# (two-GPU ones skip on one), then Qwen3-0.6B in process and through the mp executor). The kernel benchmarks are ember.bench modules.
# Parts run in the order given, so a long suite can be split over runs, e.g.
#   scripts/gpu_suite.sh ceilings smollm qwen3 llama8b   then   scripts/gpu_suite.sh tests kernels
# EMBER_COMMIT=<sha> names the commit in the result files where the tree has no usable git HEAD.
set -u
LOG_NAME=suite.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
PARTS=${*:-ceilings tests smollm qwen3 llama8b kernels}
NANO="--num-prompts 256 --input-len 100 1024 --output-len 100 1024 --max-model-len 4096"
export EMBER_STEP_TIMING=1  # per-phase host timing in every bench JSON (costs ~nothing)
for part in $PARTS; do
  case $part in
    ceilings) stage ceilings 60 python3 -m ember.bench.ceilings "$OUT/ceilings.json" --model \
                ember/configs/smollm2-135m ember/configs/qwen3-0.6b ember/configs/llama-3.1-8b ;;
    # Cheapest first, -v so a stage cut by its time limit still shows what passed. FlashInfer
    # JIT-compiles every kernel variant on a fresh machine (~20-40 s each): its grid runs the
    # benchmark head size (128) only unless GRID_FILTER= (empty) is set.
    tests) stage gpu_tests 420 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE --durations=15 \
             tests/test_layer_kernels.py tests/test_small_batch_linear.py tests/test_pdl.py \
             tests/test_triton_attention.py \
             tests/test_gpu_engine.py tests/test_sampler.py tests/test_logits_processors.py \
             tests/test_structured_outputs.py tests/test_engine_control.py \
             tests/test_gpu_backend_grid.py --junitxml="$OUT/gpu_tests.xml" \
             -k "${GRID_FILTER-not (flashinfer and d64)}" ;;
    smollm) stage smollm 70 $BENCH --model ember/configs/smollm2-135m --num-prompts 64 \
              --input-len 128 --output-len 128 --max-model-len 4096 --hf-num-requests 16 \
              --hf-output-len 32 --single-output-len 512 --hf-single-output-len 32 \
              --out "$OUT/smollm.json" ;;
    qwen3) stage qwen3 130 $BENCH --model ember/configs/qwen3-0.6b $NANO --hf-num-requests 64 \
             --hf-output-len 64 --single-output-len 512 --hf-single-output-len 64 \
             --out "$OUT/qwen3.json" ;;
    llama8b) stage llama8b 170 $BENCH --model ember/configs/llama-3.1-8b $NANO \
               --hf-num-requests 32 --hf-output-len 32 --single-output-len 512 \
               --hf-single-output-len 64 --out "$OUT/llama8b.json" ;;
    compile) stage qwen3_compile 200 $BENCH --model ember/configs/qwen3-0.6b $NANO --no-baseline \
               --compile-model --single-output-len 512 --out "$OUT/qwen3_compile.json" ;;
    profile1) for model in smollm2-135m llama-3.1-8b; do
                stage "profile1_$model" 120 python3 -m ember.bench.profile_steps \
                  --model "ember/configs/$model" --num-requests 1 --input-len 128 128 \
                  --output-len 600 600 --skip 20 --steps 100 --out "$OUT/profile1_$model.txt"
              done ;;
    linear) stage small_batch_linear 120 python3 -m ember.bench.small_batch_linear \
              --out "$OUT/small_batch_linear.json" ;;
    linearpdl) stage small_batch_linear_pdl 150 python3 -m ember.bench.small_batch_linear \
                 --shapes llama8b qwen3 --rows 1 --pdl 0 1 --out "$OUT/small_batch_linear_pdl.json"
               stage small_batch_linear_norm 150 python3 -m ember.bench.small_batch_linear \
                 --shapes llama8b --rows 1 --pdl 0 1 --norm \
                 --out "$OUT/small_batch_linear_norm.json" ;;
    latency) stage decode_latency 150 python3 -m ember.bench.decode_latency \
               --out "$OUT/decode_latency.json" ;;
    # Structured outputs' cost: Qwen3-0.6B shape, dummy weights, the default model's tokenizer
    # (a word tokenizer cannot spell JSON); the directory is made by scripts/gpu_tokenizer_dir.sh.
    # Then the host side alone (grammar accept + bitmask fill per 256-row step, padded against
    # tokenizer width), on this machine's CPU.
    structured) stage structured 200 python3 -m ember.bench.structured \
                  --model gpu_tok/qwen3-0.6b-smoltok --load-format dummy --num-prompts 256 \
                  --max-model-len 2048 --compact --out "$OUT/structured.json"
                stage grammar_host 150 python3 -m ember.bench.grammar_host \
                  --tokenizer gpu_tok/qwen3-0.6b-smoltok --out "$OUT/grammar_host.json" ;;
    # What the process boundary costs: Qwen3-0.6B (nano-vllm's workload) with the model in the
    # engine core's process (uni) and in one spawned worker process (mp), same run.
    mp) stage dist_gpu_tests 240 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
          tests/test_distributed.py --junitxml="$OUT/dist_gpu_tests.xml"
        for backend in uni mp; do
          stage "qwen3_$backend" 130 $BENCH --model ember/configs/qwen3-0.6b $NANO --no-baseline \
            --distributed-executor-backend $backend --single-output-len 512 \
            --out "$OUT/qwen3_$backend.json"
        done ;;
    kernels) stage kernels 60 python3 -m ember.bench.attention_kernels --quick --block-sizes 16 \
               --out "$OUT/kernels.json" ;;
    *) echo "unknown part $part" ;;
  esac
done
for f in "$OUT"/*.json; do
  python3 - "$f" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
e = d.get("ember")
if e:
    print(sys.argv[1].split("/")[-1], "ember %.0f tok/s single %.1f tok/s" % (
        e["output_tok_s"], e["single_stream_decode_tok_s"]),
        "hf %.0f / %.1f" % (d["hf"]["output_tok_s"], d["hf"]["single_stream_decode_tok_s"])
        if "hf" in d else "", "steps", e.get("step_phase_ms"))
EOF
done
tail -c 2500 "$LOG"
# Past 8 result files, pack them into one archive (the log stays beside it, readable alone).
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/results.tgz --exclude="$LOG_NAME" . && find . -type f ! -name "$LOG_NAME" -delete && mv /tmp/results.tgz .)
fi
