"""`ember serve` as a real process: EMBER_API_KEY, and graceful shutdown on SIGTERM (a stream in
flight finishes, then the process exits)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from server_utils import free_port


@pytest.mark.slow
def test_serve_sigterm_lets_stream_finish(tmp_path):
    port = free_port()
    env = {**os.environ, "EMBER_API_KEY": "k3y", "EMBER_DISABLE_PROGRESS": "1"}
    cmd = [sys.executable, "-m", "ember.entrypoints.cli", "serve", "--port", str(port),
           "--served-model-name", "smol", "--max-model-len", "512",
           "--num-gpu-blocks-override", "256", "--uvicorn-log-level", "warning"]
    log = open(tmp_path / "serve.log", "w+")  # a file: a full pipe would block the server
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert httpx.get(url + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k3y"}
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 40,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        first_chunk = threading.Event()
        chunks: list[dict] = []

        def consume() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                              timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                        first_chunk.set()
                    elif line == "data: [DONE]":
                        chunks.append({"done": True})

        reader = threading.Thread(target=consume)
        reader.start()
        assert first_chunk.wait(120)
        proc.send_signal(signal.SIGTERM)
        reader.join(120)
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()
        assert chunks[-1] == {"done": True}
        assert chunks[-2]["usage"]["completion_tokens"] == 40
        assert [c["choices"][0]["finish_reason"] for c in chunks[:-2]][-1] == "length"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
