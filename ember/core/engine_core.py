"""EngineCore: the scheduler, the KV cache manager and the executor, stepping requests.

It knows token ids only: tokenization, detokenization, stop strings and n > 1 fan-out live in
the front end (`ember.engine`). A step returns compact `EngineCoreOutputs`; the same object runs
in the caller's process (offline `LLM`) or in a process of its own (`ember.core.engine_core_proc`).
The executor is resolved by name through the executor registry, so the core never imports a
worker.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ember import envs
from ember.config import EngineArgs
from ember.core.engine_control import EngineCoreControl
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    SchedulerStats,
)
from ember.core.request import Request, RequestStatus
from ember.core.scheduler import Scheduler
from ember.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("ember")


def resolve_executor_class(name: str | None):
    from ember.registry import ExecutorRegistry

    return ExecutorRegistry.resolve(name or "uni")


class EngineCore(EngineCoreControl):
    """Owns the scheduler and the executor; `step()` advances every running request by one.
    Engine control (sleep, wake_up, collective_rpc) is ember.core.engine_control's."""

    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        start = time.perf_counter()
        self.args = args
        self.executor = resolve_executor_class(args.executor_backend())(args)
        self.model_config = self.executor.model_config
        self.max_model_len = self.model_config.max_model_len
        num_blocks = self.executor.num_blocks
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * args.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: raise the KV cache memory or lower "
                "max_model_len"
            )
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        platform = self.executor.platform
        from ember.model_resolution import engine_tokenizer_loader

        # Grammars are built on worker threads (or in the grammar process, below); the
        # tokenizer is loaded there, on first use.
        self.structured_output = StructuredOutputManager(
            StructuredOutputsConfig.of(args.structured_outputs_config),
            engine_tokenizer_loader(args, self.model_config),
            self.model_config.vocab_size, self.model_config.eos_token_ids())
        self.async_scheduling = args.async_scheduling
        if self.async_scheduling is None:
            # Only a device that runs behind the host gains from overlapping the two.
            self.async_scheduling = platform.async_scheduling_default
        # Structured outputs under async scheduling (see step()): whether a step's sampling can
        # wait for its bitmask while its forward runs.
        self._defer_grammar_sampling = self.async_scheduling and getattr(
            self.executor, "defers_grammar_sampling", False)
        # The grammars may also advance on the bitmask helper thread, in one batched backend
        # call that releases the GIL, instead of a call a token on this thread: opt-in, as the
        # helper then starts its work later and the engine thread waits longer for the bitmask
        # than the accepts cost it (H200: 1.6-1.8 against 0.4 ms a step of waiting).
        self.structured_output.defer_accepts = (self._defer_grammar_sampling
                                                and envs.grammar_deferred_accepts())
        # Or the grammars live in a process of their own, which accepts and fills while this
        # thread goes on (ember.structured_output.grammar_process): by default where the
        # sampling waits for the bitmask on a device, into buffers page-locked here.
        grammar_process = envs.grammar_process()
        if grammar_process is None:
            grammar_process = self._defer_grammar_sampling and not platform.device_is_host()
        if grammar_process:
            # Polling, not blocking, for the other side's messages (a few ms at most) where
            # a device does the forward and the host has cores to spare: a blocked thread's
            # wake-up took 0.2-0.8 ms on an H200 host. Not on a CPU, whose cores run the model.
            on_device = not platform.device_is_host()
            spare_cores = (os.cpu_count() or 1) >= 8
            self.structured_output.use_process(
                count=3, pin=platform.pin_host_memory if on_device else None,
                spin_seconds=0.005 if on_device and spare_cores else 0.0)
        elif self._defer_grammar_sampling and not platform.device_is_host():
            # The runner is in this process: bitmasks are filled into page-locked buffers it
            # copies to the device as they are. One a step: the one being filled, the one the
            # step in flight samples with, and one spare.
            import torch

            self.structured_output.use_host_buffers(
                lambda numel: platform.empty_host_buffer(numel, torch.int32), count=3)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            self.executor.max_num_batched_tokens,
            args.max_num_seqs,
            self.max_model_len,
            self.async_scheduling,
            policy=args.scheduling_policy,
            structured_output=self.structured_output,
            max_concurrent_batches=args.concurrent_batches(),
        )
        self._in_flight: tuple[SchedulerOutput, Any] | None = None  # (plan, launched step)
        # The in-flight step's bitmask being filled (its sampling is launched with the next step).
        self._pending_bitmask: Future | None = None
        # Pipeline parallelism: up to max_concurrent_batches (plan, launched step), oldest
        # first, and the most that were ever in flight at once (tests, benchmarks).
        self.max_concurrent_batches = args.concurrent_batches()
        self._batch_queue: collections.deque[tuple[SchedulerOutput, Any]] = collections.deque()
        self.peak_batches_in_flight = 0
        self._injected_failure: str | None = None
        from ember.core.step_timer import StepTimer

        self.timer = StepTimer(envs.step_timing())
        self.ready = EngineReady(
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_num_batched_tokens=self.executor.max_num_batched_tokens,
            platform=platform.name,
            attention_backend=self.executor.attn_backend.name,
            async_scheduling=self.async_scheduling,
            startup_seconds=time.perf_counter() - start,
            startup_breakdown={k: round(float(v), 3) for k, v in
                               getattr(self.executor, "startup_breakdown", {}).items()},
        )
        logger.info(
            "engine core ready in %.1f s: %s (%s, %s), KV cache %d blocks x %d tokens, backend %s%s",
            self.ready.startup_seconds, self.model_config.architecture, self.model_config.dtype,
            platform.name, num_blocks, args.block_size, self.executor.attn_backend.name,
            ", async scheduling" if self.async_scheduling else "",
        )

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        params = req.sampling_params
        params.all_stop_token_ids = set(req.all_stop_token_ids)
        request = Request(req.request_id, req.prompt_token_ids, params, set(req.eos_token_ids),
                          self.args.block_size, req.arrival_time, priority=req.priority,
                          cache_salt=req.cache_salt)
        request.outputs_at_end = req.outputs_at_end
        if params.structured_outputs is not None:
            self.structured_output.add(request)  # compiles on a worker thread
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """End requests now and free their blocks (unknown or finished ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        if self.sleep_level:  # requests wait for wake_up (see ember.core.engine_control)
            return False
        return (self._in_flight is not None or bool(self._batch_queue)
                or self.scheduler.has_unfinished_requests())

    # ---- stepping ----------------------------------------------------------------------
    @property
    def defers_grammar_sampling(self) -> bool:
        """Whether a step with grammar rows samples once its bitmask is filled, while its
        forward runs (async scheduling with an in-process runner), instead of before."""
        return self._defer_grammar_sampling

    def step(self) -> EngineCoreOutputs:
        """Plan and run one step; with async scheduling the outputs are the previous step's,
        folded in while this one runs on the device."""
        if self._injected_failure is not None:
            raise RuntimeError(self._injected_failure)
        if self.sleep_level:
            return EngineCoreOutputs(timestamp=time.time())
        if self.max_concurrent_batches > 1:
            return self._step_batch_queue()
        timer = self.timer
        timer.start()
        structured = self.structured_output
        # Structured outputs under async scheduling: a step's forward does not need its bitmask,
        # only its sampling does, and the bitmask needs the tokens of the step still in flight.
        # So the step is launched with its sampling deferred, the step before is folded in (its
        # tokens advance the grammars) while the forward runs, and then the bitmask is filled on
        # the backends' threads while this thread hands outputs over and schedules the next
        # step, whose launch is preceded by this one's sampling. An executor that cannot defer
        # folds the step before in first instead (its grammar rows would otherwise be masked by
        # a stale grammar state).
        defer = self._defer_grammar_sampling
        folded = None
        if (not defer and self._in_flight is not None
                and self._in_flight[0].grammar_bitmask is not None):
            prev, self._in_flight = self._in_flight, None
            folded = self._fold_in(prev[0], prev[1].resolve())
        scheduler = self.scheduler
        plan = scheduler.schedule()
        grammar_rows = (structured.sampling_rows(plan)
                        if structured.in_use and plan.scheduled_requests else None)
        if grammar_rows:
            if defer:
                plan.grammar_deferred = True
            else:
                plan.grammar_bitmask = structured.fill(grammar_rows)
        timer.mark("schedule")
        # The step in flight's bitmask is being filled meanwhile: its sampling is launched
        # once this step's host inputs are built (their time is the fill's), before this
        # step's device work, which reads the sampled tokens.
        sample = self._launch_deferred_sampling if self._pending_bitmask is not None else None
        if plan.is_empty:
            launched = None
            if sample is not None:
                sample()
        elif sample is not None:
            launched = (plan, self.executor.launch(plan, before_device=sample))
        else:
            launched = (plan, self.executor.launch(plan))
        # Requests whose grammar the last fill found complete end now that this step is
        # launched (they may be in it, as in the step in flight: their tokens are dropped).
        self._end_finished_grammars()
        # After a deferred sampling, what is left of the launch (the forward's) is its own phase.
        timer.mark("prepare" if sample is None else "launch after the sampling")
        if self.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        if launched is None:
            if plan.grammar_deferred:  # nothing was in flight: the grammars are current
                self._finish_sampling(plan, grammar_rows)
                self._end_finished_grammars()
            if plan.is_empty and self._in_flight is None and scheduler.compiling:
                structured.wait(0.01)  # only grammars being built: don't spin
            timer.mark("no launch")
            return self._report_ended(folded or EngineCoreOutputs(timestamp=time.time()))
        result = launched[1].resolve()  # the step's one device-to-host sync
        timer.mark("wait")
        fill = None
        if plan.grammar_deferred:
            # The backends fill the bitmask on their own threads (or the grammar process) from
            # as soon as the tokens are recorded, while this thread makes and hands over the
            # outputs and schedules the next step; the sampling is launched before the next
            # step is (that step reads the sampled tokens on the device).
            def fill() -> None:
                self._pending_bitmask = structured.fill_async(grammar_rows)
                timer.mark("grammar")
        return self._report_ended(self._fold_in(launched[0], result, fill))

    def _step_batch_queue(self) -> EngineCoreOutputs:
        """Pipeline parallelism (vLLM's step_with_batch_queue): launch a new batch while fewer
        than max_concurrent_batches are in flight and there is one to schedule (from requests
        not in flight: the scheduler's rule), so the first stage runs batch k+1 while the next
        runs batch k; otherwise wait for the oldest batch and fold it in. Results come in
        order. A request's token is known before it is scheduled again, so its grammar bitmask
        is filled at once (no deferred sampling)."""
        queue, scheduler, structured = self._batch_queue, self.scheduler, self.structured_output
        timer = self.timer
        timer.start()
        if len(queue) < self.max_concurrent_batches and scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            if structured.in_use and plan.scheduled_requests:
                grammar_rows = structured.sampling_rows(plan)
                if grammar_rows:
                    plan.grammar_bitmask = structured.fill(grammar_rows)
            timer.mark("schedule")
            if not plan.is_empty:
                queue.append((plan, self.executor.launch(plan)))
                self._end_finished_grammars()
                timer.mark("prepare")
                self.peak_batches_in_flight = max(self.peak_batches_in_flight, len(queue))
                if len(queue) < self.max_concurrent_batches:
                    return self._report_ended(EngineCoreOutputs(timestamp=time.time()))
        if not queue:
            if scheduler.compiling:
                structured.wait(0.01)  # only grammars being built: don't spin
            return self._report_ended(EngineCoreOutputs(timestamp=time.time()))
        plan, launched = queue.popleft()
        result = launched.resolve()
        timer.mark("wait")
        return self._report_ended(self._fold_in(plan, result))

    def _launch_deferred_sampling(self) -> None:
        """Launch the in-flight step's sampling under the bitmask filled for it meanwhile."""
        pending, self._pending_bitmask = self._pending_bitmask, None
        timer = self.timer
        timer.mark("prepare")  # the next step's host work, when called from its launch
        waited_from = time.perf_counter()
        bitmask = pending.result()
        timer.mark("grammar")
        if timer.enabled:  # the helper's side: its backend fill, and how much of it was waited on
            start, end = self.structured_output.last_fill
            timer.add("helper: fill", end - start)
            timer.add("helper: fill still running at the wait", max(0.0, end - waited_from))
            for phase, seconds in self.structured_output.last_fill_phases.items():
                timer.add(phase, seconds)
        self.executor.finish_sampling(self._in_flight[1], bitmask)
        timer.mark("sample")

    def _finish_sampling(self, plan: SchedulerOutput, grammar_rows: list) -> None:
        """Fill the in-flight step's bitmask from the grammars' current states and launch its
        sampling."""
        bitmask = self.structured_output.fill(grammar_rows)
        self.timer.mark("grammar")
        self.executor.finish_sampling(self._in_flight[1], bitmask)
        self.timer.mark("sample")

    def _report_ended(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Requests ended outside a fold-in (Scheduler.ended): a grammar that could not be
        built ("abort"), or one found complete ("stop") or refusing its token ("abort") as its
        bitmask was filled."""
        ended = self.scheduler.ended
        if ended:
            for request in ended:
                out = EngineCoreOutput(request.request_id,
                                       finish_reason=request.status.finish_reason)
                if request.outputs_at_end:
                    _all_tokens(out, request)
                outputs.outputs.append(out)
            ended.clear()
        return outputs

    def _end_finished_grammars(self) -> None:
        """End the requests whose grammar the last fill found complete or refusing a token
        (deferred accepts, ember.structured_output.manager)."""
        for request, status in self.structured_output.take_finished():
            self.scheduler.finish_by_grammar(request, status)

    def _fold_in(self, plan: SchedulerOutput, result: ModelRunnerOutput,
                 after_update: Callable[[], None] | None = None) -> EngineCoreOutputs:
        """The step's results into the requests, and the outputs. ``after_update`` (sending
        the next fill) runs once the grammars have the step's tokens: before the outputs are
        made, and with a grammar process before the requests take the tokens too."""
        scheduler, structured = self.scheduler, self.structured_output
        if structured.uses_process:
            # The process needs only the step's tokens: they go first, and the next fill with
            # them, which runs while the requests take the tokens (the fill is a step's
            # critical path once the engine thread's own work is short).
            structured.accept_many(scheduler.grammar_tokens(plan, result))
            if after_update is not None:
                after_update()
                after_update = None
        touched = scheduler.update_from_output(plan, result)
        self.timer.mark("update")
        if after_update is not None:
            after_update()
        sampled, logprobs, prompt_logprobs = (
            result.sampled_token_ids, result.logprobs, result.prompt_logprobs)
        outputs = []
        for request in touched:
            finished = request.status >= RequestStatus.FINISHED_STOPPED
            if request.outputs_at_end and not finished:
                continue  # nothing until it finishes: no output to make or fold in per step
            req_id = request.request_id
            token = sampled.get(req_id)
            out = EngineCoreOutput(req_id, [token] if token is not None else [])
            if request.outputs_at_end:
                _all_tokens(out, request)
            elif token is not None and req_id in logprobs:
                out.new_logprobs = [logprobs[req_id]]
            if req_id in prompt_logprobs:
                out.prompt_logprobs = prompt_logprobs[req_id]
            if finished:
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
            if request.num_cached_tokens >= 0:
                out.num_cached_tokens = request.num_cached_tokens
            out.num_preemptions = request.metrics.num_preemptions
            if not request.first_scheduled_sent:
                request.first_scheduled_sent = True
                out.first_scheduled_time = request.metrics.first_scheduled_time or 0.0
            outputs.append(out)
        self.timer.mark("output")
        return EngineCoreOutputs(outputs, time.time())

    # ---- introspection (also reachable as utility calls from another process) -----------
    def scheduler_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        scheduler = self.scheduler
        return SchedulerStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.compiling),
            kv_cache_usage=kv.usage(),
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.pool.num_blocks,
            num_unfinished_requests=scheduler.get_num_unfinished_requests(),
        )

    def stats(self) -> dict[str, Any]:
        """scheduler_stats() as a plain dict (what a utility call can carry)."""
        import msgspec

        return msgspec.structs.asdict(self.scheduler_stats())

    def idle_report(self) -> dict[str, int]:
        """What tests check after a run: nothing left running, every KV block free."""
        return {
            "has_work": int(self.has_work()),
            "num_free_blocks": self.kv_cache_manager.num_free_blocks,
            "num_total_blocks": self.kv_cache_manager.pool.num_blocks,
            "requests_holding_blocks": len(self.kv_cache_manager.req_to_blocks),
        }

    def inject_step_failure(self, message: str) -> None:
        """Fault injection: the next step raises RuntimeError(message), as a device error
        would, so the failure path (clients told why, process exit) can be tested."""
        self._injected_failure = message

    def get_ready(self) -> EngineReady:
        return self.ready

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _all_tokens(out: EngineCoreOutput, request: Request) -> None:
    """An outputs-at-end request's one output: every token it generated, and their times."""
    out.new_token_ids = list(request.output_token_ids)
    metrics = request.metrics
    out.first_token_time = metrics.first_token_time or 0.0
    out.last_token_time = metrics.last_token_time or 0.0
