"""uvicorn as `ember serve` runs it: the limits of limits.py, and a shutdown that ends every
request properly and exits 0.

On SIGTERM or SIGINT uvicorn stops accepting, closes idle connections and waits for the rest.
When --shutdown-timeout passes with requests still running, uvicorn itself would cancel their
tasks (streams cut mid-way, CancelledError tracebacks); instead `abort_in_flight` is set first,
so each stream ends with an error event and `[DONE]`, each non-streaming request gets a 503, and
the log has one line per aborted request. uvicorn also re-raises the caught signal once it is
done, which makes a clean shutdown exit with -15; this server does not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import threading
from collections.abc import Generator

import uvicorn

from ember.entrypoints.openai.limits import ServerLimits, guarded_protocol, install_accept_error_filter

# uvicorn's own cancellation stays as a backstop, this long after the streams were told to end.
ABORT_GRACE_SECONDS = 5.0


def limits_from(ns: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_body_bytes=ns.max_request_body_bytes,
        max_connections=ns.max_connections,
        timeout_request_head=ns.timeout_request_head,
        timeout_body_idle=ns.timeout_body_idle,
        timeout_keep_alive=ns.timeout_keep_alive,
    )


class EmberServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, abort_in_flight: asyncio.Event,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.abort_in_flight = abort_in_flight
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.shutdown_timeout, self.abort_in_flight.set)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn's version re-raises the signal afterwards; a shutdown that went as asked
        # exits 0 instead of dying of SIGTERM.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(app, ns: argparse.Namespace, host: str | None = None,
                port: int | None = None) -> EmberServer:
    """The server for `app` (built by build_app with the same limits) under `ember serve`'s
    flags."""
    limits = limits_from(ns)
    config = uvicorn.Config(
        app, host=host or ns.host, port=port if port is not None else ns.port,
        log_level=ns.uvicorn_log_level,
        timeout_graceful_shutdown=ns.shutdown_timeout + ABORT_GRACE_SECONDS,
        timeout_keep_alive=limits.timeout_keep_alive,
    )
    config.load()
    config.http_protocol_class = guarded_protocol(config.http_protocol_class, limits)
    install_accept_error_filter()
    return EmberServer(config, app.state.ctx.abort_in_flight, ns.shutdown_timeout)
