"""LLM: the offline entry point (vLLM's `LLM.generate` / `LLM.chat`).

Pooling models (`runner="pooling"`, or "auto" for encoder-only and classifier architectures) use
`embed`, `classify`, `score` and `encode` instead (ember.pooling.api).

`use_tqdm` is vLLM's: True for a tqdm bar, False for none, or a callable used as the bar's factory
(`use_tqdm(total=..., desc=...)`). `priority` (one per prompt) needs scheduling_policy="priority".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ember.config import EngineArgs
from ember.inputs import PromptType
from ember.outputs import RequestOutput
from ember.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ember.beam_search import BeamSearchOutput, BeamSearchParams


class LLM:
    """Generate from a batch of prompts with continuous batching; `LLM()` runs the default model."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        from ember.engine.llm_engine import LLMEngine

        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    @property
    def platform(self) -> str:
        """The name of the platform the engine runs on (e.g. "cpu", "cuda")."""
        return self.llm_engine.platform_name

    @property
    def attention_backend(self) -> str:
        """The name of the attention backend the engine chose (`ember plugins --explain` says why)."""
        return self.llm_engine.attention_backend_name

    # ---- engine control (vLLM's names; ember.engine.engine_control) ----------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses without SamplingParams: the model's generation_config.json
        values (generation_config="auto", vLLM's default) or SamplingParams() ("vllm")."""
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Level 1: drop the KV cache, weights to host memory; level 2: drop the weights too."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker (a callable gets the worker first); one result each."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """`func(model)` on every worker; one result each."""
        return self.llm_engine.apply_model(func)

    def get_metrics(self) -> list:
        """The engine's counters, gauges and histograms (needs disable_log_stats=False)."""
        return self.llm_engine.get_metrics()

    def shutdown(self) -> None:
        """Stop the engine core (and its process, if it has one); the LLM is unusable after."""
        self.llm_engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:  # the model's generation config, as vLLM's
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts: "
                    "give one, or one per prompt"
                )
        if priority is None:
            priority = [0] * len(prompts)
        elif len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts: "
                             "give one per prompt")
        # Offline callers read only final results: skip building per-step outputs.
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params_list}
        params_list = [final[id(p)] for p in params_list]
        ids = []
        try:
            for prompt, params, prio in zip(prompts, params_list, priority):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params, priority=prio)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)  # a bad prompt must not leave the others queued
            raise
        return self._run_engine(ids, use_tqdm)

    # ---- pooling models (ember.pooling.api) ---------------------------------------------
    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: Any = None,
              truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable[..., Any] = True) -> list[Any]:
        """One EmbeddingRequestOutput per prompt (`.outputs.embedding`)."""
        from ember.pooling.api import embed

        return embed(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: Any = None,
                 truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool | Callable[..., Any] = True) -> list[Any]:
        """One ClassificationRequestOutput per prompt (`.outputs.probs`)."""
        from ember.pooling.api import classify

        return classify(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None, use_tqdm: bool | Callable[..., Any] = True,
              pooling_params: Any = None) -> list[Any]:
        """One ScoringRequestOutput per pair (`.outputs.score`); one text_1 pairs with all."""
        from ember.pooling.api import score

        return score(self, text_1, text_2, truncate_prompt_tokens, use_tqdm, pooling_params)

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: Any = None,
               truncate_prompt_tokens: int | None = None,
               use_tqdm: bool | Callable[..., Any] = True) -> list[Any]:
        """One PoolingRequestOutput per prompt (`.outputs.data`, a tensor)."""
        from ember.pooling.api import encode

        return encode(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: Any = None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (ember.beam_search): one BeamSearchOutput per prompt, its
        `sequences` (tokens, text, cum_logprob) best first. Each step all live beams of all
        prompts (at most concurrency_limit prompts at a time) go to the engine together."""
        from ember.beam_search import beam_search_offline

        return beam_search_offline(self, prompts, params, use_tqdm, concurrency_limit,
                                   lora_request)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.

        Content may be a string or OpenAI text parts; `tools` and `chat_template_kwargs` reach
        the template (vLLM's arguments and rules, see ember.entrypoints.chat_utils)."""
        from ember.entrypoints.chat_utils import render_chat

        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported: ember serves no multimodal "
                             "models yet")
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was set)")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = render_chat(
                tokenizer, conversation, chat_template=chat_template,
                chat_template_content_format=chat_template_content_format,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            # The template wrote the special tokens (bos...) itself.
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        from ember import envs

        engine = self.llm_engine
        bar = None
        if callable(use_tqdm):  # the caller's own bar factory: asked for, so always used
            bar = use_tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        elif use_tqdm and not envs.disable_progress_bars():
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        finished: dict[str, RequestOutput] = {}
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        if bar is not None:
                            generated += sum(len(o.token_ids) for o in output.outputs)
                            bar.update(1)
                            _show_speed(bar, generated)
        except BaseException:
            engine.abort_request(ids)  # Ctrl-C or a bug: free every block before re-raising
            raise
        finally:
            if bar is not None and hasattr(bar, "close"):
                bar.close()
        return [finished[i] for i in ids if i in finished]


def _show_speed(bar: Any, generated: int) -> None:
    """Output tokens/s on the bar, when it is tqdm-like enough (a custom factory may not be)."""
    elapsed = (getattr(bar, "format_dict", None) or {}).get("elapsed")
    set_postfix = getattr(bar, "set_postfix_str", None)
    if elapsed is not None and set_postfix is not None:
        set_postfix(f"output {generated / (elapsed or 1e-9):.1f} tok/s")
