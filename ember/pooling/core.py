"""PoolingEngineCore: the engine core for pooling models (embeddings, classification, scoring).

Same surface as ember.core.engine_core.EngineCore (add_request / abort_requests / has_work /
step / ready / stats), so the in-process client and the engine-core process run either. Pooling
requests need one prefill and no KV cache: each step admits waiting requests first come, first
served under the token budget (max_num_batched_tokens) and max_num_seqs, runs them as one packed
batch, and finishes every one of them with its pooled vector (float32 bytes in
`EngineCoreOutput.pooled`, what crosses a process boundary). `make_engine_core` picks this core
or the generate core from the resolved runner.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from ember.config import EngineArgs
from ember.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    SchedulerStats,
)

logger = logging.getLogger("ember")

DEFAULT_TOKEN_BUDGET = 16384


def make_engine_core(args: EngineArgs):
    """The EngineCore for a generating model, a PoolingEngineCore for a pooling one."""
    if args.runner != "generate":
        from ember.model_resolution import resolve_model_config
        from ember.platforms import resolve_platform
        from ember.plugins import load_plugins

        load_plugins()  # config.json only: the weights load in the core chosen
        if resolve_model_config(args, resolve_platform(args.device)).runner == "pooling":
            return PoolingEngineCore(args)
    from ember.core.engine_core import EngineCore

    return EngineCore(args)


# EngineArgs a pooling model would otherwise ignore: refused by name (the KV-cache sizes are
# accepted and unused, as in vLLM: a pooling model keeps no KV cache).
_REFUSED = {
    "compile_model": ("compile_model", lambda v: bool(v), "pooling models run eagerly"),
    "attention_backend": ("attention_backend", lambda v: v is not None,
                          "pooling models use their own attention (SDPA over padded prompts)"),
    "enable_sleep_mode": ("enable_sleep_mode", lambda v: bool(v),
                          "the pooling engine core has no sleep mode"),
    "tensor_parallel_size": ("tensor_parallel_size", lambda v: v not in (None, 1),
                             "pooling models run on one device"),
    "pipeline_parallel_size": ("pipeline_parallel_size", lambda v: v not in (None, 1),
                               "pooling models run on one device"),
    "distributed_executor_backend": ("distributed_executor_backend",
                                     lambda v: v not in (None, "uni"),
                                     "pooling models run in the engine core's process"),
}


def refuse_unsupported(args: EngineArgs) -> None:
    for field, (name, bad, why) in _REFUSED.items():
        value = getattr(args, field, None)
        if bad(value):
            raise ValueError(f"{name}={value!r} is not supported for pooling models: {why}")


class PoolingEngineCore:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        start = time.perf_counter()
        from ember.model_resolution import resolve_model_config
        from ember.platforms import resolve_platform
        from ember.plugins import load_plugins
        from ember.pooling.runner import PoolingRunner

        load_plugins()
        refuse_unsupported(args)
        platform = resolve_platform(args.device)
        self.args = args
        self.model_config = resolve_model_config(args, platform)
        if self.model_config.quantization is not None:
            raise ValueError(f"quantization={self.model_config.quantization!r} is not supported "
                             "for pooling models: they run float weights (GGUF files are "
                             "dequantized)")
        self.max_model_len = self.model_config.max_model_len
        self.runner = PoolingRunner(self.model_config, platform.device(),
                                    progress=None if args.show_progress else False)
        self.token_budget = max(args.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET,
                                self.max_model_len)
        self.max_num_seqs = args.max_num_seqs
        self.priority_policy = args.scheduling_policy == "priority"
        self.waiting: deque[EngineCoreRequest] = deque()
        self.rejected: list[str] = []  # generate requests that reached this core: aborted
        self.aborted: set[str] = set()
        self.num_finished = 0
        self.ready = EngineReady(
            num_blocks=0, block_size=args.block_size, max_num_batched_tokens=self.token_budget,
            platform=platform.name, attention_backend="pooling (no KV cache)",
            async_scheduling=False, startup_seconds=time.perf_counter() - start)
        logger.info("pooling engine core ready in %.1f s: %s (%s, %s), pooling %s%s",
                    self.ready.startup_seconds, self.model_config.architecture,
                    self.model_config.dtype, platform.name,
                    self.runner.pooler_config.pooling_type,
                    ", normalized" if self.runner.pooler_config.normalize else "")

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if req.pooling_params is None:
            # The front end refuses these; one that gets here ends as "abort", and the core
            # (maybe serving other clients from its own process) keeps running.
            logger.warning("request %s has no PoolingParams: this core runs a pooling model",
                           req.request_id)
            self.rejected.append(req.request_id)
            return
        self.aborted.discard(req.request_id)
        self.waiting.append(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        waiting = {r.request_id for r in self.waiting}
        self.aborted.update(i for i in request_ids if i in waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.rejected)

    # ---- stepping ----------------------------------------------------------------------
    def schedule(self) -> list[EngineCoreRequest]:
        """Waiting requests, first come first served (under scheduling_policy="priority": lower
        priority first, then arrival), up to the token budget and max_num_seqs."""
        if self.priority_policy and len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time)))
        batch: list[EngineCoreRequest] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            req = self.waiting[0]
            if req.request_id in self.aborted:
                self.waiting.popleft()
                self.aborted.discard(req.request_id)
                continue
            n = len(req.prompt_token_ids)
            if batch and tokens + n > self.token_budget:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        return batch

    def step(self) -> EngineCoreOutputs:
        rejected = [EngineCoreOutput(r, finish_reason="abort") for r in self.rejected]
        self.rejected.clear()
        batch = self.schedule()
        if not batch:
            return EngineCoreOutputs(rejected, timestamp=time.time())
        now = time.time()
        vectors = self.runner.run([r.prompt_token_ids for r in batch],
                                  [r.pooling_params for r in batch])  # type: ignore[misc]
        self.num_finished += len(batch)
        outputs = [EngineCoreOutput(r.request_id, finish_reason="stop", first_scheduled_time=now,
                                    num_cached_tokens=0, pooled=v.numpy().tobytes())
                   for r, v in zip(batch, vectors)]
        return EngineCoreOutputs(rejected + outputs, time.time())

    # ---- introspection -----------------------------------------------------------------
    def scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_waiting=len(self.waiting),
                              num_unfinished_requests=len(self.waiting))

    def stats(self) -> dict[str, Any]:
        import msgspec

        return msgspec.structs.asdict(self.scheduler_stats())

    def idle_report(self) -> dict[str, int]:
        return {"has_work": int(self.has_work()), "num_free_blocks": 0, "num_total_blocks": 0,
                "requests_holding_blocks": 0}

    def get_ready(self) -> EngineReady:
        return self.ready

    def pooler_info(self) -> dict[str, Any]:
        """What the front end checks requests against (a utility call from another process)."""
        cfg = self.runner.pooler_config
        return {"pooling_type": cfg.pooling_type, "normalize": cfg.normalize,
                "matryoshka": cfg.matryoshka, "num_labels": self.runner.num_labels}

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is cached

    def shutdown(self) -> None:
        pass
