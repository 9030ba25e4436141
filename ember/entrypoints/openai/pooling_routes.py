"""The pooling endpoints' routes: /v1/embeddings, /pooling, /classify, /score (= /v1/score) and
/rerank (= /v1/rerank); each answers 400 on a generating model (serving_pooling.py, serving_score.py).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ember.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from ember.entrypoints.openai.serving_common import ServingContext
from ember.entrypoints.openai.serving_pooling import (
    create_classify,
    create_embedding,
    create_pooling,
)
from ember.entrypoints.openai.serving_score import create_rerank, create_score


def add_pooling_routes(app: FastAPI, ctx: ServingContext, errors: dict) -> None:
    """The pooling endpoints (they answer 400 on a generating model)."""
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=errors)
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        return await create_embedding(req, raw, ctx)

    @app.post("/pooling", response_model=PoolingResponse, responses=errors)
    async def pooling(req: PoolingRequest, raw: Request) -> Response:
        return await create_pooling(req, raw, ctx)

    @app.post("/classify", response_model=ClassificationResponse, responses=errors)
    async def classify(req: ClassificationRequest, raw: Request) -> Response:
        return await create_classify(req, raw, ctx)

    for path in ("/score", "/v1/score"):
        @app.post(path, response_model=ScoreResponse, responses=errors)
        async def score(req: ScoreRequest, raw: Request) -> Response:
            return await create_score(req, raw, ctx)

    for path in ("/rerank", "/v1/rerank"):
        @app.post(path, response_model=RerankResponse, responses=errors)
        async def rerank(req: RerankRequest, raw: Request) -> Response:
            return await create_rerank(req, raw, ctx)
