"""Responses that notice a client leaving: merging several request streams, running a
non-streaming handler until the client disconnects or the server shuts down, and server-sent
events that stop (aborting the request) when the client goes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ember.entrypoints.openai.errors import OpenAIError, error_body
from ember.entrypoints.openai.serving_common import ServingContext
from ember.outputs import RequestOutput

T = TypeVar("T")
logger = logging.getLogger("ember")


async def merge_generators(
    gens: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (index, output); closing it aborts them all."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                await queue.put((index, out))
            await queue.put((index, done))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # each generator's own cleanup aborts its request
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


SHUTDOWN_MESSAGE = "the server is shutting down: this request was aborted"


async def _wait_event(event: asyncio.Event) -> None:
    await event.wait()


async def until_disconnect(raw_request: Request, work: Awaitable[T], ctx: ServingContext,
                           request_id: str) -> T | None:
    """Run a non-streaming handler; if the client leaves first, cancel it (aborting its work).
    At shutdown's deadline it is cancelled too, and the client gets a 503."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(_wait_disconnect(raw_request.receive)),
                asyncio.ensure_future(_wait_event(ctx.abort_in_flight))]
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, *watchers):
            t.cancel()
        await asyncio.gather(task, *watchers, return_exceptions=True)
    if task.cancelled():
        if ctx.abort_in_flight.is_set():
            logger.warning("aborted request %s: the server is shutting down", request_id)
            raise OpenAIError(SHUTDOWN_MESSAGE, 503)
        return None
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (closing the generator, which aborts the request) as soon
    as the client disconnects, even while no token is being sent. At shutdown's deadline the
    stream ends properly: an error event, then `[DONE]`."""

    def __init__(self, content: AsyncIterator[str], ctx: ServingContext, request_id: str
                 ) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.abort_in_flight = ctx.abort_in_flight
        self.request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        stream = asyncio.ensure_future(self.stream_response(tracking_send))
        watchers = [asyncio.ensure_future(_wait_disconnect(receive)),
                    asyncio.ensure_future(_wait_event(self.abort_in_flight))]
        try:
            await asyncio.wait({stream, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, *watchers):
                t.cancel()
            results = await asyncio.gather(stream, *watchers, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if isinstance(results[0], asyncio.CancelledError) and self.abort_in_flight.is_set():
            await self._end_at_shutdown(tracking_send, started)
            return
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            # Headers are sent: the client sees a cut stream; the log says why.
            logger.error("streaming response failed", exc_info=error)

    async def _end_at_shutdown(self, send: Send, started: bool) -> None:
        logger.warning("aborted request %s: the server is shutting down", self.request_id)
        if not started:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
        event = sse(error_body(OpenAIError(SHUTDOWN_MESSAGE, 503))) + SSE_DONE
        try:
            await send({"type": "http.response.body", "body": event.encode(),
                        "more_body": False})
        except OSError:
            pass  # the client left meanwhile


def sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
