# Sourced by the GPU scripts: installs the carried wheels, sets the environment, defines `stage`.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/ember-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD FLASHINFER_CUDA_ARCH_LIST=9.0a EMBER_DISABLE_PROGRESS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
BENCH="python3 -m ember.entrypoints.cli bench throughput --load-format dummy --no-tqdm"
stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to $LOG, report
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
}
