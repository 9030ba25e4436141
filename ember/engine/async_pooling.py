"""AsyncLLM's pooling requests: `encode` (vLLM's name) and `pool_many`, over the same engine-core
process, client and messages as generation.

A pooling request is one EngineCoreRequest carrying PoolingParams; the core (a PoolingEngineCore,
chosen when the engine starts) answers with one finished EngineCoreOutput whose `pooled` field
holds the float32 vector as bytes (typed msgspec messages, nothing pickled). Each request waits on
an asyncio future of its caller's loop, settled by the output thread; the generate path never
looks at this table (AsyncLLM checks one flag per message, set once from the model's runner).
A caller that leaves (cancellation, a client disconnect) aborts what it still waits for; a core
that dies fails every waiting request with EngineDeadError.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ember.core.messages import EngineCoreOutput, EngineCoreRequest
from ember.engine.errors import EngineDeadError
from ember.pooling.inputs import tokenize_prompts, verify_params
from ember.pooling.outputs import PoolingOutput, PoolingRequestOutput
from ember.pooling.params import PoolingParams
from ember.sampling_params import SamplingParams

# (caller's loop, its future, prompt length, arrival time)
_Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Future, int, float]


class AsyncPoolingMixin:
    """Mixed into AsyncLLM (which provides model_config, processor, client, _lock, _dead,
    _streams, _log_stats and client_index)."""

    _pooling: dict[str, _Waiter]
    _pooling_mode: bool

    def _init_pooling(self) -> None:
        self._pooling = {}
        self._pooling_mode = self.model_config.runner == "pooling"  # type: ignore[attr-defined]

    def _check_pooling_runner(self) -> None:
        cfg = self.model_config  # type: ignore[attr-defined]
        if cfg.runner != "pooling":
            raise ValueError(f"{cfg.architecture} runs with runner='{cfg.runner}': it generates "
                             "text and gives no embeddings or scores; serve a pooling model "
                             "(runner='pooling')")

    async def encode(self, prompt: Any, pooling_params: PoolingParams | None, request_id: str,
                     lora_request: Any = None, priority: int = 0,
                     truncate_prompt_tokens: int | None = None,
                     ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's AsyncLLM.encode: yields the request's one, finished PoolingRequestOutput
        (`.outputs.data`, a float32 tensor). The params' task defaults to "encode"."""
        if lora_request is not None:
            raise ValueError("lora_request is not supported: ember serves no LoRA adapters")
        params = pooling_params if pooling_params is not None else PoolingParams()
        (out,) = await self.pool_many([prompt], [params], [request_id], priority,
                                      truncate_prompt_tokens)
        yield out

    async def pool_many(self, prompts: list[Any], params: list[PoolingParams],
                        request_ids: list[str], priority: int = 0,
                        truncate_prompt_tokens: int | None = None,
                        arrival_time: float | None = None) -> list[PoolingRequestOutput]:
        """Pool several prompts (text, TextPrompt or TokensPrompt) sent to the core in one
        message; the outputs come back in order. ValueErrors name what is wrong."""
        self._check_pooling_runner()
        cfg = self.model_config  # type: ignore[attr-defined]
        processor = self.processor  # type: ignore[attr-defined]
        processor.check_priority(priority)
        if not (len(prompts) == len(params) == len(request_ids)):
            raise ValueError("give one PoolingParams and one request id per prompt")
        plist = [verify_params(p, p.task or "encode", cfg, truncate_prompt_tokens)
                 for p in params]
        ids = tokenize_prompts(processor.tokenizer, list(prompts), plist, cfg.max_model_len,
                               cfg.vocab_size, check_keys=processor.check_prompt_keys)
        arrival = arrival_time or time.time()
        loop = asyncio.get_running_loop()
        futures = []
        with self._lock:  # type: ignore[attr-defined]
            if self._dead is not None:  # type: ignore[attr-defined]
                raise self._dead  # type: ignore[attr-defined]
            taken = [r for r in request_ids if r in self._pooling
                     or r in self._streams]  # type: ignore[attr-defined]
            if taken or len(set(request_ids)) != len(request_ids):
                raise ValueError(f"request id {(taken or request_ids)[0]!r} is already in use")
            for rid, toks in zip(request_ids, ids):
                future = loop.create_future()
                self._pooling[rid] = (loop, future, len(toks), arrival)
                futures.append(future)
        sp = SamplingParams(max_tokens=1)  # the core reads only pooling_params
        reqs = [EngineCoreRequest(rid, toks, sp, [], arrival, client_index=self.client_index,
                                  priority=priority, pooling_params=p)
                for rid, toks, p in zip(request_ids, ids, plist)]
        try:
            self.client.add_requests(reqs)  # type: ignore[attr-defined]
            results = await asyncio.gather(*futures)
        except BaseException:
            self._abort_pooled(request_ids)
            raise
        import torch

        return [PoolingRequestOutput(rid, PoolingOutput(torch.frombuffer(bytearray(data),
                                                                         dtype=torch.float32)),
                                     toks)
                for rid, data, toks in zip(request_ids, results, ids)]

    def _abort_pooled(self, request_ids: list[str], cancel: bool = False) -> None:
        """Forget these requests and abort those still in the core; `cancel`: their waiting
        callers get CancelledError (AsyncLLM.abort)."""
        with self._lock:  # type: ignore[attr-defined]
            waiters = {r: self._pooling.pop(r) for r in request_ids if r in self._pooling}
        if cancel:
            for loop, future, _, _ in waiters.values():
                try:
                    loop.call_soon_threadsafe(future.cancel)
                except RuntimeError:
                    pass
        if waiters and self._dead is None:  # type: ignore[attr-defined]
            try:
                self.client.abort_requests(list(waiters))  # type: ignore[attr-defined]
            except EngineDeadError:
                pass

    # ---- the output thread -------------------------------------------------------------
    def _deliver_pooled(self, outputs: list[EngineCoreOutput]) -> None:
        from ember.engine.async_llm import FinishedRequestStats, IterationStats

        stats = IterationStats()
        now = time.time()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, Any, str]]] = {}
        with self._lock:  # type: ignore[attr-defined]
            for out in outputs:
                if out.finish_reason is None:
                    continue
                waiter = self._pooling.pop(out.request_id, None)
                if waiter is None:  # its caller left
                    continue
                loop, future, n, arrival = waiter
                stats.num_prompt_tokens += n
                stats.finished.append(FinishedRequestStats(out.request_id, out.finish_reason,
                                                           now - arrival, n, 0))
                by_loop.setdefault(loop, []).append((future, out.pooled, out.finish_reason))
        self._log_stats(stats)  # type: ignore[attr-defined]  # before the callers see results
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, batch)
            except RuntimeError:  # the caller's loop is closed: nobody waits
                pass

    def _fail_pooled(self, error: BaseException) -> None:
        with self._lock:  # type: ignore[attr-defined]
            waiters, self._pooling = list(self._pooling.values()), {}
        for loop, future, _, _ in waiters:
            try:
                loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(error))
            except RuntimeError:
                pass


def _settle(batch: list[tuple[asyncio.Future, Any, str]]) -> None:
    for future, data, reason in batch:
        if future.done():
            continue
        if data is None:
            future.set_exception(RuntimeError(f"the engine core ended the pooling request "
                                              f"without a result (finish reason {reason!r})"))
        else:
            future.set_result(data)
