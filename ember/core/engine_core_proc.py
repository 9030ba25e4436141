"""The engine-core process: a busy loop over EngineCore behind two ZeroMQ sockets.

Clients (one per front end: an `LLM`, or each API-server process) connect a DEALER to the input
ROUTER to send requests, aborts and utility calls, and a DEALER to the output ROUTER, announced
with a HELLO, to receive their outputs. Each request's outputs go to the client that sent it;
scheduler stats go to every client. The loop blocks only when there is no work; between steps it
drains every pending message, so adds and aborts land at step boundaries. It exits on SHUTDOWN,
when its parent dies, or when a step raises (the client sees the process end and fails its
requests).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

import zmq

from ember.config import EngineArgs
from ember.core.messages import (
    EngineCoreOutputs,
    RequestType,
    UtilityResult,
    abort_decoder,
    add_decoder,
    encoder,
    utility_decoder,
)
from ember.gc_heap import freeze_process_heap

logger = logging.getLogger("ember")

PARENT_CHECK_SECONDS = 1.0  # how often a busy core checks that its parent still lives
STATS_INTERVAL_SECONDS = 0.1  # scheduler stats go to every client at most this often


def run_engine_core(
    args: EngineArgs,
    input_address: str,
    output_address: str,
    ready_pipe: Any,
    registry_snapshot: dict | None = None,
    log_level: str | None = None,
) -> None:
    """Process entry point: build the core, report ready (or the error) on `ready_pipe`, loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if log_level:
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    parent = os.getppid()
    try:
        if registry_snapshot is not None:
            from ember.registry import restore

            restore(registry_snapshot)  # user registrations reach this process
        from ember.pooling.core import make_engine_core

        core = make_engine_core(args)  # EngineCore, or PoolingEngineCore for pooling
    except BaseException as exc:  # the parent raises it for the user
        import traceback

        ready_pipe.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        ready_pipe.close()
        return
    freeze_process_heap("engine core")
    ready_pipe.send(("ready", encoder.encode(core.ready)))
    ready_pipe.close()
    try:
        EngineCoreLoop(core, input_address, output_address, parent).run()
    finally:
        core.shutdown()


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


