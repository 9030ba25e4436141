"""AsyncLLM: the asyncio front end over an engine core in its own process.

Callers' coroutines (the server's handlers) tokenize and validate their prompts, register a stream
and send the request to the core. One output thread reads the core's outputs, detokenizes them,
applies stop strings (aborting those requests in the core), and hands each stream its output with
one `loop.call_soon_threadsafe` per event loop per message; it also feeds the stat loggers. The
interpreter lock of this process is shared only by HTTP work and output processing: the
scheduler and the model run in the core process.

A consumer that stops iterating (GeneratorExit, CancelledError) aborts its request; a bad request
fails only its caller; a core that dies or fails fails every pending request with
EngineDeadError at once, and `check_health` raises it from then on.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from ember.config import EngineArgs
from ember.core.messages import EngineCoreOutputs, SchedulerStats
from ember.engine.async_pooling import AsyncPoolingMixin
from ember.engine.core_client import CoreAddress, MPCoreClient
from ember.engine.engine_control import AsyncEngineControlMixin
from ember.engine.errors import EngineDeadError
from ember.engine.llm_engine import resolve_front_end_config
from ember.engine.output_processor import OutputProcessor, merge_delta_outputs
from ember.engine.processor import InputProcessor
from ember.inputs import PromptType
from ember.model_resolution import load_engine_tokenizer
from ember.outputs import RequestOutput
from ember.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ember.beam_search import BeamSearchParams

logger = logging.getLogger("ember")

__all__ = ["AsyncLLM", "EngineDeadError", "IterationStats", "FinishedRequestStats"]


@dataclass
class FinishedRequestStats:
    request_id: str
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one batch of core outputs did, for stat loggers (Prometheus, logs)."""

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
    """Latency bookkeeping of one live request (output thread only)."""

    arrival_time: float
    last_token_time: float = 0.0
    num_generated: int = 0
    delta: bool = False  # its outputs carry only new tokens


