"""AsyncLLM: an asyncio front end over LLMEngine, driven by one dedicated engine thread.

Why a thread: a model step takes 10-500 ms on a CPU and would freeze the event loop. Every engine
mutation (add, abort, step) happens on the engine thread, fed by a thread-safe command queue, so
LLMEngine needs no locks. Outputs go back to per-request asyncio queues through
`loop.call_soon_threadsafe`, once per event loop per step. A request whose consumer stops iterating
(GeneratorExit, CancelledError) is aborted; an error while adding a request goes to that caller
only; a crash of the loop fails every pending request and marks the engine dead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ember.config import EngineArgs
from ember.core.engine import LLMEngine
from ember.inputs import PromptType
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember")


class EngineDeadError(RuntimeError):
    """The engine loop crashed or was shut down; no request can be served any more."""


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine-loop iteration did, for stat loggers (Prometheus, logs)."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.num_generation_tokens or self.num_prompt_tokens or self.finished)


StatLogger = Callable[[IterationStats], None]


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one live request, for the latency metrics."""

    arrival_time: float
    last_token_time: float = 0.0
    num_generated: int = 0


class _Stream:
    """The caller's side of one request: an asyncio queue living on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    async def get(self) -> RequestOutput | BaseException:
        item = await self.queue.get()
        # Outputs are cumulative, so only the newest matters; an error ends the stream.
        while not isinstance(item, BaseException) and not self.queue.empty():
            item = self.queue.get_nowait()
        return item


_STOP = ("stop",)


class AsyncLLM:
    """Serve many concurrent requests from asyncio code with one LLMEngine."""

    def __init__(self, engine: LLMEngine, start: bool = True) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _streams and _dead across the two threads
        self._streams: dict[str, _Stream] = {}
        self._dead: EngineDeadError | None = None
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._stat_loggers: list[StatLogger] = []
        self._stats: dict[str, Any] = {}
        self._refresh_stats()
        self._thread = threading.Thread(target=self._run, name="ember-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(LLMEngine(args))

    # ---- read-only views (safe from any thread) -------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def stats(self) -> dict[str, Any]:
        """Scheduler and KV-cache numbers as of the last loop iteration."""
        return dict(self._stats)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """`stat_logger(IterationStats)` is called on the engine thread after each iteration."""
        self._stat_loggers.append(stat_logger)

    def remove_stat_logger(self, stat_logger: StatLogger) -> None:
        if stat_logger in self._stat_loggers:
            self._stat_loggers.remove(stat_logger)

    # ---- requests ------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative RequestOutputs of one request until it finishes.

        Errors in the request (bad prompt, duplicate id) are raised here; stopping the iteration
        early aborts the request and frees its KV blocks."""
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            # Token prompts are validated here, so the caller sees the error before streaming.
            self.engine.validate_prompt(list(prompt["prompt_token_ids"]))
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        finished = False
        try:
            self._commands.put(("add", request_id, prompt, params, arrival_time or time.time()))
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing to abort: the request is gone from the engine
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                self._commands.put(("abort", [request_id], False))

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; their generate() streams end with a finish_reason "abort" output."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self._dead is None:
            self._commands.put(("abort", ids, True))

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine loop is not running."""
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("the engine loop is not running")

    def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (introspection, tests)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                future.set_exception(self._dead)
                return future
            self._commands.put(("call", fn, future))
        return future

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.run_on_engine(fn))

    def shutdown_sync(self, timeout: float | None = 30.0) -> None:
        """Stop the loop: unfinished requests are aborted, their streams get EngineDeadError."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    async def shutdown(self, timeout: float | None = 30.0) -> None:
        await asyncio.to_thread(self.shutdown_sync, timeout)

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                busy = engine.has_unfinished_requests()
                stats = IterationStats()
                if self._apply(self._take_commands(block=not busy), stats):
                    self._stop("the engine was shut down")
                    return
                outputs: list[RequestOutput] = []
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                self._publish(outputs, stats)
                self._refresh_stats()
                self._log_stats(stats)
        except BaseException as exc:  # noqa: BLE001 - any crash must reach the callers
            logger.exception("ember engine loop crashed")
            self._die(EngineDeadError(f"the engine loop crashed: {exc!r}"), exc)

    def _take_commands(self, block: bool) -> list[tuple]:
        commands = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[tuple], stats: IterationStats) -> bool:
        """Run queued commands in order; True when asked to stop."""
        aborted: list[RequestOutput] = []
        for command in commands:
            kind = command[0]
            if kind == "add":
                _, request_id, prompt, params, arrival = command
                try:
                    self.engine.add_request(request_id, prompt, params, arrival)
                except Exception as exc:  # the caller's mistake: only that request fails
                    self._deliver([(request_id, exc)])
                    continue
                self._tracked[request_id] = _Tracked(arrival)
            elif kind == "abort":
                _, ids, notify = command
                outs = self.engine.abort_request(ids) or []
                if notify:
                    aborted.extend(outs)
                else:  # the caller is gone; only the metrics need to hear of it
                    self._account(outs, time.time(), stats)
            elif kind == "call":
                _, fn, future = command
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(self.engine))
                    except Exception as exc:
                        future.set_exception(exc)
            elif kind == "stop":
                return True
        if aborted:
            self._publish(aborted, stats)
        return False

    def _account(self, outputs: list[RequestOutput], now: float, stats: IterationStats) -> None:
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            num_generated = sum(len(o.token_ids) for o in out.outputs)
            if num_generated > tracked.num_generated:
                if tracked.num_generated == 0:
                    stats.num_prompt_tokens += len(out.prompt_token_ids)
                    first = out.metrics.first_token_time if out.metrics else None
                    stats.time_to_first_tokens.append((first or now) - tracked.arrival_time)
                else:
                    stats.inter_token_latencies.append(now - tracked.last_token_time)
                stats.num_generation_tokens += num_generated - tracked.num_generated
                tracked.num_generated = num_generated
                tracked.last_token_time = now
            if out.finished:
                del self._tracked[out.request_id]
                reason = next((o.finish_reason for o in out.outputs if o.finish_reason), "abort")
                stats.finished.append(
                    FinishedRequestStats(
                        out.request_id, reason, now - tracked.arrival_time,
                        len(out.prompt_token_ids), num_generated,
                    )
                )

    def _publish(self, outputs: list[RequestOutput], stats: IterationStats) -> None:
        if outputs:
            self._account(outputs, time.time(), stats)
            self._deliver([(out.request_id, out) for out in outputs])

    def _deliver(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand items to their streams: one call_soon_threadsafe per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:  # else the caller already left
                    by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                with self._lock:
                    gone = [rid for rid, s in self._streams.items() if s.loop is loop]
                self.engine.abort_request(gone)

    def _refresh_stats(self) -> None:
        engine = self.engine
        stats = engine.stats()
        stats["num_free_blocks"] = engine.num_free_blocks()
        stats["num_total_blocks"] = engine.num_total_blocks()
        stats["num_unfinished_requests"] = engine.get_num_unfinished_requests()
        self._stats = stats  # one assignment: readers on other threads see old or new, whole

    def _log_stats(self, stats: IterationStats) -> None:
        if stats.empty():
            return
        for stat_logger in list(self._stat_loggers):
            try:
                stat_logger(stats)
            except Exception:  # a broken logger must not take the engine down
                logger.exception("stat logger %r failed", stat_logger)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            self._dead = error
            ids = list(self._streams)
        self._deliver([(rid, error) for rid in ids])
        while True:  # pending calls would otherwise wait forever
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "call" and command[2].set_running_or_notify_cancel():
                command[2].set_exception(error)

    def _stop(self, reason: str) -> None:
        error = EngineDeadError(reason)
        with self._lock:
            self._dead = error
        ids = list(self.engine.output_processor.parents)
        if ids:
            logger.info("engine shutdown: aborting %d unfinished request(s)", len(ids))
            stats = IterationStats()
            self._account(self.engine.abort_request(ids) or [], time.time(), stats)
            self._log_stats(stats)
        self._refresh_stats()
        self._fail_all(error)

    def _die(self, error: EngineDeadError, cause: BaseException) -> None:
        error.__cause__ = cause
        self._fail_all(error)


def _put_all(batch: list[tuple[_Stream, Any]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
