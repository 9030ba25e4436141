"""/score (= /v1/score) and /rerank (= /v1/rerank = /v2/rerank): relevance of texts to texts, vLLM's way.

A cross-encoder (a classifier with one label) reads each pair as one prompt (`text_1 [SEP]
text_2`, second segment marked) and its sigmoid output is the score; an embedding model scores a
pair by the cosine of the two embeddings (each distinct text embedded once). /score pairs one
text_1 with every text_2, or the two lists item by item; /rerank scores the query against every
document and returns them best first (top_n of them; 0 means all), with the documents' text
unless return_documents is false.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from ember.entrypoints.openai.errors import OpenAIError
from ember.entrypoints.openai.protocol_pooling import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from ember.entrypoints.openai.serving_common import ServingContext
from ember.entrypoints.openai.serving_pooling import (
    _response_id,
    check_pooling_model,
    pooling_params,
    run_pooling,
    usage_of,
)
from ember.pooling.inputs import num_labels


async def _scores(req: Any, raw: Request, ctx: ServingContext, endpoint: str,
                  pairs: list[tuple[str, str]], param: str) -> tuple[list[float], int] | None:
    """(one score per pair, prompt tokens used); None when the client left."""
    kind = check_pooling_model(ctx, endpoint)
    for a, b in pairs:
        if not a or not b:
            raise OpenAIError(f"{param}: a text is empty", 400, param=param)
    if kind == "classify":
        labels = num_labels(ctx.engine.model_config)
        if labels != 1:
            raise OpenAIError(
                f"{endpoint} needs a cross-encoder (a classifier with one label) or an embedding "
                f"model; the model `{ctx.model_name}` is a classifier with {labels} labels: use "
                "/classify", 400, param="model", code="model_not_supported")
        params = pooling_params(req, "score", ctx)
        outs = await run_pooling(ctx, raw, req, [a for a, _ in pairs], params, "score",
                                 pairs=pairs, param=param)
        if outs is None:
            return None
        return [float(o.outputs.data.reshape(-1)[0]) for o in outs], usage_of(outs).prompt_tokens
    if req.use_activation is not None or req.activation is not None:
        name = "use_activation" if req.use_activation is not None else "activation"
        raise OpenAIError(f"{name} has no effect when scoring with an embedding model (cosine "
                          "similarity)", 400, param=name)
    params = pooling_params(req, "embed", ctx)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    outs = await run_pooling(ctx, raw, req, texts, params, "score", param=param)
    if outs is None:
        return None
    import torch.nn.functional as F

    by_text = {t: o.outputs.data for t, o in zip(texts, outs)}
    scores = [float(F.cosine_similarity(by_text[a], by_text[b], dim=0)) for a, b in pairs]
    return scores, usage_of(outs).prompt_tokens


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


async def create_score(req: ScoreRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.check_model(req.model)
    t1, t2 = _as_list(req.text_1), _as_list(req.text_2)
    if not t1 or not t2:
        raise OpenAIError("score needs at least one text in text_1 and in text_2", 400,
                          param="text_1" if not t1 else "text_2")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    elif len(t1) != len(t2):
        raise OpenAIError(f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1 "
                          "(scored against every text_2) or equally many", 400, param="text_1")
    found = await _scores(req, raw, ctx, "/score", list(zip(t1, t2)), "text_1")
    if found is None:
        return Response(status_code=499)  # the client left; nobody reads this
    scores, tokens = found
    data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
    body = ScoreResponse(id=_response_id(req, "score"), model=model, data=data,
                         usage={"prompt_tokens": tokens, "total_tokens": tokens})
    return JSONResponse(body.model_dump())


async def create_rerank(req: RerankRequest, raw: Request, ctx: ServingContext) -> Response:
    model = ctx.check_model(req.model)
    if not req.query:
        raise OpenAIError("query is empty", 400, param="query")
    if not req.documents:
        raise OpenAIError("documents is empty: give at least one document", 400,
                          param="documents")
    pairs = [(req.query, doc) for doc in req.documents]
    found = await _scores(req, raw, ctx, "/rerank", pairs, "documents")
    if found is None:
        return Response(status_code=499)
    scores, tokens = found
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if 0 < req.top_n < len(order):
        order = order[:req.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=req.documents[i])
                            if req.return_documents else None)
               for i in order]
    body = RerankResponse(id=_response_id(req, "rerank"), model=model,
                          usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                          results=results)
    dumped = body.model_dump()
    if not req.return_documents:  # Cohere's shape: no document key at all
        for result in dumped["results"]:
            result.pop("document")
    return JSONResponse(dumped)
