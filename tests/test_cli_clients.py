"""The CLI commands vLLM users reach for: `ember complete` / `ember chat --url` against the shared
test server (quick and interactive, with and without an API key), `ember run-batch` on a file of
chat, completion and bad lines, and `ember collect-env`'s sections."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from server_utils import API_KEY, MODEL_NAME, free_port

EMBER = [sys.executable, "-m", "ember.entrypoints.cli"]
BASE_ENV = {"EMBER_DISABLE_PROGRESS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
            "HOME": os.environ.get("HOME", "/tmp"),
            **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}


def ember(args: list[str], stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(EMBER + args, input=stdin, capture_output=True, text=True, timeout=300,
                          env={**BASE_ENV, **env})


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.base_url + "/v1"


def test_complete_quick_uses_first_listed_model(url, server):
    result = ember(["complete", "--url", url, "-q", "The capital of France is",
                    "--max-tokens", "8", "--temperature", "0"])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    server.assert_idle()


def test_complete_reads_stdin_lines_until_eof(url):
    result = ember(["complete", "--url", url, "--model-name", MODEL_NAME, "--max-tokens", "6",
                    "--temperature", "0"], stdin="The capital of France is\n\nOne, two, three,\n")
    assert result.returncode == 0, result.stderr
    # Both prompts answered in order (a completion may hold newlines of its own).
    assert result.stdout.index("Paris") < result.stdout.index("four"), result.stdout


def test_chat_quick_with_system_prompt(url):
    result = ember(["chat", "--url", url, "--system-prompt", "You are a helpful assistant.",
                    "-q", "What is the capital of France?", "--max-tokens", "16"])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_chat_keeps_the_conversation(url):
    result = ember(["chat", "--url", url, "--max-tokens", "24"],
                   stdin="What is the capital of France?\nAnd of Germany?\n")
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(replies) >= 2 and "Paris" in replies[0]
    # "And of Germany?" only means "the capital of Germany" with the first turn in the history.
    assert "Berlin" in result.stdout


@pytest.mark.slow
def test_chat_offline_quick():
    """Without --url, chat runs its own engine as before; -q works there too."""
    result = ember(["chat", "-q", "What is the capital of France?", "--max-tokens", "16",
                    "--max-model-len", "256"])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_api_key_from_flag_or_env(server):
    url = server.keyed.base_url + "/v1"
    args = ["complete", "--url", url, "-q", "Hello", "--max-tokens", "2"]
    refused = ember(args)
    assert refused.returncode == 1 and "401" in refused.stderr
    assert ember(args + ["--api-key", API_KEY]).returncode == 0
    assert ember(args, EMBER_API_KEY=API_KEY).returncode == 0
    assert ember(args, OPENAI_API_KEY=API_KEY).returncode == 0


def test_unreachable_server_is_one_line_error():
    result = ember(["complete", "--url", f"http://127.0.0.1:{free_port()}/v1", "-q", "hi"])
    assert result.returncode == 1
    assert "connection to the server" in result.stderr and "Traceback" not in result.stderr


def test_chat_url_refuses_engine_flags(url):
    result = ember(["chat", "--url", url, "-q", "hi", "--max-model-len", "256"])
    assert result.returncode == 2
    assert "--max-model-len" in result.stderr and "--url" in result.stderr
    offline = ember(["chat", "-q", "hi", "--api-key", "k"])
    assert offline.returncode == 2 and "--api-key need --url" in offline.stderr


BATCH = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
              "messages": [{"role": "user", "content": "What is the capital of France?"}]}},
    {"custom_id": "cmpl-1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}},
]


@pytest.mark.slow
def test_run_batch_file(tmp_path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    lines = [json.dumps(BATCH[0]), "{not json", "",
             json.dumps({**BATCH[1], "custom_id": "bad-url", "url": "/v1/embeddings"}),
             json.dumps({**BATCH[1], "custom_id": "bad-field",
                         "body": {"prompt": "x", "max_tokens": "3"}}),
             json.dumps(BATCH[1])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = ember(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                    str(tmp_path / "out.jsonl"), "--max-model-len", "512",
                    "--num-gpu-blocks-override", "128"])
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    # One entry per non-empty line, in input order.
    assert [o["custom_id"] for o in out] == ["chat-1", None, "bad-url", "bad-field", "cmpl-1"]
    assert len({o["id"] for o in out}) == len(out)
    by_id = {o["custom_id"]: o for o in out}

    chat = by_id["chat-1"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert "Paris" in ChatCompletion.model_validate(chat["response"]["body"]).choices[0].message.content
    cmpl = by_id["cmpl-1"]
    assert cmpl["error"] is None and cmpl["response"]["status_code"] == 200
    assert "Paris" in Completion.model_validate(cmpl["response"]["body"]).choices[0].text

    for entry, status, words in ((out[1], 400, "line 2: not JSON"),
                                 (by_id["bad-url"], 400, "/v1/embeddings"),
                                 (by_id["bad-field"], 400, "max_tokens")):
        assert entry["response"]["status_code"] == status and entry["response"]["body"] is None
        assert words in entry["error"]["message"], entry
    assert "5 requests, 3 failed" in result.stderr


def test_run_batch_lines_in_process(server):
    """The same path in process over an app on the shared engine: concurrency bound 1 still
    runs every line, and a stream request is refused per line."""
    import asyncio

    from ember.entrypoints.cli_run_batch import run_batch
    from ember.entrypoints.openai.api_server import build_app

    lines = [json.dumps(BATCH[1]), json.dumps({**BATCH[0], "custom_id": "s",
                                               "body": {**BATCH[0]["body"], "stream": True}}),
             json.dumps(BATCH[0])]
    # An app of its own: the shared ones live on uvicorn's event loop, and asyncio objects
    # (the app's shutdown event) belong to the loop that first waits on them.
    app = build_app(server.engine, ["SmolLM2-135M-Instruct"], shutdown_engine_on_exit=False)
    try:
        out = asyncio.run(run_batch(app, lines, max_concurrency=1, progress=False))
    finally:
        server.engine.remove_stat_logger(app.state.metrics.record)
    assert [o["custom_id"] for o in out] == ["cmpl-1", "s", "chat-1"]
    assert [o["response"]["status_code"] for o in out] == [200, 400, 200]
    assert "stream" in out[1]["error"]["message"]
    server.assert_idle()


def test_collect_env_sections():
    result = ember(["collect-env"], EMBER_API_KEY="secret-value", EMBER_LOGGING_LEVEL="WARNING")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for section in ("== ember ==", "== System ==", "== CPU ==", "== PyTorch ==", "== GPUs ==",
                    "== Packages ==", "== Platform ==", "== Plugins ==",
                    "== Environment variables =="):
        assert section in text, section
    for fact in ("Python", "SIMD flags", "Built with CUDA", "transformers", "triton",
                 "Chosen platform", "Models (", "Attention backends ("):
        assert fact in text, fact
    assert re.search(r"^EMBER_LOGGING_LEVEL +: WARNING$", text, re.MULTILINE)
    assert "secret-value" not in text and "EMBER_API_KEY" in text
    assert "could not read" not in text
