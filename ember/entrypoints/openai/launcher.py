"""`ember serve --api-server-count N`: one engine-core process, N HTTP processes in front of it.

This process starts the engine core, opens the listening socket, and spawns N API-server
processes that share that socket (the kernel hands each new connection to one of them) and
attach to the core as its clients. It then only watches: SIGTERM or SIGINT is passed on to the
API servers (each finishes its in-flight requests, up to --shutdown-timeout), then the core is
stopped; if any child dies, the rest are stopped too, so no process is left behind. Counters and
histograms are summed across the API servers through prometheus-client's multiprocess directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait

from ember.config import EngineArgs
from ember.engine.core_client import CoreAddress, CoreProcess

logger = logging.getLogger("ember")

PARENT_CHECK_SECONDS = 1.0


def run_multi_server(ns: argparse.Namespace, args: EngineArgs) -> int:
    import multiprocessing

    args.validate()
    core = CoreProcess(args)
    listener = socket.create_server((ns.host, ns.port), backlog=4096)
    metrics_dir = tempfile.TemporaryDirectory(prefix="ember-metrics-")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    servers: list = []
    try:
        core.wait_ready()
        # Set before the API servers import prometheus-client: it picks its storage at import.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir.name
        ctx = multiprocessing.get_context("spawn")
        for index in range(ns.api_server_count):
            proc = ctx.Process(target=run_api_server_process, name=f"ember-api-server-{index}",
                               args=(ns, args, core.address, listener, index))
            proc.start()
            servers.append(proc)
        logger.info("serving on http://%s:%d with %d API server processes over one engine core",
                    ns.host, ns.port, len(servers))
        sentinels = [core.process.sentinel] + [p.sentinel for p in servers]
        while not stop.is_set():
            if wait(sentinels, timeout=0.2):
                dead = [p.name for p in [core.process, *servers] if not p.is_alive()]
                logger.error("%s exited; stopping the server", ", ".join(dead))
                break
        code = 0 if stop.is_set() else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_servers(servers, ns.shutdown_timeout)
        core.stop()
        listener.close()
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        metrics_dir.cleanup()
    return code


def _stop_servers(servers: list, grace: float) -> None:
    for proc in servers:
        if proc.is_alive():
            proc.terminate()  # uvicorn's graceful shutdown
    deadline = time.monotonic() + grace + 5.0
    for proc in servers:
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def run_api_server_process(ns: argparse.Namespace, args: EngineArgs, address: CoreAddress,
                           listener: socket.socket, index: int) -> None:
    """One HTTP process: a front end attached to the shared core, serving the shared socket."""
    from ember import envs
    from ember.engine.async_llm import AsyncLLM
    from ember.entrypoints.openai.api_server import build_app, parsers_from, served_names
    from ember.entrypoints.openai.http_server import limits_from, make_server
    from ember.gc_heap import freeze_process_heap

    logging.basicConfig(level=envs.logging_level(), format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; SIGTERM stops uvicorn
    _exit_with_parent()
    engine = AsyncLLM(args, attach=address, client_index=index)
    app = build_app(engine, served_names(ns, args), api_key=ns.api_key or envs.api_key(),
                    limits=limits_from(ns),
                    trust_request_chat_template=ns.trust_request_chat_template,
                    parsers=parsers_from(ns))
    server = make_server(app, ns)
    freeze_process_heap("API server")
    try:
        server.run(sockets=[listener])
    finally:
        engine.shutdown_sync()


def _exit_with_parent() -> None:
    """A launcher killed outright cannot stop us: notice it and stop like on SIGTERM."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="ember-parent-watch", daemon=True).start()
