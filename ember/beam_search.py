"""Beam search on top of the engine: vLLM's `LLM.beam_search` and `EngineClient.beam_search`.

Nothing in the engine core knows about beams. Each step every live beam is one engine request
for one token with `logprobs=2*beam_width`; the prefix cache keeps the prompt's full blocks (and
those the beams share), so a step recomputes little more than each beam's last partial block.
Every candidate `beam + [token]` gets `cum_logprob + logprob`; a candidate ending in an eos id
(unless ignore_eos) is set aside as finished, the best `beam_width` others live on. After
`max_tokens` steps (or when a beam would pass max_model_len) the live beams join the finished
ones and the best `beam_width` of all, by vLLM's `get_beam_search_score`, are the result.

Scores follow vLLM: `cum_logprob / len ** length_penalty` where `len` counts the prompt and the
generated tokens less a final eos. HF transformers (5.x) divides by the number of generated
tokens, eos included; both rank equal-length beams alike, and with `length_penalty=0` they are the
same number. docs/architecture.md ("Beam search") lists where the two searches differ.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ember.outputs import CompletionOutput, Logprob, RequestOutput
from ember.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ember.engine.async_llm import AsyncLLM
    from ember.engine.processor import InputProcessor
    from ember.entrypoints.llm import LLM
    from ember.inputs import PromptType


@dataclass
class BeamSearchParams:
    """vLLM's `vllm.sampling_params.BeamSearchParams`; a bad value is a ValueError naming it.

    temperature > 0 adds the engine's sampled token to each beam's candidates (vLLM's effect);
    include_stop_str_in_output keeps the final eos in the output text (and, on the server, in
    the returned token ids)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None  # refused: ember has no structured-output engine

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"BeamSearchParams.{name} {rule}, got {getattr(self, name)!r}")

        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "must be an integer >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 <= t < math.inf:
            raise bad("temperature", "must be a finite number >= 0")
        lp = self.length_penalty
        if not isinstance(lp, (int, float)) or isinstance(lp, bool) or not math.isfinite(lp):
            raise bad("length_penalty", "must be a finite number")
        if self.structured_outputs is not None:
            raise bad("structured_outputs", "is not supported with beam search in ember")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's then the generated ones (a final eos included, as
    vLLM's); `logprobs` holds each generated position's candidates (token id -> Logprob)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None  # prompt and generated text; None without a tokenizer
    finish_reason: str | None = None  # "stop" (eos) or "length"
    stop_reason: int | None = None  # the eos id that ended it


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: Sequence[int], cumulative_logprob: float,
                          eos_token_id: int | Collection[int] | None,
                          length_penalty: float = 1.0) -> float:
    """vLLM's score: cumulative logprob over (prompt + generated tokens, less a final eos)
    to the power length_penalty."""
    eos = (eos_token_id,) if isinstance(eos_token_id, int) else eos_token_id or ()
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (seq_len ** length_penalty)


class BeamSearchInstance:
    """The search of one prompt: its live beams and the finished ones."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_ids: Collection[int],
                 max_model_len: int, cache_salt: str | None = None) -> None:
        self.prompt_len = len(prompt_ids)
        self.params = params
        # With ignore_eos an eos is an ordinary token, in the score's length too (vLLM still
        # leaves a final eos out of the length there).
        self.eos_ids = frozenset(() if params.ignore_eos else eos_ids)
        self.cache_salt = cache_salt
        self.beams = [BeamSearchSequence(list(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []
        # A beam of L tokens can ask for one more while L < max_model_len (the engine's rule).
        self.steps_left = min(params.max_tokens, max_model_len - self.prompt_len)

    def score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos_ids,
                                     self.params.length_penalty)

    def step_prompts(self) -> list[dict[str, Any]]:
        """One TokensPrompt per live beam; empty once the search is over."""
        if self.steps_left <= 0:
            return []
        salt = {"cache_salt": self.cache_salt} if self.cache_salt is not None else {}
        return [{"prompt_token_ids": beam.tokens, **salt} for beam in self.beams]

    def advance(self, results: Sequence[RequestOutput | None]) -> None:
        """Extend every live beam by its candidates (results in step_prompts' order)."""
        candidates = []
        for beam, result in zip(self.beams, results):
            step = result.outputs[0].logprobs if result is not None and result.outputs else None
            if not step:  # no logprobs: the engine could not extend it (vLLM drops it too)
                continue
            for token, lp in step[0].items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [step[0]],
                                         beam.cum_logprob + lp.logprob)
                if token in self.eos_ids:
                    new.finish_reason, new.stop_reason = "stop", token
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self.score, reverse=True)  # stable: ties keep the engine's order
        self.beams = candidates[: self.params.beam_width]
        self.steps_left -= 1

    def result(self, tokenizer) -> BeamSearchOutput:
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)
        best = best[: self.params.beam_width]
        if tokenizer is not None:
            for beam in best:
                beam.text = tokenizer.decode(self.visible_tokens(beam.tokens, beam))
        return BeamSearchOutput(best)

    def visible_tokens(self, tokens: list[int], beam: BeamSearchSequence) -> list[int]:
        """Tokens as output: the final eos only with include_stop_str_in_output."""
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            return tokens[:-1]
        return tokens


