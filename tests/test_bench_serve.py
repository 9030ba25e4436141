"""`ember bench serve` against the shared test server: a few requests, JSON results."""

from __future__ import annotations

import argparse
import json

from server_utils import MODEL_NAME, shared_server

from ember.bench import serve


def test_bench_serve_small(tmp_path):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    out = tmp_path / "r.json"
    ns = parser.parse_args([
        "--base-url", shared_server().base_url, "--served-model-name", MODEL_NAME,
        "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--request-rate", "20",
        "--max-concurrency", "2", "--out", str(out),
    ])
    assert serve.main(ns) == 0
    record = json.loads(out.read_text())
    results = record["results"]
    assert results["completed"] == 4 and results["failed"] == 0
    assert results["total_output_tokens"] == 16 and results["total_input_tokens"] == 64
    assert 0 < results["p50_ttft_ms"] <= results["p99_ttft_ms"]
    assert results["p50_itl_ms"] > 0 and record["commit"]


def test_percentiles():
    assert serve._pct([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert serve._pct([1.0, 2.0], 90) == 1.9
    assert serve._pct([], 99) == 0.0
