#!/usr/bin/env bash
# Makes gpu_tok/qwen3-0.6b-smoltok (git-ignored; carry it to the GPU machine): the Qwen3-0.6B
# config with the default model's tokenizer, for benchmarks that need real text (structured
# outputs) on dummy weights. Run here, where the default model is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python - <<'PY'
import json
import os

from ember.default_model import default_model_path
from ember.tokenizer import load_tokenizer

out = "gpu_tok/qwen3-0.6b-smoltok"
os.makedirs(out, exist_ok=True)
tokenizer = load_tokenizer(default_model_path())
tokenizer.save_pretrained(out)
# Qwen3's shape with this tokenizer's own special ids, as a real checkpoint pairs them: Qwen3's
# eos (151645) is not a token of this tokenizer.
with open("ember/configs/qwen3-0.6b/config.json") as f:
    config = json.load(f)
config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
print(out)
PY
