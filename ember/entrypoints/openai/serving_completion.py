"""/v1/completions: prompts (text, token ids, or lists of either) -> choices, streamed or not.

Choice `i * n + j` is sample j of prompt i (OpenAI's numbering). Streams send, per choice, the new
suffix of the engine's cumulative, append-only text, so concatenated deltas equal the final text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ember.engine.errors import EngineDeadError
from ember.entrypoints.openai.errors import OpenAIError, error_body
from ember.entrypoints.openai.logprobs import (
    AS_TOKEN_IDS,
    append_completion_logprobs,
    prompt_logprobs_json,
)
from ember.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
    random_id,
)
from ember.entrypoints.openai.serving_common import ServingContext
from ember.entrypoints.openai.serving_params import (
    beam_search_params,
    check_priority,
    check_stream_options,
    continuous_usage,
    engine_prompt,
    sampling_params,
    truncate_prompt,
    validate_structured_outputs,
)
from ember.entrypoints.openai.serving_streams import (
    SSE_DONE,
    EventStreamResponse,
    merge_generators,
    sse,
    until_disconnect,
)
from ember.outputs import CompletionOutput, RequestOutput

MAX_SEQUENCES = 1024  # prompts x n in one request


async def _prompts(req: CompletionRequest, ctx: ServingContext
                   ) -> list[tuple[str | None, list[int]]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]
    else:
        items = list(prompt)
    if not items:
        raise OpenAIError("prompt must not be empty", 400, param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = await ctx.encode(item, req.add_special_tokens)
            text: str | None = item
        else:
            ids, text = list(item), None
        ids = truncate_prompt(ctx.check_tokens(ids), req, ctx)
        out.append((text, ids))
    return out


async def create_completion(req: CompletionRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.check_model(req.model)
    await ctx.engine.check_health()  # a dead engine is a 503, even for streams
    if req.suffix:
        raise OpenAIError("suffix is not supported", 400, param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError("best_of must equal n (beam-style best_of is not supported)", 400,
                          param="best_of")
    include_usage = check_stream_options(req)
    check_priority(req, ctx)
    prompts = await _prompts(req, ctx)
    if len(prompts) * req.n > MAX_SEQUENCES:
        raise OpenAIError(f"at most {MAX_SEQUENCES} sequences (prompts x n) per request", 400,
                          param="n")
    echo_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    lengths = [ctx.check_length(len(ids), req.max_tokens, "prompt") for _, ids in prompts]
    request_id = req.request_id or random_id("cmpl")
    engine_id = random_id("cmpl-engine")  # ours alone; the client's id only names the response
    arrival = time.time()
    if req.use_beam_search:
        gens = [ctx.engine.beam_search(engine_prompt(ids, text, req), f"{engine_id}-{i}",
                                       beam_search_params(req, max_tokens))
                for i, ((text, ids), max_tokens) in enumerate(zip(prompts, lengths, strict=True))]
    else:
        params = [sampling_params(req, ctx, max_tokens, req.logprobs, echo_logprobs)
                  for max_tokens in lengths]
        await validate_structured_outputs(params[0], ctx)  # the same constraint for each
        gens = [ctx.engine.generate(engine_prompt(ids, text, req), sp, f"{engine_id}-{i}",
                                    arrival, priority=req.priority)
                for i, ((text, ids), sp) in enumerate(zip(prompts, params, strict=True))]
    if req.stream:
        return EventStreamResponse(
            _stream(req, ctx, model, request_id, prompts, gens, include_usage), ctx, request_id
        )
    response = await until_disconnect(raw, _full(req, ctx, model, request_id, prompts, gens),
                                      ctx, request_id)
    if response is None:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(response.model_dump())


def _echo_text(ctx: ServingContext, text: str | None, ids: list[int]) -> str:
    return text if text is not None else ctx.decode(ids)


def _decoder(req: CompletionRequest, ctx: ServingContext):
    return AS_TOKEN_IDS if req.return_tokens_as_token_ids else ctx.decode


def _echo_logprobs(req, ctx, lp: CompletionLogProbs, ids: list[int], out: RequestOutput) -> int:
    entries = out.prompt_logprobs or [None] * len(ids)
    return append_completion_logprobs(lp, ids, entries, 0, _decoder(req, ctx))


async def _full(req, ctx: ServingContext, model, request_id, prompts, gens) -> CompletionResponse:
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in merge_generators(gens):
            if out.finished:
                finals[i] = out
    except ValueError as exc:
        raise OpenAIError(str(exc), 400) from exc
    choices, usage = [], UsageInfo()
    cached = 0
    for i, (text, ids) in enumerate(prompts):
        out = finals[i]
        usage.prompt_tokens += len(ids)
        cached += max(out.num_cached_tokens, 0)
        for c in out.outputs:
            usage.completion_tokens += len(c.token_ids)
            body = (_echo_text(ctx, text, ids) if req.echo else "") + c.text
            lp = None
            if req.logprobs is not None:
                lp = CompletionLogProbs()
                offset = _echo_logprobs(req, ctx, lp, ids, out) if req.echo else 0
                append_completion_logprobs(lp, c.token_ids, c.logprobs or [], offset,
                                           _decoder(req, ctx))
            choices.append(CompletionChoice(
                index=i * req.n + c.index, text=body, logprobs=lp, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
                if req.prompt_logprobs is not None else None))
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
    choices.sort(key=lambda c: c.index)
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)


class _ChoiceState:
    __slots__ = ("text", "tokens", "offset", "finished", "echoed")

    def __init__(self) -> None:
        self.text = self.tokens = self.offset = 0
        self.finished = self.echoed = False


async def _stream(
    req, ctx: ServingContext, model, request_id, prompts, gens, include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())
    states = [_ChoiceState() for _ in range(len(prompts) * req.n)]
    usage = UsageInfo(prompt_tokens=sum(len(ids) for _, ids in prompts))
    continuous = continuous_usage(req)
    decode = _decoder(req, ctx)
    cached: dict[int, int] = {}  # prompt index -> its cached prompt tokens

    def chunk(index: int, text: str, lp, c: CompletionOutput, prompt_lps=None) -> str:
        choice = CompletionChoice(index=index, text=text, logprobs=lp,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                  prompt_logprobs=prompt_lps)
        so_far = None
        if continuous:
            generated = sum(s.tokens for s in states)
            so_far = UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=generated,
                               total_tokens=usage.prompt_tokens + generated)
        return sse(CompletionResponse(id=request_id, created=created, model=model,
                                      choices=[choice], usage=so_far))

    try:
        async for i, out in merge_generators(gens):
            text, ids = prompts[i]
            for c in out.outputs:
                state = states[i * req.n + c.index]
                if state.finished or not (c.token_ids or c.finish_reason):
                    continue  # (outputs of a chunked prefill carry only partial prompt logprobs)
                prefix, lp = "", None
                if req.logprobs is not None:
                    lp = CompletionLogProbs()
                prompt_lps = None
                if not state.echoed and req.prompt_logprobs is not None:
                    prompt_lps = prompt_logprobs_json(out.prompt_logprobs)
                if req.echo and not state.echoed:
                    prefix = _echo_text(ctx, text, ids)
                    if lp is not None:
                        state.offset = _echo_logprobs(req, ctx, lp, ids, out)
                delta = c.text[state.text:]
                new_ids = c.token_ids[state.tokens:]
                if not (prefix or delta or c.finish_reason or (lp is not None and new_ids)):
                    continue  # nothing visible yet (e.g. text held back for a stop string)
                if lp is not None:
                    entries = (c.logprobs or [])[state.tokens:len(c.token_ids)]
                    state.offset = append_completion_logprobs(
                        lp, new_ids, entries, state.offset, decode)
                state.text, state.tokens = len(c.text), len(c.token_ids)
                state.echoed, state.finished = True, c.finish_reason is not None
                if state.finished:
                    usage.completion_tokens += len(c.token_ids)
                cached[i] = max(out.num_cached_tokens, 0)
                yield chunk(i * req.n + c.index, prefix + delta, lp, c, prompt_lps)
        if include_usage:
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=sum(cached.values()))
            yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                         usage=usage))
    except (EngineDeadError, ValueError) as exc:
        status = 503 if isinstance(exc, EngineDeadError) else 400
        yield sse(error_body(OpenAIError(str(exc), status)))
    yield SSE_DONE
