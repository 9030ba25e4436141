"""What the completion and chat handlers share: the served model, prompt checks, request ->
SamplingParams, merging several generators, and responses that notice a client leaving.

Prompts are tokenized here, on the event loop with the server's own tokenizer copy (HF fast
tokenizers must not be used from two threads at once), so their length is known and checked
before the request reaches the engine: a too-long prompt is a 400, not a failed stream.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ember.engine.async_llm import AsyncLLM
from ember.entrypoints.openai.errors import OpenAIError
from ember.entrypoints.openai.protocol import ChatMessage, SamplingExtras
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger("ember")


class ServingContext:
    """The engine plus what every handler needs to know about the served model."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str]) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        # The engine thread uses the engine's tokenizer; the event loop uses this copy.
        self.tokenizer = copy.deepcopy(engine.tokenizer)

    def check_model(self, name: str | None) -> str:
        if name is None or name == "" or name in self.served_model_names:
            return self.model_name
        check_text(name, "model")
        raise OpenAIError(
            f"The model `{name}` does not exist.", 404, param="model", code="model_not_found"
        )

    def need_tokenizer(self):
        if self.tokenizer is None:
            raise OpenAIError("this server was started without a tokenizer", 400)
        return self.tokenizer

    def check_tokens(self, ids: list[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise OpenAIError("the prompt is empty: give at least one token", 400, param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIError(
                f"token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}", 400,
                param=param,
            )
        return ids

    def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        check_text(text, param)
        return list(self.need_tokenizer().encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.need_tokenizer().decode(ids)

    def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        tokenizer = self.need_tokenizer()
        conversation = [_message_dict(m) for m in messages]
        try:
            ids = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                tokenize=True,
            )
        except Exception as exc:  # a template that rejects the conversation (jinja, ValueError)
            raise OpenAIError(f"cannot apply the chat template: {exc}", 400, "messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def check_length(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        """The max_tokens to use; 400 when prompt + completion cannot fit the context."""
        if prompt_len >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens, and your "
                f"prompt has {prompt_len} tokens (at least one is needed for the completion). "
                "Please reduce the length of the prompt.",
                400, param=param, code="context_length_exceeded",
            )
        if max_tokens is None:
            return self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                "completion.",
                400, param="max_tokens", code="context_length_exceeded",
            )
        return max_tokens


def check_text(text: str, param: str) -> None:
    """400 for text that is not valid Unicode (an unpaired surrogate, which JSON's \\uD800
    escapes can carry): no tokenizer, log line or error body can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OpenAIError(
            f"{param} is not valid Unicode: an unpaired surrogate at position {exc.start}", 400,
            param=param,
        ) from None


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(
                    f"content part type {part.type!r} is not supported (text only)", 400,
                    param="messages",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def sampling_params(
    req: SamplingExtras,
    ctx: ServingContext,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams of a request; its ValueErrors become 400s naming the field."""
    if req.logit_bias:
        raise OpenAIError("logit_bias is not supported", 400, param="logit_bias")
    stop_ids = list(req.stop_token_ids or [])
    if any(not 0 <= t < ctx.vocab_size for t in stop_ids):
        raise OpenAIError(
            f"stop_token_ids must be in [0, {ctx.vocab_size})", 400, param="stop_token_ids"
        )
    kwargs: dict[str, Any] = dict(
        n=req.n,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=stop_ids,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
        raise OpenAIError(str(exc), 400, param=param if param.isidentifier() else None) from exc


def check_stream_options(req: SamplingExtras) -> bool:
    """Whether to send a usage chunk; stream_options without stream is a 400 (as OpenAI)."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true", 400,
                          param="stream_options")
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


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


async def until_disconnect(raw_request: Request, work: Awaitable[T]) -> T | None:
    """Run a non-streaming handler; if the client leaves first, cancel it (aborting its work)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw_request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (closing the generator, which aborts the request) as soon
    as the client disconnects, even while no token is being sent."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (stream, watcher):
                t.cancel()
            results = await asyncio.gather(stream, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            # Headers are sent: the client sees a cut stream; the log says why.
            logger.error("streaming response failed", exc_info=error)


def sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
