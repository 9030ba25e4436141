"""What keeps hostile or careless clients from starving the server: a request-body limit, a
connection cap, and time limits on reading a request.

- `RequestLimitsMiddleware` (ASGI): a body larger than the limit is a 413 before any of it is
  read when Content-Length says so, and as soon as the limit is passed otherwise; a body that
  stops arriving is a 408. Bodies are read here, whole, before the app parses them.
- `guarded_protocol(base, limits)`: uvicorn's HTTP protocol with a cap on open connections (one
  over the cap is reset at once, so idle clients cannot exhaust file descriptors) and a deadline
  for each request head (uvicorn has none: a client that connects and sends nothing, or sends a
  byte now and then, would hold its connection forever).
- `raise_open_file_limit()` lifts the soft descriptor limit to the hard one, as vLLM does, and the
  default connection cap leaves room below it for the engine's own files and sockets.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `ember serve --help` imports this module for its defaults: keep it light
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("ember")

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DESCRIPTORS_KEPT_FREE = 512  # for the engine, its sockets, log files and the model's files
WARN_EVERY_SECONDS = 10.0


@dataclass
class ServerLimits:
    """`ember serve`'s limits; None for max_connections means "what the descriptors allow"."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int | None = None
    timeout_request_head: float = 10.0
    timeout_body_idle: float = 30.0
    timeout_keep_alive: float = 5.0

    def resolved_max_connections(self) -> int:
        if self.max_connections is not None:
            return self.max_connections
        return max(64, raise_open_file_limit() - DESCRIPTORS_KEPT_FREE)


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    try:
        import resource
    except ImportError:  # not POSIX
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class _RateLimitedWarning:
    """One log line per interval, with how many events it stands for."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.count = 0
        self.last = 0.0

    def __call__(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= WARN_EVERY_SECONDS:
            logger.warning(self.message, self.count)
            self.count, self.last = 0, now


def guarded_protocol(base: type, limits: ServerLimits) -> type:
    """A subclass of uvicorn's HTTP protocol class `base` enforcing the connection cap and the
    request-head deadline. Only uvicorn's shared protocol surface is used (`connections`,
    `cycle`, `transport`, `connection_made`, `on_response_complete`), which both its h11 and
    httptools protocols have."""
    cap = limits.resolved_max_connections()
    head_timeout = limits.timeout_request_head
    refused = _RateLimitedWarning(
        f"refused %d connection(s): {cap} are open (--max-connections)")
    slow = _RateLimitedWarning("closed %d connection(s) that sent no complete request head within "
                               f"{head_timeout:g} s (--timeout-request-head)")

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:  # type: ignore[override]
            if len(self.connections) >= cap:
                refused()
                transport.abort()  # a reset frees the descriptor now, unlike a graceful close
                self.transport = None  # connection_lost must know this one never counted
                return
            super().connection_made(transport)
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.transport is None:
                return
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_deadline()  # the next request's head has the same deadline

        def _arm_head_deadline(self) -> None:
            waiting_after = self.cycle
            transport = self.transport

            def expire() -> None:
                # No new request started since the deadline was armed: the head never came.
                if self.cycle is waiting_after and not transport.is_closing():
                    slow()
                    transport.close()

            self.loop.call_later(head_timeout, expire)

    GuardedHTTPProtocol.__name__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol


class AcceptErrorFilter(logging.Filter):
    """asyncio logs a traceback for every failed accept() when descriptors run out (tens of
    thousands a second); keep one line per interval."""

    def __init__(self) -> None:
        super().__init__()
        self.warn = _RateLimitedWarning("accept() failed %d time(s): out of file descriptors")

    def filter(self, record: logging.LogRecord) -> bool:
        if "socket.accept() out of system resource" in str(record.msg):
            self.warn()
            return False
        return True


def install_accept_error_filter() -> None:
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrorFilter) for f in log.filters):
        log.addFilter(AcceptErrorFilter())


class _BodyTooLarge(Exception):
    pass


class RequestLimitsMiddleware:
    """Reads each request body under the size and idle limits, then hands it to the app."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, timeout_body_idle: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.timeout_body_idle = timeout_body_idle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await _error(send, 400, "the Content-Length header is not a number")
            return
        if declared is not None and declared > self.max_body_bytes:
            await self._too_large(send, declared)
            return
        try:
            body, disconnected = await self._read_body(receive)
        except _BodyTooLarge:
            await self._too_large(send, None)
            return
        except TimeoutError:
            await _error(send, 408, f"the request body stopped arriving for "
                                    f"{self.timeout_body_idle:g} s")
            return
        if disconnected:
            return  # nobody to answer
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # afterwards only http.disconnect can come

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> tuple[bytes, bool]:
        import asyncio

        chunks, size = [], 0
        while True:
            message = await asyncio.wait_for(receive(), self.timeout_body_idle)
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    async def _too_large(self, send: Send, declared: int | None) -> None:
        size = f" ({declared} bytes)" if declared is not None else ""
        await _error(send, 413, f"the request body{size} is larger than this server's limit of "
                                f"{self.max_body_bytes} bytes (--max-request-body-bytes)")


def _content_length(scope: Scope) -> int | None:
    """The declared body size; None when absent, -1 when not a number."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else -1
    return None


async def _error(send: Send, status: int, message: str) -> None:
    """An OpenAI-style error that also closes the connection: the rest of the body is unread."""
    import json

    from ember.entrypoints.openai.errors import OpenAIError, error_body

    payload = json.dumps(error_body(OpenAIError(message, status))).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
