"""LLM: the offline entry point (vLLM's `LLM.generate` / `LLM.chat`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from ember.config import EngineArgs
from ember.inputs import PromptType
from ember.outputs import RequestOutput
from ember.sampling_params import RequestOutputKind, SamplingParams


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

    def shutdown(self) -> None:
        """Stop the engine core (and its process, if it has one); the LLM is unusable after."""
        self.llm_engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts: "
                    "give one, or one per prompt"
                )
        # Offline callers read only final results: skip building per-step outputs.
        final = {id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params_list}
        params_list = [final[id(p)] for p in params_list]
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)  # a bad prompt must not leave the others queued
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init=True was set)")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tokenize=True,
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from ember import envs

        engine = self.llm_engine
        bar = None
        if use_tqdm and not envs.disable_progress_bars():
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
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(f"output {generated / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request(ids)  # Ctrl-C or a bug: free every block before re-raising
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[i] for i in ids if i in finished]
