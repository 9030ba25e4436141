"""LLMEngine: the synchronous front end (vLLM's add_request / step / abort_request).

It tokenizes and validates requests (InputProcessor), hands them to the engine core through a
core client, and turns the core's outputs into RequestOutputs (OutputProcessor). The core runs in
this process unless `multiprocess=True` (or EMBER_ENGINE_PROCESS=1): then `step()` returns
whatever the core process has finished since the last call, waiting for at least one step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from ember.config import EngineArgs
from ember.core.messages import EngineCoreOutputs
from ember.engine.core_client import InprocCoreClient, MPCoreClient
from ember.engine.engine_control import EngineControlMixin
from ember.engine.output_processor import OutputProcessor, outputs_at_end
from ember.engine.processor import InputProcessor
from ember.inputs import PromptType
from ember.model_resolution import load_engine_tokenizer
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember")


def resolve_front_end_config(args: EngineArgs):
    """The ModelConfig as the core will resolve it (same function, same arguments)."""
    from ember.model_resolution import resolve_model_config
    from ember.platforms import resolve_platform
    from ember.plugins import load_plugins

    load_plugins()
    return resolve_model_config(args, resolve_platform(args.device))


class LLMEngine(EngineControlMixin):
    """Engine control (sleep, collective_rpc, get_metrics...) is ember.engine.engine_control's."""

    def __init__(self, args: EngineArgs, multiprocess: bool | None = None) -> None:
        from ember import envs

        args.validate()
        self.args = args
        start = time.perf_counter()
        if multiprocess is None:
            multiprocess = envs.engine_process()
        self.client: InprocCoreClient | MPCoreClient
        if multiprocess:
            # The core loads the model while this process reads the config and the tokenizer.
            self.client = MPCoreClient(args)
            try:
                self.model_config = resolve_front_end_config(args)
                self.ready = self.client.connect()
            except BaseException:
                self.client.shutdown()
                raise
        else:
            self.client = InprocCoreClient(args)
            self.model_config = self.client.core.model_config
            self.ready = self.client.ready
        self.max_model_len = self.model_config.max_model_len
        self.tokenizer = load_engine_tokenizer(args, self.model_config)
        self.processor = InputProcessor(self.model_config, self.tokenizer, args.scheduling_policy)
        self.eos_token_ids = self.processor.eos_token_ids
        self.output_processor = OutputProcessor(self.tokenizer)
        self._init_stats()
        logger.info("engine ready in %.1f s (engine core %s)", time.perf_counter() - start,
                    "in its own process" if multiprocess else "in this process")

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    # ---- what the engine runs on -------------------------------------------------------
    @property
    def platform_name(self) -> str:
        return self.ready.platform

    @property
    def attention_backend_name(self) -> str:
        return self.ready.attention_backend

    @property
    def async_scheduling(self) -> bool:
        """Whether the core plans step N+1 while step N runs (outputs lag a step)."""
        return self.ready.async_scheduling

    @property
    def engine_core(self):
        """The EngineCore object when it runs in this process (tests, benchmarks)."""
        if isinstance(self.client, InprocCoreClient):
            return self.client.core
        raise AttributeError("the engine core runs in another process")

    @property
    def executor(self):
        return self.engine_core.executor

    @property
    def kv_cache_manager(self):
        return self.engine_core.kv_cache_manager

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    def get_tokenizer(self):
        return self.tokenizer

    # ---- requests ----------------------------------------------------------------------
    def validate_prompt(self, ids: list[int]) -> None:
        self.processor.validate_prompt(ids)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; `priority` (lower first) needs scheduling_policy="priority"."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_awake()
        arrival_time = arrival_time or time.time()
        text, ids, params, core_requests = self.processor.process(
            request_id, prompt, params, arrival_time, priority=priority)
        self.output_processor.add_request(
            request_id, text, ids, params, [r.request_id for r in core_requests],
            [r.sampling_params for r in core_requests], arrival_time)
        if self.stats_tracker is not None:
            self.stats_tracker.add([r.request_id for r in core_requests], len(ids), arrival_time)
        elif outputs_at_end(params):
            # Nothing is read of it before it ends: the core sends its tokens once, then, and
            # neither side touches it per step (an abort's final output has no tokens).
            for request in core_requests:
                request.outputs_at_end = True
        self.client.add_requests(core_requests)

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests; returns a final output (finish_reason "abort") for each live one."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        finals, core_ids = self.output_processor.abort_requests(ids)
        if self.stats_tracker is not None:
            self.stats_tracker.finish(core_ids, "abort")
        self.client.abort_requests(core_ids)
        return finals

    def has_unfinished_requests(self) -> bool:
        if self.output_processor.has_unfinished():
            return True
        # In process, also finish a step still in flight (async scheduling) before going idle.
        return not self.client.multiprocess and self.client.has_work()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ---- stepping ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every running request by one step; returns the outputs that changed.

        With async scheduling the outputs lag one step behind the device; with the core in its
        own process they are whatever it finished since the last call."""
        client = self.client
        if not client.multiprocess:
            return self._process(client.step())
        batches = client.take_pending()
        if not batches:
            if not self.output_processor.has_unfinished():
                return []
            first = client.recv()
            assert first is not None
            batches = [first]
        while True:  # take everything already waiting: fewer, larger batches
            more = client.recv(timeout=0)
            if more is None:
                break
            batches.append(more)
        outputs: list[RequestOutput] = []
        for batch in batches:
            outputs += self._process(batch)
        return outputs

    def _process(self, core_outputs: EngineCoreOutputs) -> list[RequestOutput]:
        if core_outputs.engine_error is not None:
            raise self.client.fail(core_outputs.engine_error)
        tracker = self.stats_tracker
        if tracker is not None:
            tracker.record(core_outputs)
            self._log_stats()
        if not core_outputs.outputs:
            return []
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            if tracker is not None:
                tracker.finish(stopped, "stop")  # a stop string, seen here, not in the core
            self.client.abort_requests(stopped)
        return outputs

    # ---- introspection -----------------------------------------------------------------
    def call_core(self, method: str, *args: Any) -> Any:
        """Call an EngineCore method (in whichever process it runs) and return its result."""
        return self.client.call_utility(method, *args)

    def num_free_blocks(self) -> int:
        return self.stats()["num_free_blocks"]

    def num_total_blocks(self) -> int:
        return self.ready.num_blocks

    def stats(self) -> dict[str, Any]:
        """Scheduler and KV-cache numbers, asked of the core now (wherever it runs)."""
        return self.call_core("stats")

    def shutdown(self) -> None:
        self.client.shutdown()

    def __del__(self) -> None:
        client = getattr(self, "client", None)
        if client is not None and client.multiprocess:
            try:
                client.shutdown()
            except Exception:  # interpreter teardown: best effort
                pass
