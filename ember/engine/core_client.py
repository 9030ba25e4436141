"""Core clients: how a front end reaches the engine core, in this process or in another.

`InprocCoreClient` calls an EngineCore directly (offline `LLM` by default). `MPCoreClient` talks
to an engine-core process over ZeroMQ: requests, aborts and utility calls go out on a DEALER
(thread-safe here through a lock), outputs come back on a second DEALER that one thread reads.
`CoreProcess` starts that process (spawned, so no CUDA or thread state is forked), waits until it
is ready, and stops it; a client that did not start it (an API-server process of
`--api-server-count N`) attaches by address and pid. Whichever way, a core that dies is noticed at
once through a pidfd on its pid, and every caller gets EngineDeadError.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from ember.config import EngineArgs
from ember.core.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    RequestType,
    encoder,
    outputs_decoder,
    ready_decoder,
)
from ember.engine.errors import EngineDeadError

logger = logging.getLogger("ember")

STARTUP_TIMEOUT_SECONDS = 1800.0  # loading a large model and capturing graphs can take minutes
SHUTDOWN_TIMEOUT_SECONDS = 10.0
PID_POLL_MS = 1000  # without a pidfd, how often a waiting client checks that the core lives


@dataclass(frozen=True)
class CoreAddress:
    """Where a running engine core listens, and its pid (for noticing its death)."""

    input: str
    output: str
    pid: int


class CoreProcess:
    """An engine-core process started by this process."""

    def __init__(self, args: EngineArgs) -> None:
        import multiprocessing

        from ember.core.engine_core_proc import run_engine_core
        from ember.pickling import portable_args
        from ember.registry import snapshot

        args = portable_args(args)  # before anything starts: a function that cannot go is refused
        self._dir = tempfile.TemporaryDirectory(prefix="ember-core-")
        name = uuid.uuid4().hex[:8]
        address_in = f"ipc://{self._dir.name}/{name}-in"
        address_out = f"ipc://{self._dir.name}/{name}-out"
        ctx = multiprocessing.get_context("spawn")
        self._ready_reader, ready_writer = ctx.Pipe(duplex=False)
        level = logging.getLevelName(logging.getLogger("ember").getEffectiveLevel())
        self.process = ctx.Process(
            target=run_engine_core,
            args=(args, address_in, address_out, ready_writer, snapshot(), level),
            name="ember-engine-core",
        )
        self.process.start()
        ready_writer.close()
        # Before multiprocessing's own exit hook (which would wait for the child forever).
        atexit.register(self._stop_at_exit)
        assert self.process.pid is not None
        self.address = CoreAddress(address_in, address_out, self.process.pid)
        self.ready: EngineReady | None = None

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> EngineReady:
        """Block until the core has loaded the model; its start-up error is raised here."""
        from multiprocessing.connection import wait

        if self.ready is not None:
            return self.ready
        reader = self._ready_reader
        if not wait([reader, self.process.sentinel], timeout) or not reader.poll():
            self.process.join(1.0)
            self.kill()
            code = self.process.exitcode
            raise RuntimeError(f"the engine core process did not start (exit code {code}); "
                               "its log above says why")
        try:
            message = reader.recv()
        except EOFError as exc:
            self.kill()
            raise RuntimeError("the engine core process exited while starting") from exc
        if message[0] == "error":
            _, text, trace = message
            self.process.join(5.0)
            self.kill()
            logger.debug("engine core start-up failed:\n%s", trace)
            # A bad argument or model (ValueError) stays a ValueError for the caller.
            kind, _, detail = text.partition(": ")
            if kind == "ValueError":
                raise ValueError(detail)
            raise RuntimeError(f"the engine core failed to start: {text}")
        self.ready = ready_decoder.decode(message[1])
        return self.ready

    def _stop_at_exit(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(SHUTDOWN_TIMEOUT_SECONDS)
        self.kill()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)

    def stop(self, timeout: float = SHUTDOWN_TIMEOUT_SECONDS) -> None:
        """Ask the process to end (clients have sent SHUTDOWN); terminate, then kill, if not."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        self.kill()
        atexit.unregister(self._stop_at_exit)
        self._ready_reader.close()
        self._dir.cleanup()


class InprocCoreClient:
    """The engine core in this process: every call is a plain method call."""

    multiprocess = False

    def __init__(self, args: EngineArgs) -> None:
        from ember.pooling.core import make_engine_core

        self.core = make_engine_core(args)  # EngineCore, or PoolingEngineCore for pooling
        self.ready = self.core.ready

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for req in requests:
            self.core.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.core.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.core.has_work()

    def step(self) -> EngineCoreOutputs:
        return self.core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.core, method)(*args)

    def shutdown(self) -> None:
        self.core.shutdown()


