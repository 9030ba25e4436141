"""Request -> SamplingParams for the completion and chat handlers: the sampling fields with the
model's generation_config defaults, token-id and logit-bias checks, priority, prompt truncation,
beam search and stream options; each refusal is a 400 naming its field.
"""

from __future__ import annotations

from typing import Any

from ember.entrypoints.openai.errors import OpenAIError
from ember.entrypoints.openai.protocol import SamplingExtras
from ember.entrypoints.openai.serving_common import ServingContext
from ember.entrypoints.openai.serving_structured import structured_outputs_from
from ember.sampling_params import SamplingParams

# Sampling fields the model's generation_config.json may give defaults for (vLLM's
# generation_config="auto"): used when the request leaves them out.
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(
    req: SamplingExtras,
    ctx: ServingContext,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams of a request; its ValueErrors become 400s naming the field."""
    check_token_ids(req.stop_token_ids, ctx, "stop_token_ids")
    check_token_ids(req.allowed_token_ids, ctx, "allowed_token_ids")
    structured = structured_outputs_from(req, ctx.structured_outputs_config.backend)
    if req.length_penalty != 1.0:
        raise OpenAIError("length_penalty applies only with use_beam_search", 400,
                          param="length_penalty")
    defaults = ctx.default_sampling
    chosen = {name: getattr(req, name) for name in _MODEL_DEFAULTS}
    for name, value in chosen.items():
        if value is None and name in defaults:
            chosen[name] = defaults[name]
    if req.prompt_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs) if (
            req.prompt_logprobs >= 0) else -1
    kwargs: dict[str, Any] = dict(
        n=req.n,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if chosen["repetition_penalty"] is None else (
            chosen["repetition_penalty"]),
        temperature=1.0 if chosen["temperature"] is None else chosen["temperature"],
        top_p=1.0 if chosen["top_p"] is None else chosen["top_p"],
        top_k=chosen["top_k"] or 0,
        min_p=chosen["min_p"] or 0.0,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logit_bias=_logit_bias(req.logit_bias, ctx),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        extra_args=req.vllm_xargs,
        structured_outputs=structured,
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
        param = {"extra_args": "vllm_xargs"}.get(param, param)
        raise OpenAIError(str(exc), 400, param=param if param.isidentifier() else None) from exc


def check_token_ids(ids: list[int] | None, ctx: ServingContext, param: str) -> None:
    if ids is not None and any(not 0 <= t < ctx.vocab_size for t in ids):
        raise OpenAIError(f"{param} must be token ids in [0, {ctx.vocab_size})", 400,
                          param=param)


def _logit_bias(bias: dict[str, float] | None, ctx: ServingContext) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias in [-100, 100]) as SamplingParams takes it."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < ctx.vocab_size:
            raise OpenAIError(f"logit_bias keys must be token ids in [0, {ctx.vocab_size}), "
                              f"got {key[:32]!r}", 400, param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise OpenAIError(f"logit_bias values must be in [-100, 100], got {value}", 400,
                              param="logit_bias")
        out[int(key)] = value
    return out


async def validate_structured_outputs(params: SamplingParams, ctx: ServingContext) -> None:
    """400 now for a constraint the grammar backend cannot compile, rather than an error event
    in a stream that already started (compiling runs in the tokenizer thread; the engine reuses
    the result)."""
    if params.structured_outputs is None:
        return
    from ember.structured_output.validation import validate_structured_outputs as validate

    try:
        await ctx._in_tokenizer_thread(validate, params, ctx.structured_outputs_config,
                                       ctx._worker_tokenizer())
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="structured_outputs") from None


def check_priority(req: SamplingExtras, ctx: ServingContext) -> None:
    try:
        ctx.engine.processor.check_priority(req.priority)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="priority") from None


def truncate_prompt(ids: list[int], req: SamplingExtras, ctx: ServingContext) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: the context length)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == 0:
        raise OpenAIError("truncate_prompt_tokens must be >= 1 or -1", 400,
                          param="truncate_prompt_tokens")
    keep = ctx.max_model_len if k == -1 else k
    if keep > ctx.max_model_len:
        raise OpenAIError(f"truncate_prompt_tokens={k} exceeds the maximum context length "
                          f"{ctx.max_model_len}", 400, param="truncate_prompt_tokens")
    return ids[-keep:]


def engine_prompt(ids: list[int], text: str | None, req: SamplingExtras) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if text is not None:
        prompt["prompt"] = text
    if req.cache_salt is not None:
        prompt["cache_salt"] = req.cache_salt
    return prompt


def beam_search_params(req: SamplingExtras, max_tokens: int):
    """vLLM's use_beam_search: n beams (best_of on completions), scored with length_penalty."""
    from ember.beam_search import BeamSearchParams

    for name in ("logprobs", "prompt_logprobs", "stop", "logit_bias", "allowed_token_ids",
                 "bad_words", "vllm_xargs"):
        value = getattr(req, name, None)
        if value not in (None, False, [], {}):
            raise OpenAIError(f"{name} cannot be combined with use_beam_search", 400,
                              param=name)
    try:
        return BeamSearchParams(
            beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="use_beam_search") from None


def check_stream_options(req: SamplingExtras) -> bool:
    """Whether to send a usage chunk; stream_options without stream is a 400 (as OpenAI)."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true", 400,
                          param="stream_options")
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: SamplingExtras) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage so far on every chunk."""
    return bool(req.stream and req.stream_options and req.stream_options.continuous_usage_stats)


