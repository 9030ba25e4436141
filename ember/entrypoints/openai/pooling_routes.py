"""The pooling endpoints' routes: /v1/embeddings, /pooling, /classify, /score (= /v1/score) and
/rerank (= /v1/rerank = /v2/rerank, vLLM's three spellings of one handler); each answers 400 on a
generating model (serving_pooling.py, serving_score.py).

/v1/embeddings and /pooling read either form of their request (`input`, or a chat conversation
in `messages`): the body is a union told apart by the `messages` key. Pydantic names the chosen
form in an error's location (`chat.input`); _PromptFormRoute takes it out again, so a refused
field is named as the client spelled it, as on every other endpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute

from ember.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequestBody,
    EmbeddingResponse,
    PoolingRequestBody,
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

_FORM_TAGS = ("input", "chat")  # the Tag names of protocol_pooling's request unions


def _untagged(error: dict[str, Any]) -> dict[str, Any]:
    loc = tuple(error.get("loc", ()))
    if len(loc) > 1 and loc[0] == "body" and loc[1] in _FORM_TAGS:
        error = {**error, "loc": (loc[0], *loc[2:])}
    return error


class _PromptFormRoute(APIRoute):
    """An APIRoute whose validation errors leave out the union's tag."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                raise RequestValidationError([_untagged(e) for e in exc.errors()],
                                             body=exc.body) from None
        return route


def add_pooling_routes(app: FastAPI, ctx: ServingContext, errors: dict) -> None:
    """The pooling endpoints (they answer 400 on a generating model)."""
    async def embeddings(req: EmbeddingRequestBody, raw: Request) -> Response:
        return await create_embedding(req, raw, ctx)

    async def pooling(req: PoolingRequestBody, raw: Request) -> Response:
        return await create_pooling(req, raw, ctx)

    app.router.add_api_route("/v1/embeddings", embeddings, methods=["POST"],
                             response_model=EmbeddingResponse, responses=errors,
                             route_class_override=_PromptFormRoute)
    app.router.add_api_route("/pooling", pooling, methods=["POST"],
                             response_model=PoolingResponse, responses=errors,
                             route_class_override=_PromptFormRoute)

    @app.post("/classify", response_model=ClassificationResponse, responses=errors)
    async def classify(req: ClassificationRequest, raw: Request) -> Response:
        return await create_classify(req, raw, ctx)

    for path in ("/score", "/v1/score"):
        @app.post(path, response_model=ScoreResponse, responses=errors)
        async def score(req: ScoreRequest, raw: Request) -> Response:
            return await create_score(req, raw, ctx)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @app.post(path, response_model=RerankResponse, responses=errors)
        async def rerank(req: RerankRequest, raw: Request) -> Response:
            return await create_rerank(req, raw, ctx)
