#!/usr/bin/env bash
# Quantization on a CUDA machine (about 4-5 minutes): the GPU tests of the 4-bit, fp8 and fp8-KV
# kernels and methods, the quantized linear kernels at Llama-3.1-8B's shapes, and Llama-3.1-8B
# (dummy weights) with bf16, fp8 and AWQ side by side on nano-vllm's workload and at batch 1.
# Usage: scripts/gpu_quant.sh [PART...]   parts: tests kernels engine attention w4a8tests
# w4a8kernels w4a8engine w4a8profile prefetch rotary
# (default: tests kernels engine; attention = the attention kernels' own GPU tests, which gpu_suite's
# tests part also runs). Results under $OUT: quant.log, quant_tests.xml, quant_kernels.json,
# quant_llama8b.json.
set -u
LOG_NAME=quant.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
PARTS=${*:-tests kernels engine}
for part in $PARTS; do
  case $part in
    # Every test of these files runs compiled on the GPU (the interpreter cases too; the AWQ /
    # GPTQ greedy-vs-HF tests then run the int4 kernels in float32); -s prints the logit errors
    # the fp8 tests measure.
    tests) stage quant_tests 240 python3 -m pytest -v -s -p no:cacheprovider -rfE \
             --durations=10 tests/test_int4_kernels.py tests/test_awq_gptq.py tests/test_fp8.py \
             tests/test_fp8_kv_cache.py tests/test_kv_cache_dtype.py \
             --junitxml="$OUT/quant_tests.xml" ;;
    # The attention kernels gained the fp8 KV-cache path: their own GPU tests.
    attention) stage attention_tests 150 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
                 tests/test_triton_attention.py --junitxml="$OUT/attention_tests.xml" ;;
    kernels) stage quant_kernels 150 python3 -m ember.bench.quant kernels --sweep \
               --out "$OUT/quant_kernels.json" ;;
    engine) stage quant_llama8b 200 python3 -m ember.bench.quant engine \
              --model ember/configs/llama-3.1-8b --methods bf16 fp8 awq \
              --out "$OUT/quant_llama8b.json" ;;
    # The int8-activation path of the 4-bit layers (w4a8_gemv and its producers): its tests
    # compiled, its kernels with a tile sweep, and AWQ with it against AWQ without (awq-bf16x)
    # at batch 1-4.
    w4a8tests) stage w4a8_tests 120 python3 -m pytest -v -p no:cacheprovider -rfE \
                 tests/test_w4a8.py --junitxml="$OUT/w4a8_tests.xml"
               stage w4a8_layer_tests 100 python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
                 tests/test_awq_gptq.py tests/test_fp8.py --junitxml="$OUT/w4a8_layer_tests.xml" ;;
    w4a8kernels) stage w4a8_kernels 150 python3 -m ember.bench.quant kernels --rows 1 2 4 \
                   --sweep-w4a8 --out "$OUT/w4a8_kernels.json" ;;
    w4a8engine) stage w4a8_engine 220 python3 -m ember.bench.quant engine \
                  --model ember/configs/llama-3.1-8b --methods bf16 awq awq-bf16x fp8 \
                  --num-prompts 32 --small-batches 2 4 --out "$OUT/w4a8_engine.json" ;;
    # Weights read into L2 beside attention (KernelConfig.l2_prefetch) against none (AWQ and
    # fp8), its GPU tests, and the int8 producers' kernels.
    prefetch) stage prefetch_engine 300 python3 -m ember.bench.quant engine \
                --model ember/configs/llama-3.1-8b --methods awq-prefetch awq fp8-prefetch fp8 bf16 \
                --num-prompts 8 --small-batches 2 --out "$OUT/prefetch_engine.json"
              stage prefetch_tests 120 python3 -m pytest -v -p no:cacheprovider -rfE -m gpu \
                tests/test_w4a8.py --junitxml="$OUT/prefetch_tests.xml"
              stage int8_producers 60 python3 -m ember.bench.int8_producers \
                --out "$OUT/int8_producers.json" ;;
    # The rotation inside decode attention (KernelConfig.rotary_in_attention) against the
    # rotary kernel: the kernels' tests compiled (bit for bit the rotary kernel's result), then
    # the engine without and with it.
    rotary) stage rotary_tests 150 python3 -m pytest -v -p no:cacheprovider -rfE \
              tests/test_triton_attention.py -k "rotat or backend or decode" \
              --junitxml="$OUT/rotary_tests.xml"
            for on in false true; do
              stage rotary_engine_$on 200 python3 -m ember.bench.quant engine \
                --model ember/configs/llama-3.1-8b --methods awq fp8 bf16 --num-prompts 8 \
                --small-batches 2 --kernel-config rotary_in_attention=$on \
                --out "$OUT/rotary_engine_$on.json"
            done ;;
    # Where an AWQ batch-1 step goes with int8 rows: device time per kernel (PDL off).
    w4a8profile) AWQ_DIR=$(python3 -c "from ember.bench.quant import awq_config_dir; \
                   print(awq_config_dir('ember/configs/llama-3.1-8b'))")
                 stage w4a8_profile 150 python3 -m ember.bench.profile_steps --model "$AWQ_DIR" \
                   --num-requests 1 --input-len 128 128 --output-len 600 600 --skip 20 \
                   --steps 100 --no-pdl \
                   --out "$OUT/w4a8_profile.json" ;;
    *) echo "unknown part $part" ;;
  esac
done
tail -c 3000 "$LOG"
