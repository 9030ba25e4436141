"""/v1/embeddings, /pooling and /classify, and what the score endpoints share with them.

/v1/embeddings and /pooling take a chat conversation instead of `input` too (vLLM's
EmbeddingChatRequest / PoolingChatRequest): it is rendered with the model's chat template by the
chat endpoint's code (ServingContext.apply_chat_template) and pooled as one token-id prompt.
Prompts are checked and tokenized in the server's tokenizer thread (one batched call, the same
checks as LLM.embed: empty, longer than max_model_len unless truncate_prompt_tokens, ids outside
the vocabulary), then go to the engine core in one message through AsyncLLM.pool_many. A pooling
endpoint on a generating model, a generate endpoint on a pooling model and an endpoint the model
cannot serve (embeddings from a classifier, classes from an embedding model) are 400s that name
the model's runner or kind.
"""

from __future__ import annotations

import base64
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ember.entrypoints.openai.errors import OpenAIError
from ember.entrypoints.openai.protocol import UsageInfo, random_id
from ember.entrypoints.openai.protocol_pooling import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingChatRequest,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingChatRequest,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    PromptInput,
)
from ember.entrypoints.openai.serving_common import ServingContext, check_text
from ember.entrypoints.openai.serving_params import check_priority
from ember.entrypoints.openai.serving_streams import until_disconnect
from ember.pooling.inputs import model_kind, tokenize_prompts, verify_params
from ember.pooling.outputs import PoolingRequestOutput
from ember.pooling.params import PoolingParams

MAX_INPUTS = 2048  # prompts in one request (OpenAI's limit for embeddings)
_PARAM_FIELDS = ("dimensions", "normalize", "use_activation", "activation",
                 "truncate_prompt_tokens", "priority")


# ---- what the model can serve ----------------------------------------------------------
def check_generate_model(ctx: ServingContext, endpoint: str) -> None:
    """400 for a generate endpoint on a pooling model."""
    cfg = ctx.engine.model_config
    if cfg.runner == "pooling":
        raise OpenAIError(
            f"The model `{ctx.model_name}` ({cfg.architecture}) runs with runner 'pooling': it "
            f"cannot generate text, so {endpoint} is not available; use /v1/embeddings, "
            "/pooling, /classify, /score or /rerank.", 400, param="model",
            code="model_not_supported")


def check_pooling_model(ctx: ServingContext, endpoint: str, kind: str | None = None) -> str:
    """The model's kind ("embed" or "classify"); 400 when it cannot serve `endpoint`."""
    cfg = ctx.engine.model_config
    if cfg.runner != "pooling":
        raise OpenAIError(
            f"The model `{ctx.model_name}` ({cfg.architecture}) runs with runner "
            f"'{cfg.runner}': it generates text and gives no embeddings, classes or scores, so "
            f"{endpoint} is not available; serve a pooling model (--runner pooling).", 400,
            param="model", code="model_not_supported")
    have = model_kind(cfg)
    if kind is not None and have != kind:
        what = {"embed": "an embedding model", "classify": "a classification model"}
        raise OpenAIError(
            f"{endpoint} needs {what[kind]}; the model `{ctx.model_name}` ({cfg.architecture}) "
            f"is {what[have]}: use {'/classify' if have == 'classify' else '/v1/embeddings'}.",
            400, param="model", code="model_not_supported")
    return have


