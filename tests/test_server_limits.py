"""The server's limits on clients: body size (413 before reading), body idle time (408), the
request-head deadline, the connection cap, keep-alive idling, tokenizing off the event loop,
the cheap refusal of absurdly long prompts, 500s that leak nothing and keep the connection, and
a rate-limited log when descriptors run out.

Each test runs its own small server (tight limits) over the shared default-model engine.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import pytest
from server_utils import MODEL_NAME, ServerThread, serve_namespace, shared_server

from ember.entrypoints.openai.api_server import build_app
from ember.entrypoints.openai.http_server import limits_from
from ember.entrypoints.openai.limits import AcceptErrorFilter

TIGHT = dict(max_request_body_bytes=64 * 1024, max_connections=8, timeout_request_head=0.5,
             timeout_body_idle=0.5, timeout_keep_alive=0.5)


@pytest.fixture
def tight():
    """A server with tight limits; yields (server thread, app)."""
    engine = shared_server().engine
    ns = serve_namespace(**TIGHT)
    app = build_app(engine, [MODEL_NAME], shutdown_engine_on_exit=False, limits=limits_from(ns))
    server = ServerThread(app, ns=ns).start()
    try:
        yield server, app
    finally:
        server.stop()
    shared_server().assert_idle()


def _connect(server: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response: status, headers, body (by Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return status, headers, body


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _completion_head(length: int, extra: str = "") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def test_declared_oversized_body_is_413_before_any_of_it_is_sent(tight):
    server, _ = tight
    with _connect(server) as sock:
        sock.sendall(_completion_head(50_000_000))  # the headers only: no body byte follows
        status, headers, body = _read_response(sock)
    assert status == 413
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert "65536" in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_chunked_body_over_the_limit_is_413(tight):
    server, _ = tight
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n")
        chunk = b"x" * 16384
        try:
            for _ in range(8):  # 128 KiB, twice the limit
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may already have answered and closed
        status, _, _ = _read_response(sock)
    assert status == 413


def test_body_that_stops_arriving_is_408(tight):
    server, _ = tight
    with _connect(server) as sock:
        sock.sendall(_completion_head(100) + b'{"prompt": ')
        status, _, body = _read_response(sock)
    assert status == 408
    assert "stopped arriving" in json.loads(body)["error"]["message"]


def test_connection_without_a_request_head_is_closed(tight):
    server, _ = tight
    with _connect(server) as silent, _connect(server) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\n")
        for _ in range(3):  # a header line now and then does not extend the deadline
            time.sleep(0.2)
            try:
                slow.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        assert _closed_by_peer(silent, within=5)
        assert _closed_by_peer(slow, within=5)


def test_idle_keep_alive_connection_is_closed(tight):
    server, _ = tight
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = _read_response(sock)
        assert status == 200
        assert _closed_by_peer(sock, within=5)


def test_connections_over_the_cap_are_reset_and_logged_once(tight, caplog):
    server, _ = tight
    held = [_connect(server) for _ in range(TIGHT["max_connections"])]
    try:
        time.sleep(0.2)  # let the server register every held connection
        caplog.set_level(logging.WARNING, logger="ember")
        refused = 0
        for _ in range(20):
            with _connect(server) as extra:
                refused += _closed_by_peer(extra, within=5)
        assert refused == 20
        lines = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(lines) <= 1  # rate-limited: not one line per refused connection
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while True:  # the held ones are gone: the server accepts again
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_tokenizing_runs_off_the_event_loop(tight):
    """While a prompt is being tokenized (held here), the server still answers /health."""
    server, app = tight
    ctx = app.state.ctx
    release, entered = threading.Event(), threading.Event()
    real = ctx._thread_tokenizer

    class Held:
        def encode(self, *args, **kwargs):
            entered.set()
            assert release.wait(30)
            return real.encode(*args, **kwargs)

    ctx._thread_tokenizer = Held()
    result: dict = {}

    def complete() -> None:
        result["r"] = httpx.post(server.base_url + "/v1/completions", timeout=60,
                                 json={"prompt": "Hello", "max_tokens": 2})

    worker = threading.Thread(target=complete)
    worker.start()
    try:
        assert entered.wait(30)
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    finally:
        release.set()
        worker.join(60)
        ctx._thread_tokenizer = real
    assert result["r"].status_code == 200


def test_text_too_long_for_any_tokenization_is_refused_untokenized():
    server = shared_server()
    ctx = server.open.app.state.ctx
    calls = []
    real = ctx._thread_tokenizer

    class Counting:
        def encode(self, *args, **kwargs):
            calls.append(1)
            return real.encode(*args, **kwargs)

        def apply_chat_template(self, *args, **kwargs):
            calls.append(1)
            return real.apply_chat_template(*args, **kwargs)

    ctx._thread_tokenizer = Counting()
    text = "a" * (ctx.max_text_chars + 1)
    try:
        for path, body in [
            ("/v1/completions", {"prompt": text, "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                      "max_tokens": 1}),
            ("/tokenize", {"prompt": text}),
        ]:
            r = httpx.post(server.base_url + path, json=body, timeout=30)
            assert r.status_code == 400, (path, r.text[:200])
            assert r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        ctx._thread_tokenizer = real
    assert calls == []
    assert ctx.max_text_chars < 1_000_000  # a real bound: 1024 tokens of at most ~100 chars


def test_internal_error_is_500_without_internals_and_keeps_the_connection(tight, caplog):
    server, app = tight
    ctx = app.state.ctx
    real = ctx.check_model

    def broken(name):
        raise RuntimeError("secret internal detail")

    ctx.check_model = broken
    try:
        caplog.set_level(logging.ERROR, logger="ember")
        with _connect(server) as sock:
            sock.sendall(b"GET /v1/models/x HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = _read_response(sock)
            assert status == 500
            message = json.loads(body)["error"]["message"]
            assert "secret" not in message and "RuntimeError" not in message
            assert "id " in message
            # The same connection serves the next request.
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(sock)[0] == 200
    finally:
        ctx.check_model = real
    assert any("secret internal detail" in (r.exc_text or "") or r.exc_info
               for r in caplog.records)


def test_accept_errors_are_logged_once_per_interval(caplog):
    log = logging.getLogger("asyncio-test-accept")
    log.addFilter(AcceptErrorFilter())
    caplog.set_level(logging.WARNING)
    for _ in range(1000):
        log.error("socket.accept() out of system resource", exc_info=OSError(24, "EMFILE"))
    accept_lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(accept_lines) == 1
