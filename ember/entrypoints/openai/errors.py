"""OpenAI-style error bodies and the FastAPI exception handlers that produce them.

Every failure leaves the server as `{"error": {"message", "type", "param", "code"}}` with the
right status: client mistakes (validation, bad sampling values, unknown model, prompt too long)
are 4xx, never 500, and the server keeps serving.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember.engine.errors import EngineDeadError
from ember.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("ember")

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to report to the client with an HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "BadRequest")


def error_body(err: OpenAIError) -> dict:
    info = ErrorInfo(message=err.message, type=err.type, param=err.param, code=err.code)
    return ErrorResponse(error=info).model_dump()


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for item in exc.errors()[:5]:
        loc = [str(p) for p in item.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        param = param or (where if loc else None)
        parts.append(f"{where}: {item.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI (and its client's BadRequestError) say 400.
        message, param = _validation_message(exc)
        return error_response(OpenAIError(message, 400, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        response = error_response(OpenAIError(message, exc.status_code))
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(OpenAIError(str(exc), 503, type="service_unavailable"))

    app.add_middleware(InternalErrorMiddleware)


class InternalErrorMiddleware:
    """A bug in a handler is a 500 whose body names an error id (the log has the traceback, the
    client none of the internals), and the connection stays usable: Starlette's own handler
    re-raises to uvicorn, which then closes the connection and resets the client's next request.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            logger.exception("internal server error %s on %s %s", error_id, scope["method"],
                             scope["path"])
            if started:
                return  # a stream already under way is cut; its client sees an early end
            err = OpenAIError(f"internal server error (id {error_id}); the server log has the "
                              "details", 500)
            await error_response(err)(scope, receive, send)