# ---- shared steps ----------------------------------------------------------------------
def prompts_from(value: PromptInput, param: str = "input") -> list[Any]:
    """OpenAI's input forms -> a list of texts and TokensPrompts."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [{"prompt_token_ids": list(value)}]
    else:
        items = [v if isinstance(v, str) else {"prompt_token_ids": list(v)} for v in value]
    if not items:
        raise OpenAIError(f"{param} is empty: give at least one text or token list", 400,
                          param=param)
    if len(items) > MAX_INPUTS:
        raise OpenAIError(f"{param} has {len(items)} items; at most {MAX_INPUTS} per request",
                          400, param=param)
    return items


async def prompts_of(req: Any, ctx: ServingContext) -> tuple[list[Any], str, bool]:
    """(prompts, the field they came from, add_special_tokens for text prompts) of an input or
    a chat request; a conversation becomes one token-id prompt."""
    if not isinstance(req, EmbeddingChatRequest | PoolingChatRequest):
        return prompts_from(req.input), "input", req.add_special_tokens
    if req.add_generation_prompt and req.continue_final_message:
        raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true: "
                          "the first extends the last message, the second opens a new one", 400,
                          param="continue_final_message")
    ids = await ctx.apply_chat_template(req.messages, req.add_generation_prompt,
                                        req.continue_final_message, req.chat_template,
                                        req.chat_template_kwargs, req.add_special_tokens)
    return [{"prompt_token_ids": ids}], "messages", False


def pooling_params(req: Any, task: str, ctx: ServingContext) -> PoolingParams:
    """The request's PoolingParams for `task`, checked; a field the task or model cannot
    honour is a 400 naming it."""
    given = {f: getattr(req, f) for f in ("dimensions", "normalize", "use_activation",
                                         "activation") if getattr(req, f, None) is not None}
    try:
        params = verify_params(PoolingParams(**given), task, ctx.engine.model_config,
                               req.truncate_prompt_tokens)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param=_param_of(str(exc))) from None
    keep = params.truncate_prompt_tokens
    if keep is not None and keep > ctx.max_model_len:
        raise OpenAIError(f"truncate_prompt_tokens={keep} is greater than max_model_len="
                          f"{ctx.max_model_len}", 400, param="truncate_prompt_tokens")
    return params


def _param_of(message: str) -> str | None:
    return next((f for f in _PARAM_FIELDS if message.startswith(f)), None)


def _early_length_check(ctx: ServingContext, texts: list[str], param: str) -> None:
    """Text too long for any tokenization to fit: refused before it is tokenized."""
    for text in texts:
        check_text(text, param)
        if len(text) > ctx.max_text_chars:
            raise OpenAIError(
                f"{param} has a text of {len(text)} characters, more than any text that fits "
                f"max_model_len={ctx.max_model_len} tokens can have: shorten it or pass "
                "truncate_prompt_tokens", 400, param=param, code="context_length_exceeded")


async def run_pooling(ctx: ServingContext, raw: Request, req: Any, prompts: list[Any],
                      params: PoolingParams, prefix: str,
                      pairs: list[tuple[str, str]] | None = None,
                      add_special_tokens: bool = True, param: str = "input"
                      ) -> list[PoolingRequestOutput] | None:
    """Tokenize, pool, and return one output per prompt (None: the client left)."""
    check_priority(req, ctx)
    texts = [p for p in prompts if isinstance(p, str)]
    if pairs is not None:
        texts = [t for pair in pairs for t in pair]
    if params.truncate_prompt_tokens is None:
        _early_length_check(ctx, texts, param)
    else:
        for text in texts:
            check_text(text, param)
    plist = [params] * len(prompts)
    cfg = ctx.engine.model_config
    tokenizer = ctx._worker_tokenizer() if texts else None
    try:
        ids = await ctx._in_tokenizer_thread(
            lambda: tokenize_prompts(tokenizer, prompts, plist, ctx.max_model_len,
                                     cfg.vocab_size, pairs, add_special_tokens))
    except ValueError as exc:
        message = str(exc)
        code = "context_length_exceeded" if "max_model_len" in message else None
        raise OpenAIError(message, 400, param=param, code=code) from None
    engine_id = random_id(f"{prefix}-engine")  # ours alone; the client's id names the response
    request_ids = [f"{engine_id}-{i}" for i in range(len(ids))]
    work = ctx.engine.pool_many([{"prompt_token_ids": t} for t in ids], plist, request_ids,
                                req.priority)
    try:
        return await until_disconnect(raw, work, ctx, engine_id)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param=_param_of(str(exc))) from None


def usage_of(outputs: list[PoolingRequestOutput]) -> UsageInfo:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return UsageInfo(prompt_tokens=tokens, total_tokens=tokens)


def encode_vector(out: PoolingRequestOutput, encoding_format: str) -> list[float] | str:
    data = out.outputs.data
    if encoding_format == "base64":  # what OpenAI's client decodes: float32, little-endian
        return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


def _response_id(req: Any, prefix: str) -> str:
    return f"{prefix}-{req.request_id}" if req.request_id else random_id(prefix)


# ---- the endpoints -----------------------------------------------------------------------
async def create_embedding(req: EmbeddingRequest | EmbeddingChatRequest, raw: Request,
                           ctx: ServingContext) -> Response:
    model = ctx.check_model(req.model)
    check_pooling_model(ctx, "/v1/embeddings", "embed")
    prompts, param, special = await prompts_of(req, ctx)
    params = pooling_params(req, "embed", ctx)
    outs = await run_pooling(ctx, raw, req, prompts, params, "embd", add_special_tokens=special,
                             param=param)
    if outs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    data = [EmbeddingResponseData(index=i, embedding=encode_vector(o, req.encoding_format))
            for i, o in enumerate(outs)]
    body = EmbeddingResponse(id=_response_id(req, "embd"), model=model, data=data,
                             usage=usage_of(outs))
    return JSONResponse(body.model_dump())


async def create_pooling(req: PoolingRequest | PoolingChatRequest, raw: Request,
                         ctx: ServingContext) -> Response:
    model = ctx.check_model(req.model)
    kind = check_pooling_model(ctx, "/pooling")
    prompts, param, special = await prompts_of(req, ctx)
    params = pooling_params(req, kind, ctx)
    outs = await run_pooling(ctx, raw, req, prompts, params, "pool", add_special_tokens=special,
                             param=param)
    if outs is None:
        return Response(status_code=499)
    data = [PoolingResponseData(index=i, data=encode_vector(o, req.encoding_format))
            for i, o in enumerate(outs)]
    body = PoolingResponse(id=_response_id(req, "pool"), model=model, data=data,
                           usage=usage_of(outs))
    return JSONResponse(body.model_dump())


async def create_classify(req: ClassificationRequest, raw: Request, ctx: ServingContext
                          ) -> Response:
    model = ctx.check_model(req.model)
    check_pooling_model(ctx, "/classify", "classify")
    prompts = prompts_from(req.input)
    params = pooling_params(req, "classify", ctx)
    outs = await run_pooling(ctx, raw, req, prompts, params, "classify",
                             add_special_tokens=req.add_special_tokens)
    if outs is None:
        return Response(status_code=499)
    id2label = getattr(ctx.engine.model_config.hf_config, "id2label", None) or {}
    data = []
    for i, out in enumerate(outs):
        probs = out.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        label = id2label.get(best, id2label.get(str(best)))
        data.append(ClassificationData(index=i, label=label, probs=probs,
                                       num_classes=len(probs)))
    body = ClassificationResponse(id=_response_id(req, "classify"), model=model, data=data,
                                  usage=usage_of(outs))
    return JSONResponse(body.model_dump())
