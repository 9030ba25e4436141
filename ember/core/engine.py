"""LLMEngine: validates and tokenizes requests, runs scheduler + executor steps, emits outputs."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from ember.config import EngineArgs
from ember.core.kv_cache_manager import KVCacheManager
from ember.core.output_processor import OutputProcessor, ParentState
from ember.core.request import Request, RequestStatus
from ember.core.scheduler import Scheduler
from ember.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from ember.inputs import PromptType
from ember.outputs import RequestMetrics, RequestOutput
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember")


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        from ember.executor.uniproc import UniProcExecutor

        args.validate()
        self.args = args
        start = time.perf_counter()
        self.executor = UniProcExecutor(args)
        self.model_config = self.executor.model_config
        self.max_model_len = self.model_config.max_model_len
        from ember.config import load_engine_tokenizer

        self.tokenizer = load_engine_tokenizer(args, self.model_config)
        self.eos_token_ids = self._eos_token_ids()
        num_blocks = self.executor.num_blocks
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * args.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}: raise the KV cache memory or lower "
                "max_model_len"
            )
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        self.async_scheduling = args.async_scheduling
        if self.async_scheduling is None:
            # Only a device that runs behind the host gains from overlapping the two.
            self.async_scheduling = self.executor.platform.device_type == "cuda"
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            self.executor.max_num_batched_tokens,
            args.max_num_seqs,
            self.max_model_len,
            self.async_scheduling,
        )
        self._in_flight: tuple[SchedulerOutput, Any] | None = None  # (plan, launched step)
        self.output_processor = OutputProcessor(self.tokenizer)
        from ember import envs
        from ember.core.step_timer import StepTimer

        self.timer = StepTimer(envs.step_timing())
        logger.info(
            "engine ready in %.1f s: %s (%s, %s), KV cache %d blocks x %d tokens, backend %s%s",
            time.perf_counter() - start, self.model_config.architecture, self.model_config.dtype,
            self.executor.platform.name, num_blocks, args.block_size, self.executor.attn_backend.name,
            ", async scheduling" if self.async_scheduling else "",
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args)

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model_config.hf_config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def get_tokenizer(self):
        return self.tokenizer

    # ---- requests ----------------------------------------------------------------------
    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], None
        else:
            raise ValueError(
                "prompt must be a string, a TextPrompt {'prompt': ...} or a TokensPrompt "
                f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a string, got {type(text).__name__}")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
            ids = self.tokenizer.encode(text) if text else []
        return text, ids

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt (length {len(ids)}) is longer than the maximum model length of "
                f"{self.max_model_len} minus one token for the output"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:5]}")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._prompt_ids(prompt)
        self.validate_prompt(ids)
        arrival_time = arrival_time or time.time()
        children = []
        for index in range(params.n):
            child_params = self._child_params(params, index, len(ids))
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            request = Request(
                child_id, ids, child_params, self.eos_token_ids, self.args.block_size,
                arrival_time, parent_id=request_id, index=index,
            )
            children.append(request)
        states = [self.output_processor.make_child(r) for r in children]
        self.output_processor.add(
            ParentState(request_id, text, ids, params, states, RequestMetrics(arrival_time))
        )
        for request in children:
            self.scheduler.add_request(request)

    def _child_params(self, params: SamplingParams, index: int, prompt_len: int) -> SamplingParams:
        child = params.clone()
        child.n = 1
        if child.max_tokens is None:
            child.max_tokens = self.max_model_len - prompt_len
        if index > 0:
            # Only one child reports prompt logprobs; distinct seeds keep the n samples distinct.
            child.prompt_logprobs = None
            if child.seed is not None:
                child.seed = child.seed + index
        # The sampler masks these while min_tokens is not reached (vLLM adds eos the same way).
        child.all_stop_token_ids = set(child.stop_token_ids)
        if not child.ignore_eos:
            child.all_stop_token_ids |= self.eos_token_ids
        return child

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests; returns a final output (finish_reason "abort") for each live one."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        finals = []
        for parent_id in ids:
            parent = self.output_processor.parents.get(parent_id)
            children = self.output_processor.abort(parent_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            if parent is not None:  # async callers end their streams with it
                finals.append(self.output_processor.make_output(parent))
        return finals

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ---- stepping ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Advance every running request by one step; returns the outputs that changed.

        With async scheduling the step planned and launched here runs on the device while the
        previous step's tokens are folded in, so the outputs returned lag one step behind."""
        timer = self.timer
        timer.start()
        plan = self.scheduler.schedule()
        timer.mark("schedule")
        launched = None if plan.is_empty else (plan, self.executor.launch(plan))
        timer.mark("prepare")
        if self.async_scheduling:
            launched, self._in_flight = self._in_flight, launched
        if launched is None:
            return []
        result = launched[1].resolve()  # the step's one device-to-host sync
        timer.mark("wait")
        return self._fold_in(launched[0], result)

    def _fold_in(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[RequestOutput]:
        touched = self.scheduler.update_from_output(plan, result)
        self.timer.mark("update")
        outputs = self.output_processor.process(
            touched,
            result,
            lambda ids: self.scheduler.finish_requests(ids, RequestStatus.FINISHED_STOPPED),
        )
        self.timer.mark("output")
        return outputs

    # ---- introspection -----------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks

    def num_total_blocks(self) -> int:
        return self.kv_cache_manager.pool.num_blocks

    def stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.usage(),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
        }
