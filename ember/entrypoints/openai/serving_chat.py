"""/v1/chat/completions: messages -> chat template -> one request with n samples.

Streams follow OpenAI: a first chunk per choice with the assistant role, then content deltas (the
new suffix of the engine's append-only text), the finish reason on the last chunk of each choice,
an optional usage chunk with no choices, then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ember.engine.errors import EngineDeadError
from ember.entrypoints.openai.chat_outputs import (
    ChoiceParser,
    needs_special_tokens,
    tool_constraint,
    tool_mode,
)
from ember.entrypoints.openai.errors import OpenAIError, error_body
from ember.entrypoints.openai.logprobs import AS_TOKEN_IDS, chat_logprobs, prompt_logprobs_json
from ember.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
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
from ember.entrypoints.openai.serving_streams import SSE_DONE, EventStreamResponse, sse, until_disconnect
from ember.outputs import RequestOutput
from ember.sampling_params import StructuredOutputsParams


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs=true", 400, param="top_logprobs")


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, ctx: ServingContext
) -> Response:
    model = ctx.check_model(req.model)
    await ctx.engine.check_health()  # a dead engine is a 503, even for streams
    _check_unsupported(req)
    include_usage = check_stream_options(req)
    check_priority(req, ctx)
    mode = tool_mode(req, ctx.parsers)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:  # vLLM hands it to the template (gpt-oss reads it)
        template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if req.tools:  # the template tells the model about them (vLLM passes them in every mode)
        template_kwargs.setdefault("tools", req.tools)
    ids = await ctx.apply_chat_template(req.messages, req.add_generation_prompt,
                                        req.continue_final_message, req.chat_template,
                                        template_kwargs, req.add_special_tokens)
    ids = truncate_prompt(ctx.check_tokens(ids, param="messages"), req, ctx)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else (
        req.max_tokens)
    max_tokens = ctx.check_length(len(ids), requested, "messages")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    request_id = req.request_id or random_id("chatcmpl")
    # The engine's id is ours alone: a client's request_id names only its response, so two
    # clients (or a chat and a completion) sending the same one never collide.
    engine_id = random_id("chat-engine")
    if req.use_beam_search:
        if mode != "none":
            raise OpenAIError("tools cannot be combined with use_beam_search", 400,
                              param="use_beam_search")
        gen = ctx.engine.beam_search(engine_prompt(ids, None, req), engine_id,
                                     beam_search_params(req, max_tokens))
    else:
        params = sampling_params(req, ctx, max_tokens, num_top)
        forced = tool_constraint(req, mode)
        if forced is not None:
            if params.structured_outputs is not None:
                raise OpenAIError(f"tool_choice {req.tool_choice!r} constrains the output "
                                  "itself: drop the other structured-output fields", 400,
                                  param="tool_choice")
            params.structured_outputs = StructuredOutputsParams(json=forced)
        if needs_special_tokens(mode, ctx.parsers):
            params.skip_special_tokens = False
        await validate_structured_outputs(params, ctx)
        gen = ctx.engine.generate(engine_prompt(ids, None, req), params, engine_id, time.time(),
                                  priority=req.priority)
    prompt_text = None
    if ctx.parsers.reasoning_parser:  # whether the template already opened the reasoning
        prompt_text = await ctx.decode_async(ids)

    def parser() -> ChoiceParser:
        return ChoiceParser(req, mode, ctx.parsers, ctx.tokenizer, prompt_text)

    if req.stream:
        return EventStreamResponse(
            _stream(req, ctx, model, request_id, gen, include_usage, parser, mode), ctx,
            request_id)
    response = await until_disconnect(raw, _full(req, ctx, model, request_id, gen, parser, mode),
                                      ctx, request_id)
    if response is None:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(response.model_dump())


def _echo_prefix(req: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's content, when it is the assistant's."""
    last = req.messages[-1]
    if req.echo and last.role == "assistant" and isinstance(last.content, str):
        return last.content
    return ""


def _finish_reason(reason: str | None, mode: str, called: bool) -> str | None:
    """vLLM's: "tool_calls" when a choice that stopped by itself called tools ("auto",
    "required"); a forced named function keeps OpenAI's "stop"."""
    if called and reason == "stop" and mode in ("auto", "required"):
        return "tool_calls"
    return reason