class _Stream:
    """The caller's side of one request: an asyncio queue living on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, merge: bool = False) -> None:
        self.loop = loop
        self.merge = merge  # DELTA outputs: queued ones are joined, not skipped
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    async def get(self) -> RequestOutput | BaseException:
        item = await self.queue.get()
        # A slow consumer gets what queued up in one output: the newest of cumulative ones,
        # all deltas joined; an error ends the stream.
        while not isinstance(item, BaseException) and not self.queue.empty():
            nxt = self.queue.get_nowait()
            item = merge_delta_outputs(item, nxt) if self.merge and not isinstance(
                nxt, BaseException) else nxt
        return item


class AsyncLLM(AsyncEngineControlMixin, AsyncPoolingMixin):
    """Serve many concurrent requests from asyncio code with one engine core process.
    reset_prefix_cache / sleep / wake_up / is_sleeping: ember.engine.engine_control; encode
    (pooling models): ember.engine.async_pooling."""

    def __init__(self, args: EngineArgs, attach: CoreAddress | None = None,
                 client_index: int = 0) -> None:
        args.validate()
        self.args = args
        self.client_index = client_index
        start = time.perf_counter()
        # The core (when we start it) loads the model while we read the config and tokenizer.
        self.client = MPCoreClient(args if attach is None else None, attach=attach)
        try:
            self.model_config = resolve_front_end_config(args)
            self.tokenizer = load_engine_tokenizer(args, self.model_config)
            self.ready = self.client.connect()
        except BaseException:
            self.client.shutdown()
            raise
        self.max_model_len = self.model_config.max_model_len
        # Callers tokenize on their threads; the output thread detokenizes with its own copy
        # (an HF fast tokenizer must not be used from two threads at once).
        self.processor = InputProcessor(self.model_config, copy.deepcopy(self.tokenizer),
                                        args.scheduling_policy)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._lock = threading.Lock()  # guards streams, the output processor and _dead
        self._streams: dict[str, _Stream] = {}
        self._dead: EngineDeadError | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._stat_loggers: list[StatLogger] = []
        self._stats_log = None  # vLLM's periodic log lines (disable_log_stats=False)
        if not args.disable_log_stats:
            from ember.engine.stat_logging import LoggingStatLogger

            self._stats_log = LoggingStatLogger()
            self._stat_loggers.append(self._stats_log.record_iteration)
        self._sched_stats: SchedulerStats = self.client.first_stats or SchedulerStats()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._init_pooling()
        self._thread = threading.Thread(target=self._run, name="ember-outputs", daemon=True)
        self._thread.start()
        logger.info("front end ready in %.1f s (engine core pid %d)",
                    time.perf_counter() - start, self.client.address.pid)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(args)

    # ---- read-only views (safe from any thread) -------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def platform_name(self) -> str:
        return self.ready.platform

    @property
    def attention_backend_name(self) -> str:
        return self.ready.attention_backend

    def stats(self) -> dict[str, Any]:
        """Scheduler and KV-cache numbers as the core last reported them."""
        stats = msgspec.structs.asdict(self._sched_stats)
        stats["num_total_blocks"] = stats["num_total_blocks"] or self.ready.num_blocks
        # Requests this front end still owes output for (the core counts every client's).
        stats["num_unfinished_requests"] = len(self.output_processor.parents) + len(self._pooling)
        return stats

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """`stat_logger(IterationStats)` is called on the output thread for each batch."""
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
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs of one request until it finishes, as its params' output_kind
        says: cumulative (the default), deltas, or only the final one.

        Errors in the request (bad prompt, duplicate id) are raised here; stopping the iteration
        early aborts the request and frees its KV blocks. `priority` (lower first) needs
        scheduling_policy="priority"."""
        arrival_time = arrival_time or time.time()
        text, ids, params, core_requests = self.processor.process(
            request_id, prompt, params, arrival_time, self.client_index, priority)
        delta = params.output_kind == RequestOutputKind.DELTA
        stream = _Stream(asyncio.get_running_loop(), merge=delta)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self._streams or request_id in self.output_processor.parents:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.output_processor.add_request(
                request_id, text, ids, params, [r.request_id for r in core_requests],
                [r.sampling_params for r in core_requests], arrival_time)
            self._streams[request_id] = stream
            self._tracked[request_id] = _Tracked(arrival_time, delta=delta)
        finished = False
        try:
            self.client.add_requests(core_requests)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing to abort: the request is gone from the engine
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort([request_id], notify=False)
            with self._lock:
                self._streams.pop(request_id, None)

    async def beam_search(self, prompt: PromptType, request_id: str, params: BeamSearchParams,
                          lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        """vLLM's EngineClient.beam_search: yields one finished RequestOutput whose outputs are
        the best beams, best first (generated tokens, text, cumulative_logprob). Each step's
        beams are requests `{request_id}-beam{step}-{i}`; leaving early aborts them."""
        from ember.beam_search import beam_search_async

        async for output in beam_search_async(self, prompt, request_id, params, lora_request):
            yield output

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests; their generate() streams end with a finish_reason "abort" output."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self._pooling_mode:  # their callers see CancelledError
            self._abort_pooled(ids, cancel=True)
        self._abort(ids, notify=True)

    def _abort(self, ids: list[str], notify: bool) -> None:
        stats = IterationStats()
        with self._lock:
            finals, core_ids = self.output_processor.abort_requests(ids)
            self._account(finals, time.time(), stats)
        if notify:
            self._deliver([(out.request_id, out) for out in finals])
        self._log_stats(stats)
        if self._dead is None:
            try:
                self.client.abort_requests(core_ids)
            except EngineDeadError:
                pass

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine core is gone."""
        if self._dead is not None:
            raise self._dead
        if not self._thread.is_alive():
            raise EngineDeadError("the output thread is not running")

    async def call_core(self, method: str, *args: Any) -> Any:
        """Call an EngineCore method in the core process (introspection, tests)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            call_id = self.client.send_utility(method, *args)
            self._calls[call_id] = (loop, future)
        return await future

    def call_core_sync(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        """`call_core` for threads without an event loop."""
        return asyncio.run(asyncio.wait_for(self.call_core(method, *args), timeout))

    def shutdown_sync(self, timeout: float | None = 30.0) -> None:
        """Stop the core: unfinished requests get EngineDeadError."""
        with self._lock:
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")
        self._fail_all(self._dead)
        self.client.request_shutdown()
        self._thread.join(timeout)  # it leaves within a second (or when the core exits)
        self.client.shutdown()

    async def shutdown(self, timeout: float | None = 30.0) -> None:
        await asyncio.to_thread(self.shutdown_sync, timeout)

    # ---- the output thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._dead is None:
                outs = self.client.recv(timeout=1.0)
                if outs is not None:
                    self._handle(outs)
                if self._stats_log is not None:  # at least every second, idle or not
                    self._stats_log.maybe_log(self._sched_stats)
        except EngineDeadError as exc:
            if self._dead is None:
                logger.error("engine core is gone: %s", exc)
            self._die(exc)
        except Exception as exc:  # a bug here must still reach the callers
            logger.exception("ember output thread crashed")
            self._die(EngineDeadError(f"the output thread crashed: {exc!r}"))

    def _handle(self, outs: EngineCoreOutputs) -> None:
        if outs.engine_error is not None:
            raise self.client.fail(outs.engine_error)
        if outs.scheduler_stats is not None:
            self._sched_stats = outs.scheduler_stats
        if outs.utility_result is not None:
            self._finish_call(outs.utility_result)
        if not outs.outputs:
            return
        if self._pooling_mode:  # a pooling core sends nothing else
            self._deliver_pooled(outs.outputs)
            return
        stats = IterationStats()
        with self._lock:
            outputs, stopped = self.output_processor.process(outs)
            self._account(outputs, time.time(), stats)
        if stopped:
            self.client.abort_requests(stopped)
        self._deliver([(out.request_id, out) for out in outputs])
        self._log_stats(stats)

    def _finish_call(self, result) -> None:
        with self._lock:
            entry = self._calls.pop(result.call_id, None)
        if entry is None:
            return
        loop, future = entry

        def settle() -> None:
            if future.done():
                return
            if result.error is not None:
                future.set_exception(RuntimeError(f"engine core call failed: {result.error}"))
            else:
                future.set_result(result.result)

        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # that loop is closed: nobody waits
            pass

    def _account(self, outputs: list[RequestOutput], now: float, stats: IterationStats) -> None:
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            num_generated = sum(len(o.token_ids) for o in out.outputs)
            if tracked.delta:
                num_generated += tracked.num_generated
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
                self._abort(gone, notify=False)

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
            ids = list(self._streams)
            calls, self._calls = list(self._calls.values()), {}
            for parent_id in list(self.output_processor.parents):
                self.output_processor.abort(parent_id)
            self._tracked.clear()
        self._fail_pooled(error)
        self._deliver([(rid, error) for rid in ids])
        for loop, future in calls:
            try:
                loop.call_soon_threadsafe(
                    lambda f=future: f.done() or f.set_exception(error))
            except RuntimeError:
                pass

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
            error = self._dead
        self._fail_all(error)


def _put_all(batch: list[tuple[_Stream, Any]]) -> None:
    for stream, item in batch:
        stream.queue.put_nowait(item)
