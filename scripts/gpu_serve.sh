#!/usr/bin/env bash
# The device run for serving at offline speed: per model, offline `ember bench throughput` and
# served `ember bench serve` on one workload in one call, and the first-run / start-up check.
# Usage there: scripts/gpu_serve.sh [PART...]   (with .whl carried; results under $OUT)
# Parts: fresh smollm qwen3 llama8b (default: all four, in this order; fresh must come first in
# its call, since it measures a fresh machine).
#   smollm/qwen3/llama8b: dummy bf16 weights from ember/configs, a word-level tokenizer of the
#     config's vocabulary size (ember.bench.word_tokenizer) in one directory that both benchmarks
#     load; 1,000 requests of 256 random prompt tokens and 256 output tokens (SmolLM2: 128/128),
#     ignore_eos: offline; served, all at once, with --api-server-count 1 and $SERVE_N; on the
#     largest N's server then a Poisson run at half the request throughput that its burst
#     measured (bench serve --poisson-at-fraction 0.5: no second server start), TTFT p50/p99.
#   fresh: nano-vllm's workload (256 requests, in/out uniform 100-1024) on Qwen3-0.6B, two
#     generate calls in one process (ember.bench.first_run), and the engine start-up time.
# Every stage has a time limit, and the whole run keeps inside $BUDGET seconds (default 570): a
# stage gets at most what is left, and is skipped when under 30 s is left. If the run does not fit
# one call, split it: `scripts/gpu_serve.sh fresh smollm qwen3`, then `scripts/gpu_serve.sh llama8b`.
# Prefix the command with EMBER_COMMIT=<sha sent> (the device's git HEAD may be stale).
# On the CPU, SERVE_DRY=1 runs the same stages at toy sizes on SmolLM2 (proves the parsing):
#   PATH=$PWD/.venv/bin:$PATH OUT=/tmp/serve-dry SERVE_DRY=1 scripts/gpu_serve.sh fresh smollm
set -u
LOG_NAME=serve.log
source "$(dirname "$0")/gpu_common.sh"
LOG=$OUT/$LOG_NAME
: >"$LOG"
PARTS=${*:-fresh smollm qwen3 llama8b}
BUDGET=${BUDGET:-570}
SERVE_N=${SERVE_N:-4}          # the larger --api-server-count(s), e.g. "2 4"; 1 is always run
CLIENTS=${CLIENTS:-6}          # client processes of bench serve (one reads ~20k chunks/s on a dev box)
NUM=${NUM_PROMPTS:-1000}
MAXLEN=4096
WARMUP=64                      # served warm-up requests, as bench throughput's warm-up
FRESH_MODEL=qwen3-0.6b
FRESH_WORK="--num-prompts 256 --input-len 100 1024 --output-len 100 1024"
SINGLE=${SINGLE:-256}          # bench throughput's single-stream decode (batch-1 tok/s)
if [ "${SERVE_DRY:-0}" = 1 ]; then
  NUM=8 MAXLEN=256 WARMUP=2 SERVE_N=2 CLIENTS=2 SINGLE=4 FRESH_MODEL=smollm2-135m
  FRESH_WORK="--num-prompts 4 --input-len 8 16 --output-len 4 8"
fi
MODELS=/tmp/ember-serve-models
# A burst holds $NUM connections open at once, in one server process when N=1.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

limited() {  # limited NAME SECONDS CMD...: `stage`, capped to what is left of $BUDGET
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "=== $name skipped: ${left}s left of the ${BUDGET}s budget" | tee -a "$LOG"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  stage "$name" "$limit" "$@"
}

model_part() {  # model_part NAME CONFIG INPUT_LEN OUTPUT_LEN OFFLINE_S SERVE_S
  local name=$1 config=$2 in=$3 out=$4 offline_s=$5 serve_s=$6
  local dir=$MODELS/$config
  local work="--num-prompts $NUM --input-len $in --output-len $out"
  [ "${SERVE_DRY:-0}" = 1 ] && work="--num-prompts $NUM --input-len 16 --output-len 8"
  limited "${name}_model" 60 python3 -m ember.bench.word_tokenizer "ember/configs/$config" "$dir"
  limited "${name}_offline" "$offline_s" $BENCH --model "$dir" $work --max-model-len $MAXLEN \
    --no-baseline --single-output-len $SINGLE \
    --out "$OUT/${name}_offline.json"
  # Same workload with the engine core in its own process (what offline LLM's default rests on).
  case " ${OFFLINE_MP_MODELS:-} " in *" $name "*)
    limited "${name}_offline_mp" "$offline_s" $BENCH --model "$dir" $work \
      --max-model-len $MAXLEN --no-baseline --single-output-len $SINGLE --engine-process \
      --out "$OUT/${name}_offline_mp.json" ;;
  esac
  # An older tree (AB_OLD=ab/old, carried) on the same model and workload, same machine.
  case " ${AB_OLD_MODELS:-} " in *" $name "*)
    (cd "${AB_OLD:-ab/old}" && PYTHONPATH=/tmp/site:$PWD limited "${name}_offline_old" \
      "$offline_s" $BENCH --model "$dir" $work --max-model-len $MAXLEN --no-baseline \
      --single-output-len $SINGLE --out "$OUT/${name}_offline_old.json") ;;
  esac
  # The last (largest) N also runs the Poisson follow-up on its server, at half the burst's
  # request throughput; a short shutdown timeout keeps a stage cut by its limit short.
  local n poisson limit largest=${SERVE_N##* }
  for n in 1 $SERVE_N; do
    poisson="" limit=$serve_s
    [ "$n" = "$largest" ] && poisson="--poisson-at-fraction 0.5" && limit=$((serve_s * 2))
    limited "${name}_serve_n$n" "$limit" python3 -m ember.entrypoints.cli bench serve \
      --model "$dir" --server-args "--load-format dummy --max-model-len $MAXLEN \
      --api-server-count $n --shutdown-timeout 5" $work --client-processes "$CLIENTS" \
      --warmup-prompts $WARMUP $poisson --out "$OUT/${name}_serve_n$n.json"
  done
}

for part in $PARTS; do
  case $part in
    fresh) limited fresh 150 python3 -m ember.bench.first_run --model "ember/configs/$FRESH_MODEL" \
             --load-format dummy $FRESH_WORK --max-model-len $MAXLEN --out "$OUT/first_run.json" ;;
    smollm) model_part smollm smollm2-135m 128 128 90 90 ;;
    qwen3) model_part qwen3 qwen3-0.6b 256 256 100 100 ;;
    llama8b) model_part llama8b llama-3.1-8b 256 256 140 120 ;;
    *) echo "unknown part $part" ;;
  esac
done

python3 -m ember.bench.serve_table "$OUT" | tee "$OUT/summary.md"
# Start-up per stage: the engine's "... ready in" lines (with their breakdown), named by stage.
awk '/^=== .* \(limit/ {stage = $2} /^INFO ember: .*ready in/ {sub(/^INFO ember: /, ""); print stage ": " $0}' "$LOG" | tail -24
# The device returns at most 8 files: pack the JSON results (the log and the table stay apart).
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf /tmp/serve_results.tgz ./*.json && rm -f ./*.json \
    && mv /tmp/serve_results.tgz .)
fi