async def _full(req, ctx: ServingContext, model: str, request_id: str, gen, parser, mode: str):
    final: RequestOutput | None = None
    try:
        async for out in gen:
            final = out
    except ValueError as exc:
        raise OpenAIError(str(exc), 400) from exc
    assert final is not None
    choices, completion_tokens = [], 0
    for c in final.outputs:
        completion_tokens += len(c.token_ids)
        lp = None
        if req.logprobs:
            lp = chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0,
                               _decoder(req, ctx))
        reason = c.finish_reason
        choice_parser = parser()
        if choice_parser.active:
            reasoning, content, calls = choice_parser.whole(c.text)
            message = ChatResponseMessage(
                content=(_echo_prefix(req) + content) if content or _echo_prefix(req) else None,
                reasoning_content=reasoning, tool_calls=calls or [])
            reason = _finish_reason(reason, mode, bool(calls))
        else:
            message = ChatResponseMessage(content=_echo_prefix(req) + c.text)
        choices.append(ChatChoice(index=c.index, message=message, logprobs=lp,
                                  finish_reason=reason, stop_reason=c.stop_reason))
    prompt_tokens = len(final.prompt_token_ids)
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens,
                      prompt_tokens_details=PromptTokensDetails(
                          cached_tokens=max(final.num_cached_tokens, 0)))
    prompt_lps = (prompt_logprobs_json(final.prompt_logprobs)
                  if req.prompt_logprobs is not None else None)
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage,
                                  prompt_logprobs=prompt_lps)


def _decoder(req: ChatCompletionRequest, ctx: ServingContext):
    return AS_TOKEN_IDS if req.return_tokens_as_token_ids else ctx.decode


async def _stream(
    req, ctx: ServingContext, model: str, request_id: str, gen, include_usage: bool, parser,
    mode: str,
) -> AsyncIterator[str]:
    created = int(time.time())
    continuous = continuous_usage(req)
    prompt_tokens = [0]

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        if usage is None and continuous:
            generated = sum(sent_tokens)
            usage = UsageInfo(prompt_tokens=prompt_tokens[0], completion_tokens=generated,
                              total_tokens=prompt_tokens[0] + generated)
        return sse(ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=choices, usage=usage))

    decode = _decoder(req, ctx)
    parsers = [parser() for _ in range(req.n)]
    sent_text = [0] * req.n
    sent_tokens = [0] * req.n
    finished = [False] * req.n
    echo = _echo_prefix(req)
    # The role first, as OpenAI does, before any token exists.
    yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=echo))
                 for i in range(req.n)])
    final: RequestOutput | None = None
    try:
        async for out in gen:
            final = out
            prompt_tokens[0] = len(out.prompt_token_ids)
            choices = []
            for c in out.outputs:
                k = c.index
                if finished[k]:
                    continue
                delta = c.text[sent_text[k]:]
                new_ids = c.token_ids[sent_tokens[k]:]
                if not (delta or c.finish_reason or (req.logprobs and new_ids)):
                    continue  # nothing visible yet (e.g. text held back for a stop string)
                lp = None
                if req.logprobs:
                    entries = (c.logprobs or [])[sent_tokens[k]:len(c.token_ids)]
                    lp = chat_logprobs(new_ids, entries, req.top_logprobs or 0, decode)
                previous = c.text[:sent_text[k]]
                sent_text[k], sent_tokens[k] = len(c.text), len(c.token_ids)
                finished[k] = c.finish_reason is not None
                reason = c.finish_reason
                if parsers[k].active:
                    fields = parsers[k].delta(previous, c.text, delta)
                    if finished[k]:
                        for key, value in parsers[k].finish().items():
                            fields[key] = (fields.get(key) or type(value)()) + value
                        reason = _finish_reason(reason, mode, parsers[k].tools_called)
                    if not (fields or reason or lp):
                        continue
                    message = DeltaMessage(**fields)
                else:
                    message = DeltaMessage(content=delta)
                choices.append(ChatStreamChoice(index=k, delta=message, logprobs=lp,
                                                finish_reason=reason, stop_reason=c.stop_reason))
            if choices:
                yield chunk(choices)
        if include_usage and final is not None:
            prompt_tokens = len(final.prompt_token_ids)
            completion_tokens = sum(len(c.token_ids) for c in final.outputs)
            yield chunk([], UsageInfo(prompt_tokens=prompt_tokens,
                                      completion_tokens=completion_tokens,
                                      total_tokens=prompt_tokens + completion_tokens,
                                      prompt_tokens_details=PromptTokensDetails(
                                          cached_tokens=max(final.num_cached_tokens, 0))))
    except (EngineDeadError, ValueError) as exc:
        status = 503 if isinstance(exc, EngineDeadError) else 400
        yield sse(error_body(OpenAIError(str(exc), status)))
    yield SSE_DONE
