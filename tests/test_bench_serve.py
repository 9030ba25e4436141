"""`ember bench serve` and its helpers: runs against the shared test server (one and two client
processes), the word-level tokenizer of dummy-weight models, the client's request split and the
summary table of scripts/gpu_serve.sh."""

from __future__ import annotations

import argparse
import json
import random

import pytest
from server_utils import MODEL_NAME, shared_server

from ember.bench import serve, serve_table
from ember.bench.serve_client import ClientPlan
from ember.bench.word_tokenizer import (
    UNK_TOKEN,
    build_word_tokenizer,
    has_tokenizer,
    write_word_tokenizer_model,
)


def _bench_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(["--base-url", shared_server().base_url,
                              "--served-model-name", MODEL_NAME, *extra])


def test_bench_serve_small(tmp_path):
    out = tmp_path / "r.json"
    ns = _bench_args("--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                     "--request-rate", "20", "--max-concurrency", "2", "--out", str(out))
    assert serve.main(ns) == 0
    record = json.loads(out.read_text())
    results = record["results"]
    assert results["completed"] == 4 and results["failed"] == 0
    assert results["total_output_tokens"] == 16 and results["total_input_tokens"] == 64
    assert 0 < results["p50_ttft_ms"] <= results["p99_ttft_ms"]
    assert results["p50_itl_ms"] > 0 and record["commit"]
    assert record["client_processes"] == 1 and record["server_cmd"] is None  # --base-url


@pytest.mark.slow  # two spawned client processes and two runs: 15-30 s on a shared 2-core box
def test_bench_serve_two_client_processes_and_poisson_follow_up(tmp_path):
    out = tmp_path / "r.json"
    ns = _bench_args("--num-prompts", "6", "--input-len", "8", "--output-len", "3",
                     "--client-processes", "2", "--poisson-at-fraction", "0.5",
                     "--out", str(out))
    assert serve.main(ns) == 0
    record = json.loads(out.read_text())
    results, poisson = record["results"], record["poisson"]
    assert record["client_processes"] == 2 and 0 < results["client_cpu_busy"]
    assert results["completed"] == 6 and results["failed"] == 0
    assert results["total_output_tokens"] == 18 and results["total_input_tokens"] == 48
    assert 0 < results["p50_ttft_ms"] <= results["p99_ttft_ms"]
    assert poisson["request_rate"] == pytest.approx(0.5 * results["request_throughput"])
    assert poisson["completed"] == 6 and poisson["p50_ttft_ms"] > 0


def test_client_plan_split_shares_requests_rate_and_concurrency():
    plan = ClientPlan("http://x", "/v1/completions", [{"i": i} for i in range(5)],
                      request_rate=10.0, max_concurrency=3, seed=7)
    shares = plan.split(2)
    assert [[b["i"] for b in s.bodies] for s in shares] == [[0, 2, 4], [1, 3]]
    assert all(s.request_rate == 5.0 and s.max_concurrency == 2 for s in shares)
    assert len({s.seed for s in shares}) == 2
    assert len(plan.split(8)) == 5  # no empty share


def test_api_server_count_from_server_args():
    assert serve._api_server_count("--load-format dummy") == 1
    assert serve._api_server_count("--api-server-count 4 --max-model-len 4096") == 4
    assert serve._api_server_count("--api-server-count=2") == 2


def test_word_tokenizer_round_trip():
    vocab = 300
    tokenizer = build_word_tokenizer(vocab)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        text = tokenizer.decode(ids)
        assert tokenizer.encode(text, add_special_tokens=False) == ids
        assert tokenizer.encode(text) == ids  # nothing added around it
    assert tokenizer.decode(list(range(vocab))).split() == [f"w{i}" for i in range(vocab)]
    assert tokenizer.encode("w3 lighthouse") == [3, vocab]  # an unknown word is the unk id
    assert tokenizer.convert_ids_to_tokens(vocab) == UNK_TOKEN


def test_word_tokenizer_model_dir_streams_like_a_real_tokenizer(tmp_path):
    from ember.detokenizer import IncrementalDetokenizer
    from ember.tokenizer import load_tokenizer

    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps({"vocab_size": 257, "eos_token_id": 2}))
    assert not has_tokenizer(str(config_dir))
    model_dir = write_word_tokenizer_model(str(config_dir), str(tmp_path / "model"))
    assert has_tokenizer(model_dir)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"] == 257
    tokenizer = load_tokenizer(model_dir)  # as the server loads it
    assert tokenizer.all_special_ids == [257]  # only <unk>: no generated id is skipped
    ids = [random.Random(1).randrange(257) for _ in range(30)]
    detok = IncrementalDetokenizer(tokenizer, ids[:5])
    deltas = []
    for token in ids[5:]:
        detok.append([token])
        deltas.append(detok.output_text_delta())
    assert all(deltas)  # every token streams some text
    assert tokenizer.encode("".join(deltas)) == ids[5:]


def _write(path, record) -> None:
    path.write_text(json.dumps(record))


def test_serve_table_reads_the_script_outputs(tmp_path):
    def served(tps, p50, p99, n, poisson=None):
        record = {"args": {"input_len": 256, "output_len": 256}, "api_server_count": n,
                  "results": {"output_throughput": tps, "failed": 0, "p50_ttft_ms": p50,
                              "p99_ttft_ms": p99}}
        if poisson:
            record["poisson"] = poisson
        return record

    _write(tmp_path / "qwen3_offline.json", {"ember": {"output_tok_s": 30000.0}})
    _write(tmp_path / "qwen3_serve_n1.json", served(15000.0, 7900.0, 18300.0, 1))
    _write(tmp_path / "qwen3_serve_n4.json", served(27000.0, 2000.0, 4000.0, 4, {
        "request_rate": 52.5, "p50_ttft_ms": 90.0, "p99_ttft_ms": 300.0}))
    _write(tmp_path / "smollm_offline.json", {"ember": {"output_tok_s": 60000.0}})
    table = serve_table.render(str(tmp_path))
    lines = table.splitlines()
    assert lines[2].startswith("| smollm |") and "60,000" in lines[2]  # offline only
    assert "| qwen3 | 256/256 | 1 | 30,000 | 15,000 | 50% | 7.90 s / 18.30 s |" in lines[3]
    assert "| 4 |" in lines[4] and "90%" in lines[4] and "52.5 | 0.09 s / 0.30 s | - |" in lines[4]
