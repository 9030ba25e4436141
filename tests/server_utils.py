"""Test helpers for the OpenAI server: uvicorn in a background thread on a free loopback port,
one shared default-model server per test process, and a Prometheus text parser.

The shared server's front end runs in the test process (its engine core in a child process), so
tests can reach the AsyncLLM (`server.engine`) and ask the core that every KV block is free again.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time

from ember.engine.async_llm import AsyncLLM

# The default model with a short context and a fixed KV cache: quick to fill, cheap on RAM.
SERVER_ENGINE_ARGS = dict(max_model_len=1024, num_gpu_blocks_override=1024, max_num_seqs=256)
MODEL_NAME = "smol"
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_namespace(**overrides) -> argparse.Namespace:
    """`ember serve`'s flags at their defaults, with `overrides` (flag names with underscores)."""
    from ember.entrypoints.cli_serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args([])
    ns.uvicorn_log_level = "warning"
    ns.shutdown_timeout = 5.0
    for key, value in overrides.items():
        assert hasattr(ns, key), key
        setattr(ns, key, value)
    return ns


class ServerThread:
    """`ember serve`'s uvicorn server (limits and shutdown included) serving `app` on 127.0.0.1
    in a daemon thread (signals stay with the main one)."""

    def __init__(self, app, port: int | None = None, ns: argparse.Namespace | None = None
                 ) -> None:
        from ember.entrypoints.openai.http_server import make_server

        self.port = port or free_port()
        self.server = make_server(app, ns or serve_namespace(), host="127.0.0.1", port=self.port)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.app = app

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class SharedServer:
    """The default model behind two apps: an open one, and one that wants API_KEY."""

    def __init__(self) -> None:
        from ember.config import EngineArgs
        from ember.entrypoints.openai.api_server import build_app

        self.engine = AsyncLLM.from_engine_args(EngineArgs(**SERVER_ENGINE_ARGS))
        names = [MODEL_NAME, "SmolLM2-135M-Instruct"]
        self.open = ServerThread(build_app(self.engine, names, shutdown_engine_on_exit=False))
        self.keyed = ServerThread(build_app(self.engine, names, api_key=API_KEY,
                                            shutdown_engine_on_exit=False))
        self.open.start()
        self.keyed.start()

    @property
    def base_url(self) -> str:
        return self.open.base_url

    def assert_idle(self, timeout: float = 60.0) -> None:
        """Wait until no request is left (aborts land a step after a disconnect), then check
        that the engine core holds no request and every KV block is free."""
        from conftest import assert_all_blocks_free_async

        deadline = time.monotonic() + timeout
        while self.engine.stats()["num_unfinished_requests"] > 0:
            if time.monotonic() > deadline:
                raise AssertionError("requests still unfinished in the engine")
            time.sleep(0.05)
        asyncio.run(asyncio.wait_for(assert_all_blocks_free_async(self.engine), timeout))

    def stop(self) -> None:
        self.open.stop()
        self.keyed.stop()
        self.engine.shutdown_sync()


_shared: SharedServer | None = None
_lock = threading.Lock()


def shared_server() -> SharedServer:
    """One default-model server per test process (the model loads once for every module)."""
    global _shared
    with _lock:
        if _shared is None:
            import atexit

            _shared = SharedServer()
            atexit.register(_shared.stop)
        return _shared


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels as written, sorted by the client)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total