class EngineCoreLoop:
    def __init__(self, core, input_address: str, output_address: str, parent_pid: int) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.ROUTER)
        self.input.bind(input_address)
        self.output = self.ctx.socket(zmq.ROUTER)
        self.output.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished client is an error, not a drop
        self.output.bind(output_address)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.poller.register(self.output, zmq.POLLIN)
        self.clients: list[bytes] = []  # output identities, in HELLO order
        self.owner: dict[str, bytes] = {}  # request id -> the output identity of its client
        self.last_stats = 0.0
        self.running = True

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            # Tell every client why, so their callers get the reason and not just "it died".
            logger.exception("engine core: a step failed; shutting down")
            error = f"{type(exc).__name__}: {exc}"
            for client in list(self.clients):
                self._send_to(client, EngineCoreOutputs(engine_error=error))
            raise SystemExit(1) from None  # logged above; multiprocessing need not print it again
        finally:
            self.input.close(linger=0)
            self.output.close(linger=1000)  # let the last messages (an error) leave
            self.ctx.term()

    def _loop(self) -> None:
        core = self.core
        last_parent_check = time.monotonic()
        while self.running:
            busy = core.has_work()
            # Idle: sleep in poll (waking now and then to check the parent); busy: just drain.
            events = dict(self.poller.poll(0 if busy else int(PARENT_CHECK_SECONDS * 1000)))
            if self.output in events:
                self._accept_hellos()
            if self.input in events or busy:
                self._drain_input()
            now = time.monotonic()
            if now - last_parent_check >= PARENT_CHECK_SECONDS:
                last_parent_check = now
                if os.getppid() != self.parent_pid:
                    logger.warning("engine core: the parent process is gone; exiting")
                    return
            if not self.running:
                return
            if core.has_work():
                outputs = core.step()
                # The step that empties the engine also tells every client (gauges go to 0).
                self._send(outputs, force_stats=not core.has_work())
            elif busy:  # emptied by aborts, without a step: the gauges must still go to 0
                self._send(EngineCoreOutputs(timestamp=time.time()), force_stats=True)

    def _accept_hellos(self) -> None:
        while True:
            try:
                identity, _kind = self.output.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if identity not in self.clients:
                self.clients.append(identity)
            self.output.send_multipart([identity, encoder.encode(
                EngineCoreOutputs(scheduler_stats=self.core.scheduler_stats()))])

    def _drain_input(self) -> None:
        while self.running:
            try:
                frames = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames[0].bytes, RequestType(frames[1].bytes), frames[2].buffer)

    def _handle(self, sender: bytes, kind: RequestType, payload) -> None:
        core = self.core
        if kind is RequestType.ADD:
            reply_to = sender.replace(b"in", b"out", 1)
            for req in add_decoder.decode(payload):
                # The front end validated the request; a failure here is a bug in that check.
                core.add_request(req)
                self.owner[req.request_id] = reply_to
        elif kind is RequestType.ABORT:
            ids = abort_decoder.decode(payload)
            core.abort_requests(ids)
            for req_id in ids:
                self.owner.pop(req_id, None)
        elif kind is RequestType.UTILITY:
            call_id, method, call_args = utility_decoder.decode(payload)
            result = UtilityResult(call_id)
            try:
                if method.startswith("_"):
                    raise ValueError(f"{method!r} is not a utility method")
                value = getattr(core, method)(*call_args)
                result.result = value
                encoder.encode(value)  # fail here, not in _send, if it cannot cross
            except Exception as exc:  # the caller gets the error, the core keeps serving
                result.result, result.error = None, f"{type(exc).__name__}: {exc}"
            # Fresh stats ride along: a caller that asked after an abort sees its effect.
            self._send_to(sender.replace(b"in", b"out", 1),
                          EngineCoreOutputs(utility_result=result,
                                            scheduler_stats=core.scheduler_stats()))
        elif kind is RequestType.SHUTDOWN:
            self.running = False

    # ---- outputs -----------------------------------------------------------------------
    def _send(self, outputs: EngineCoreOutputs, force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if force_stats or now - self.last_stats >= STATS_INTERVAL_SECONDS:
            stats = self.core.scheduler_stats()
            self.last_stats = now
        if len(self.clients) <= 1 and self.clients:
            # One client: every output is its own, send as is (nothing, when a step had no
            # news: its sequences send their tokens at their end, EngineCoreRequest.
            # outputs_at_end, and no stats are due).
            if not outputs.outputs and stats is None:
                return
            outputs.scheduler_stats = stats
            self._send_to(self.clients[0], outputs)
            self._forget_finished(outputs.outputs)
            return
        per_client: dict[bytes, list] = {c: [] for c in self.clients}
        owner = self.owner
        for out in outputs.outputs:
            client = owner.get(out.request_id)
            if client is not None:
                per_client.setdefault(client, []).append(out)
        for client, outs in per_client.items():
            if outs or stats is not None:
                self._send_to(client, EngineCoreOutputs(outs, outputs.timestamp, stats))
        self._forget_finished(outputs.outputs)

    def _forget_finished(self, outputs: list) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self.owner.pop(out.request_id, None)

    def _send_to(self, client: bytes, outputs: EngineCoreOutputs) -> None:
        try:
            self.output.send_multipart([client, encoder.encode(outputs)], copy=False)
        except zmq.ZMQError:  # that client is gone (its process ended); the others are served
            if client in self.clients:
                self.clients.remove(client)
                orphans = [rid for rid, owner in self.owner.items() if owner == client]
                self.core.abort_requests(orphans)
                for req_id in orphans:
                    del self.owner[req_id]