def step_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """What each beam asks the engine for at each step."""
    return SamplingParams(logprobs=2 * params.beam_width, max_tokens=1,
                          temperature=params.temperature, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def check_request(params: BeamSearchParams, max_logprobs: int, lora_request: Any = None) -> None:
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
    if lora_request is not None:
        raise ValueError("lora_request is not supported: ember has no LoRA adapters")
    if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
        raise ValueError(
            f"BeamSearchParams.beam_width={params.beam_width} needs {2 * params.beam_width} "
            f"logprobs per step, more than the engine's max_logprobs={max_logprobs}; raise "
            "max_logprobs or use a beam_width of at most max_logprobs // 2")


def new_instance(processor: InputProcessor, prompt: PromptType, params: BeamSearchParams,
                 max_model_len: int) -> tuple[str | None, BeamSearchInstance]:
    """Tokenize and validate one prompt (ValueError before anything reaches the engine)."""
    text, ids = processor.prompt_ids(prompt)
    processor.validate_prompt(ids)
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    return text, BeamSearchInstance(ids, params, processor.eos_token_ids, max_model_len, salt)


def beam_search_offline(llm: LLM, prompts: PromptType | Sequence[PromptType],
                        params: BeamSearchParams, use_tqdm: bool = False,
                        concurrency_limit: int | None = None,
                        lora_request: Any = None) -> list[BeamSearchOutput]:
    """LLM.beam_search: every live beam of every prompt (of a concurrency_limit group) goes to
    the engine in one generate call per step."""
    engine = llm.llm_engine
    check_request(params, engine.model_config.max_logprobs, lora_request)
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    instances = [new_instance(engine.processor, p, params, engine.max_model_len)[1]
                 for p in prompts]
    if concurrency_limit is not None and (not isinstance(concurrency_limit, int)
                                          or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}")
    group = concurrency_limit or max(1, len(instances))
    step_params = step_sampling_params(params)
    bar = None
    from ember import envs

    if use_tqdm and not envs.disable_progress_bars():
        from tqdm.auto import tqdm

        bar = tqdm(total=params.max_tokens * -(-len(instances) // group), desc="Beam search",
                   unit="step")
    try:
        for start in range(0, len(instances), group):
            batch = instances[start:start + group]
            while True:
                step_prompts = [inst.step_prompts() for inst in batch]
                flat = [p for ps in step_prompts for p in ps]
                if not flat:
                    break
                results = llm.generate(flat, step_params, use_tqdm=False)
                pos = 0
                for inst, ps in zip(batch, step_prompts):
                    if ps:
                        inst.advance(results[pos:pos + len(ps)])
                        pos += len(ps)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    tokenizer = llm.get_tokenizer()
    return [inst.result(tokenizer) for inst in instances]


def to_request_output(request_id: str, prompt_text: str | None, instance: BeamSearchInstance,
                      output: BeamSearchOutput, tokenizer) -> RequestOutput:
    """The server's shape: one finished RequestOutput, a CompletionOutput per beam (best first)
    with the generated tokens only (vLLM's EngineClient.beam_search)."""
    outs = []
    for i, beam in enumerate(output.sequences):
        token_ids = instance.visible_tokens(beam.tokens[instance.prompt_len:], beam)
        text = tokenizer.decode(token_ids) if tokenizer is not None else ""
        outs.append(CompletionOutput(
            index=i, text=text, token_ids=token_ids, cumulative_logprob=beam.cum_logprob,
            logprobs=beam.logprobs[: len(token_ids)], finish_reason=beam.finish_reason,
            stop_reason=beam.stop_reason))
    prompt_ids = output.sequences[0].tokens[: instance.prompt_len] if output.sequences else []
    return RequestOutput(request_id, prompt_text, prompt_ids, outs, finished=True)


async def beam_search_async(engine: AsyncLLM, prompt: PromptType, request_id: str,
                            params: BeamSearchParams,
                            lora_request: Any = None) -> AsyncIterator[RequestOutput]:
    """AsyncLLM.beam_search: one prompt; each step its live beams are submitted together (the
    core batches them, and with other callers' requests). Yields one final RequestOutput.
    Stopping the iteration (or cancelling the task) aborts the step's requests."""
    check_request(params, engine.model_config.max_logprobs, lora_request)
    # The processor's tokenizer is the callers' copy (the output thread has its own).
    tokenizer = engine.processor.tokenizer
    text, instance = new_instance(engine.processor, prompt, params, engine.max_model_len)
    step_params = step_sampling_params(params)
    step = 0
    while prompts := instance.step_prompts():
        tasks = [asyncio.ensure_future(_final(engine, p, f"{request_id}-beam{step}-{i}",
                                              step_params))
                 for i, p in enumerate(prompts)]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            # A failed beam (or our caller leaving) ends the others: their generators abort
            # their requests; the first error is raised as itself (the server maps it).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        instance.advance(results)
        step += 1
    output = instance.result(tokenizer)
    yield to_request_output(request_id, text, instance, output, tokenizer)


async def _final(engine: AsyncLLM, prompt: dict, request_id: str,
                 params: SamplingParams) -> RequestOutput | None:
    final = None
    async for out in engine.generate(prompt, params, request_id):
        final = out
    return final
