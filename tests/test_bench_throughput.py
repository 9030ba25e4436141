"""`ember bench throughput` runs end to end (tiny dummy model, tiny workload) and reports both
sides, so the benchmark recorded in docs/benchmarks.md keeps working."""

import json
import subprocess
import sys

from model_factory import make_tiny_model


def test_bench_throughput_reports_ember_and_hf(tmp_path):
    model = make_tiny_model("llama", tmp_path)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "ember.entrypoints.cli", "bench", "throughput",
           "--model", str(model), "--load-format", "dummy", "--num-prompts", "4",
           "--input-len", "8", "16", "--output-len", "4", "8", "--max-model-len", "128",
           "--hf-num-requests", "2", "--hf-output-len", "4", "--single-output-len", "6",
           "--single-input-len", "8", "--no-tqdm", "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                            env={"EMBER_DISABLE_PROGRESS": "1", "EMBER_STEP_TIMING": "1",
                                 "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(out.read_text())
    ember, hf = data["ember"], data["hf"]
    assert ember["output_tok_s"] > 0 and hf["output_tok_s"] > 0
    assert data["ratio_throughput"] == ember["output_tok_s"] / hf["output_tok_s"]
    assert set(ember["step_phase_ms"]) >= {"num_steps", "schedule", "prepare", "wait", "update"}
