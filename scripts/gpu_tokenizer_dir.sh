#!/usr/bin/env bash
# Makes gpu_tok/qwen3-0.6b-smoltok (git-ignored; carry it to the GPU machine): the Qwen3-0.6B
# config with the default model's tokenizer, for benchmarks that need real text (structured
# outputs) on dummy weights. Run here, where the default model is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python - <<'PY'
import os
import shutil

from ember.default_model import default_model_path
from ember.tokenizer import load_tokenizer

out = "gpu_tok/qwen3-0.6b-smoltok"
os.makedirs(out, exist_ok=True)
load_tokenizer(default_model_path()).save_pretrained(out)
shutil.copy("ember/configs/qwen3-0.6b/config.json", os.path.join(out, "config.json"))
print(out)
PY
