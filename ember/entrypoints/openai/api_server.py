"""The OpenAI-compatible HTTP server: a FastAPI app over AsyncLLM, and `run_server` for the CLI.

`build_app(engine)` gives an app for any ASGI server (tests run it under uvicorn in a thread);
`run_server(ns)` builds the engine from CLI flags and runs it under http_server.py's uvicorn
server, whose SIGTERM/SIGINT handling stops accepting, lets in-flight requests finish (up to
--shutdown-timeout seconds, then ends them properly, aborting their engine requests), and then
the app's lifespan shuts the engine down.
"""

from __future__ import annotations

import argparse
import hmac
import logging
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

import ember
from ember import envs
from ember.engine.async_llm import AsyncLLM
from ember.entrypoints.openai import metrics as prom
from ember.entrypoints.openai.chat_outputs import ServerParsers
from ember.entrypoints.openai.errors import OpenAIError, error_body, install_error_handlers
from ember.entrypoints.openai.limits import RequestLimitsMiddleware, ServerLimits
from ember.entrypoints.openai.pooling_routes import add_pooling_routes
from ember.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from ember.entrypoints.openai.serving_chat import create_chat_completion
from ember.entrypoints.openai.serving_common import ServingContext
from ember.entrypoints.openai.serving_completion import create_completion
from ember.entrypoints.openai.serving_pooling import check_generate_model

logger = logging.getLogger("ember")

_ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}


class APIKeyMiddleware:
    """401 with an OpenAI error body on /v1/* without `Authorization: Bearer <key>`.

    A plain ASGI middleware (not BaseHTTPMiddleware) so streaming and disconnects pass through
    untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and (
            scope["method"] != "OPTIONS"
        ):
            given = [v for k, v in scope["headers"] if k == b"authorization"]
            # Exactly one header, and the right one: with two, which "wins" is a proxy's guess.
            if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
                err = OpenAIError("Incorrect or missing API key: pass it as "
                                  "'Authorization: Bearer <key>'", 401, code="invalid_api_key")
                await JSONResponse(error_body(err), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    shutdown_engine_on_exit: bool = True,
    limits: ServerLimits | None = None,
    trust_request_chat_template: bool = False,
    dev_mode: bool | None = None,
    parsers: ServerParsers | None = None,
) -> FastAPI:
    """The app over `engine`; `limits` (body size, body idle time) default to ServerLimits();
    `dev_mode` (default: EMBER_SERVER_DEV_MODE) adds the engine-control endpoints."""
    names = served_model_names or [engine.model_config.path]
    ctx = ServingContext(engine, names, trust_request_chat_template, parsers)
    metrics = prom.ServerMetrics(engine, ctx.model_name)
    engine.add_stat_logger(metrics.record)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            engine.remove_stat_logger(metrics.record)
            ctx.close()
            if shutdown_engine_on_exit:
                await engine.shutdown()

    app = FastAPI(title="ember OpenAI-compatible server", version=ember.__version__,
                  lifespan=lifespan)
    app.state.engine, app.state.ctx, app.state.metrics = engine, ctx, metrics
    install_error_handlers(app)
    limits = limits or ServerLimits()
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=limits.max_body_bytes,
                       timeout_body_idle=limits.timeout_body_idle)
    if api_key:  # outside the body limits: a client without the key gets its 401 unread
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health", response_class=Response, responses=_ERRORS)  # 200: an empty body
    async def health() -> Response:
        await engine.check_health()  # EngineDeadError -> 503
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=ember.__version__)

    @app.get("/metrics", response_class=Response)
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=prom.CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        # root names the served model, not where it lies on this machine's disk.
        return ModelCard(id=name, root=names[0], max_model_len=ctx.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model: str) -> ModelCard:
        if model not in names:
            ctx.check_model(model)
        return card(model)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        check_generate_model(ctx, "/v1/completions")
        return await create_completion(req, raw, ctx)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        check_generate_model(ctx, "/v1/chat/completions")
        return await create_chat_completion(req, raw, ctx)

    # /v1/embeddings, /pooling, /classify, /score, /rerank (400 on a generating model)
    add_pooling_routes(app, ctx, _ERRORS)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", 400, param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise OpenAIError("messages must not be empty", 400, param="messages")
            ids = await ctx.apply_chat_template(req.messages, req.add_generation_prompt)
        else:
            ids = await ctx.encode(req.prompt or "", req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(req.model)
        if req.tokens:
            ctx.check_tokens(req.tokens, param="tokens")
        return DetokenizeResponse(prompt=await ctx.decode_async(req.tokens))

    if envs.server_dev_mode() if dev_mode is None else dev_mode:
        add_dev_endpoints(app, engine)
    return app


def add_dev_endpoints(app: FastAPI, engine: AsyncLLM) -> None:
    """vLLM's development endpoints (behind VLLM_SERVER_DEV_MODE there, EMBER_SERVER_DEV_MODE
    here): they act on the whole engine, so they are for operators, never for clients."""

    @app.post("/reset_prefix_cache", response_class=Response)
    async def reset_prefix_cache() -> Response:
        await engine.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/sleep", response_class=Response, responses=_ERRORS)
    async def sleep(level: int = 1) -> Response:
        try:
            await engine.sleep(level)
        except (ValueError, RuntimeError) as exc:
            raise OpenAIError(str(exc), 400, param="level") from None
        return Response(status_code=200)

    @app.post("/wake_up", response_class=Response)
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        await engine.wake_up(tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await engine.is_sleeping()}


# ---- the `ember serve` process -----------------------------------------------------------
def parsers_from(ns: argparse.Namespace) -> ServerParsers:
    return ServerParsers(tool_call_parser=ns.tool_call_parser,
                         enable_auto_tool_choice=ns.enable_auto_tool_choice,
                         reasoning_parser=ns.reasoning_parser)


def served_names(ns: argparse.Namespace, args) -> list[str]:
    return ns.served_model_name or [args.model or "SmolLM2-135M-Instruct"]


def run_server(ns: argparse.Namespace) -> int:
    """`ember serve`: the engine core in a child process, HTTP here (or in N processes)."""
    from ember.entrypoints.cli_args import engine_args_from

    if ns.api_server_count < 1:
        raise SystemExit("--api-server-count must be at least 1")
    if ns.api_key == "":
        raise SystemExit("--api-key is empty: give a key, or leave the flag out to serve without one")
    try:
        parsers_from(ns).check()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    args = engine_args_from(ns)
    if ns.reasoning_parser:  # as vLLM: structured outputs then constrain the answer only
        args.structured_outputs_config = {"reasoning_parser": ns.reasoning_parser,
                                          **dict(args.structured_outputs_config or {})}
    if ns.api_server_count > 1:
        from ember.entrypoints.openai.launcher import run_multi_server

        return run_multi_server(ns, args)
    from ember.entrypoints.openai.http_server import limits_from, make_server
    from ember.gc_heap import freeze_process_heap

    api_key = ns.api_key or envs.api_key()
    engine = AsyncLLM.from_engine_args(args)
    names = served_names(ns, args)
    app = build_app(engine, names, api_key=api_key, limits=limits_from(ns),
                    trust_request_chat_template=ns.trust_request_chat_template,
                    parsers=parsers_from(ns))
    server = make_server(app, ns)
    freeze_process_heap("API server")  # ember.gc_heap: this process is ember's own
    logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", names[0], ns.host, ns.port)
    try:
        server.run()
    finally:
        engine.shutdown_sync()  # also when uvicorn failed before the lifespan ran
    return 0 if server.started else 1
