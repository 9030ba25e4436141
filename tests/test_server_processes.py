"""`ember serve`'s processes: N API servers over one engine core, a killed core, no orphans.

Each test starts the real command on the default model and talks to it with the official openai
client; every process it started must be gone at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_utils import free_port, metric, parse_metrics

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


class Serve:
    """`ember serve` in a subprocess, its log in a file, every descendant remembered."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "EMBER_DISABLE_PROGRESS": "1"}
        cmd = [sys.executable, "-m", "ember.entrypoints.cli", "serve", "--port", str(self.port),
               "--served-model-name", "smol", "--max-model-len", "512",
               "--num-gpu-blocks-override", "256", "--uvicorn-log-level", "warning", *extra]
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w+")  # a file: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.descendants: set[int] = set()

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.remember_descendants()

    def remember_descendants(self) -> None:
        todo = [self.proc.pid]
        while todo:
            for child in _children(todo.pop()):
                if child not in self.descendants:
                    self.descendants.add(child)
                    todo.append(child)

    def engine_core_pid(self) -> int:
        cores = [p for p in self.descendants if "spawn_main" in _cmdline(p)
                 and "ember-api-server" not in _cmdline(p)]
        # The API servers are spawned too: the core is the launcher's first spawned child.
        return min(cores)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def stop_and_check_no_orphans(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in self.descendants) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(p, _cmdline(p)) for p in self.descendants if _alive(p)]
        assert not left, f"processes left behind: {left}\n{self.log_path.read_text()}"


def test_two_api_servers_serve_and_sum_metrics(tmp_path):
    serve = Serve(tmp_path, "--api-server-count", "2")
    try:
        serve.wait_healthy()
        assert len([p for p in serve.descendants if "spawn_main" in _cmdline(p)]) >= 3
        num_requests = 8
        for i in range(num_requests):  # a new client (connection) each: both servers take some
            client = serve.client()
            if i % 2:
                out = client.completions.create(model="smol", prompt="Once upon a time",
                                                max_tokens=5, temperature=0)
                assert out.choices[0].finish_reason in ("length", "stop")
                assert out.usage.completion_tokens >= 1
            else:
                stream = client.chat.completions.create(
                    model="smol", messages=[{"role": "user", "content": "Say hi"}],
                    max_tokens=5, temperature=0, stream=True)
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text
            client.close()
        # Any process's scrape counts every process's requests.
        for _ in range(4):
            values = parse_metrics(httpx.get(serve.url + "/metrics").text)
            assert metric(values, "ember:request_success_total") == num_requests
            assert metric(values, "ember:generation_tokens_total") >= num_requests
            assert metric(values, "ember:num_requests_running") == 0
    finally:
        serve.stop_and_check_no_orphans()


def test_killed_engine_core_fails_requests_and_health(tmp_path):
    serve = Serve(tmp_path)
    try:
        serve.wait_healthy()
        events: list[dict] = []
        started = threading.Event()
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "stream": True}

        def consume() -> None:
            with httpx.stream("POST", serve.url + "/v1/completions", json=body,
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[6:]))
                        started.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(120)
        killed_at = time.monotonic()
        os.kill(serve.engine_core_pid(), signal.SIGKILL)
        reader.join(30)
        assert not reader.is_alive()
        assert time.monotonic() - killed_at < 5.0
        assert "error" in events[-1], events[-1]
        assert events[-1]["error"]["type"] == "service_unavailable"
        assert httpx.get(serve.url + "/health").status_code == 503
        response = httpx.post(serve.url + "/v1/completions",
                              json={"model": "smol", "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503
        assert "engine core" in response.json()["error"]["message"]
    finally:
        serve.stop_and_check_no_orphans()


def test_sigterm_stops_the_engine_core(tmp_path):
    serve = Serve(tmp_path)
    try:
        serve.wait_healthy()
        core = serve.engine_core_pid()
        assert _alive(core)
        out = serve.client().completions.create(model="smol", prompt="Hello", max_tokens=3)
        assert out.choices[0].text is not None
    finally:
        serve.stop_and_check_no_orphans()
    assert serve.proc.returncode == 0


def _stream_lines(url: str, body: dict, lines: list[str], first: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
                first.set()


def test_shutdown_deadline_ends_streams_properly(tmp_path):
    """Streams still running when --shutdown-timeout passes end with an error event and
    [DONE]; a non-streaming request gets a 503; one log line per aborted request, no
    traceback; exit status 0."""
    serve = Serve(tmp_path, "--shutdown-timeout", "1")
    streams: list[list[str]] = [[], []]
    firsts = [threading.Event(), threading.Event()]
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    full: dict = {}
    try:
        serve.wait_healthy()
        readers = [threading.Thread(target=_stream_lines, args=(serve.url, body, lines, first))
                   for lines, first in zip(streams, firsts)]
        for reader in readers:
            reader.start()
        for first in firsts:
            assert first.wait(120)

        def non_streaming() -> None:
            full["r"] = httpx.post(serve.url + "/v1/completions", timeout=120,
                                   json={**body, "stream": False})

        blocking = threading.Thread(target=non_streaming)
        blocking.start()
        time.sleep(0.5)  # it is in the engine
        serve.proc.send_signal(signal.SIGTERM)
        for reader in [*readers, blocking]:
            reader.join(120)
    finally:
        serve.stop_and_check_no_orphans()
    log = serve.log_path.read_text()
    assert serve.proc.returncode == 0, log
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"]
    assert full["r"].status_code == 503, full["r"].text
    assert log.count("aborted request") == 3, log
    assert "Traceback" not in log and "CancelledError" not in log, log