class MPCoreClient:
    """A connection to an engine-core process. Sends are safe from any thread; `recv` belongs to
    one thread (the caller's in LLMEngine, the output thread in AsyncLLM)."""

    multiprocess = True

    def __init__(self, args: EngineArgs | None = None, attach: CoreAddress | None = None) -> None:
        if (args is None) == (attach is None):
            raise ValueError("give engine args (start a core) or an address (attach to one)")
        self.process = CoreProcess(args) if attach is None else None
        self.address = attach if attach is not None else self.process.address
        self.ready: EngineReady | None = None
        self.dead: EngineDeadError | None = None
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._ctx: zmq.Context | None = None
        self._closed = False
        self._shutdown_sent = False
        self.pending: list[EngineCoreOutputs] = []  # see take_pending

    def connect(self) -> EngineReady:
        """Wait for the core (when we started it) and connect both sockets; returns its info."""
        if self.process is not None:
            self.ready = self.process.wait_ready()
        ctx = self._ctx = zmq.Context(io_threads=1)
        name = uuid.uuid4().hex.encode()
        self._input = ctx.socket(zmq.DEALER)
        self._input.setsockopt(zmq.ROUTING_ID, b"in-" + name)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.connect(self.address.input)
        self._output = ctx.socket(zmq.DEALER)
        self._output.setsockopt(zmq.ROUTING_ID, b"out-" + name)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.connect(self.address.output)
        self._poller = zmq.Poller()
        self._poller.register(self._output, zmq.POLLIN)
        self._pidfd = _open_pidfd(self.address.pid)
        if self._pidfd is not None:
            self._poller.register(self._pidfd, zmq.POLLIN)
        # The first answer to HELLO proves the route back exists before any request is sent.
        self._output.send(RequestType.HELLO.value)
        first = self.recv(timeout=60.0)
        if first is None:
            raise RuntimeError("the engine core did not answer")
        self.first_stats = first.scheduler_stats
        if self.ready is None:
            self.ready = self.call_utility("get_ready")
            if isinstance(self.ready, dict):
                self.ready = EngineReady(**self.ready)
        return self.ready

    # ---- sending (any thread) ----------------------------------------------------------
    def _send(self, kind: RequestType, payload: Any) -> None:
        if self.dead is not None:
            raise self.dead
        data = encoder.encode(payload)
        with self._send_lock:
            self._input.send_multipart([kind.value, data], copy=False)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(RequestType.ADD, requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._send(RequestType.ABORT, request_ids)

    def send_utility(self, method: str, *args: Any) -> int:
        call_id = next(self._call_ids)
        self._send(RequestType.UTILITY, (call_id, method, list(args)))
        return call_id

    # ---- receiving (one thread) --------------------------------------------------------
    def recv(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        """The core's next message (None on timeout); EngineDeadError once it is gone."""
        if self.dead is not None:
            raise self.dead
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return outputs_decoder.decode(self._output.recv(zmq.NOBLOCK, copy=False).buffer)
            except zmq.Again:
                pass
            if self._pidfd is None and not _pid_alive(self.address.pid):
                self._mark_dead()
            left_ms = None if deadline is None else max(int((deadline - time.monotonic()) * 1000), 0)
            if self._pidfd is None:  # no death notice: wake at least every second to look
                left_ms = PID_POLL_MS if left_ms is None else min(left_ms, PID_POLL_MS)
            events = dict(self._poller.poll(left_ms))
            if self._output in events:
                continue
            if self._pidfd is not None and self._pidfd in events:
                # Take what it sent before dying (its error), then report the death.
                try:
                    return outputs_decoder.decode(self._output.recv(zmq.NOBLOCK, copy=False).buffer)
                except zmq.Again:
                    self._mark_dead()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _mark_dead(self, reason: str | None = None) -> None:
        if self.dead is None:
            if reason is None:
                code = self.process.process.exitcode if self.process is not None else None
                reason = ("the engine core process died" +
                          (f" (exit code {code})" if code is not None else ""))
            self.dead = EngineDeadError(reason)
        raise self.dead

    def fail(self, reason: str) -> EngineDeadError:
        """Record that the core reported a fatal error; later calls raise it."""
        if self.dead is None:
            self.dead = EngineDeadError(f"the engine core failed: {reason}")
        return self.dead

    def call_utility(self, method: str, *args: Any, timeout: float = 300.0) -> Any:
        """Call an EngineCore method in the core process and wait (only for the thread that
        owns recv; other outputs arriving meanwhile are kept for `take_pending`)."""
        call_id = self.send_utility(method, *args)
        deadline = time.monotonic() + timeout
        while True:
            outs = self.recv(timeout=max(deadline - time.monotonic(), 0.0))
            if outs is None:
                raise TimeoutError(f"the engine core did not answer {method!r} in {timeout} s")
            result = outs.utility_result
            if result is not None and result.call_id == call_id:
                if result.error is not None:
                    raise RuntimeError(f"engine core {method!r} failed: {result.error}")
                return result.result
            if outs.engine_error is not None:
                raise self.fail(outs.engine_error)
            self.pending.append(outs)

    def take_pending(self) -> list[EngineCoreOutputs]:
        """Outputs that arrived while `call_utility` waited for its answer."""
        items, self.pending = self.pending, []
        return items

    # ---- shutdown ----------------------------------------------------------------------
    def request_shutdown(self) -> None:
        """Ask a core this client started to exit (its death then wakes `recv`)."""
        if self._ctx is None or self.process is None or self._shutdown_sent:
            return
        self._shutdown_sent = True
        try:
            with self._send_lock:
                self._input.send_multipart([RequestType.SHUTDOWN.value, b""])
        except zmq.ZMQError:
            pass

    def shutdown(self) -> None:
        """Stop the core if this client started it, and close the sockets; safe to repeat."""
        if self._closed:
            return
        self._closed = True
        self.request_shutdown()
        if self.process is not None:
            self.process.stop()
        if self.dead is None:
            self.dead = EngineDeadError("the engine was shut down")
        if self._ctx is not None:
            if self._pidfd is not None:
                os.close(self._pidfd)
            self._input.close(0)
            self._output.close(0)
            self._ctx.term()


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: fall back to polling the pid
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
