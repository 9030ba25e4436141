"""What the completion and chat handlers share: the served model, prompt checks, request ->
SamplingParams, merging several generators, and responses that notice a client leaving.

Prompts are tokenized here, so their length is known and checked before the request reaches
the engine: a too-long prompt is a 400, not a failed stream. Tokenizing and chat templating run
in one worker thread with a tokenizer copy of its own (HF fast tokenizers must not be used from
two threads at once), never on the event loop, which must keep answering other clients; text so
long that no tokenization could fit the context is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from ember.engine.async_llm import AsyncLLM
from ember.entrypoints.openai.chat_outputs import ServerParsers
from ember.entrypoints.openai.errors import OpenAIError, error_body
from ember.entrypoints.openai.protocol import ChatMessage, SamplingExtras
from ember.entrypoints.openai.serving_structured import structured_outputs_from
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.structured_output.config import StructuredOutputsConfig

T = TypeVar("T")
logger = logging.getLogger("ember")

# Normalizers (NFKC, whitespace rules) can shrink text before it is split; allow for that when
# deciding from its length alone that a text cannot fit.
_NORMALIZER_SLACK = 2


class ServingContext:
    """The engine plus what every handler needs to know about the served model."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 trust_request_chat_template: bool = False,
                 parsers: ServerParsers | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        # The engine's output thread uses the engine's tokenizer; the event loop uses this copy
        # (for the short decodes of logprobs) and the tokenizer thread a copy of its own.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self._thread_tokenizer = copy.deepcopy(engine.tokenizer)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-tokenizer")
        self.max_text_chars = _max_text_chars(engine.tokenizer, self.max_model_len)
        self.default_sampling = dict(getattr(engine.model_config, "default_sampling", {}))
        self.structured_outputs_config = (engine.model_config.structured_outputs
                                          or StructuredOutputsConfig())
        self.trust_request_chat_template = trust_request_chat_template
        self.parsers = parsers or ServerParsers()
        # Set when the server's shutdown grace period is over: in-flight requests end now.
        self.abort_in_flight = asyncio.Event()

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def _in_tokenizer_thread(self, work: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, work, *args)

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

    def _worker_tokenizer(self):
        self.need_tokenizer()
        return self._thread_tokenizer

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

    def check_text_length(self, chars: int, param: str) -> None:
        """400 for text too long to fit the context however it is split: no tokenizing needed."""
        if chars > self.max_text_chars:
            raise OpenAIError(
                f"{param} has {chars} characters: more than any text that fits this model's "
                f"maximum context length of {self.max_model_len} tokens can have. Please reduce "
                "the length of the prompt.", 400, param=param, code="context_length_exceeded",
            )

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt"
                     ) -> list[int]:
        check_text(text, param)
        self.check_text_length(len(text), param)
        tokenizer = self._worker_tokenizer()
        ids = await self._in_tokenizer_thread(
            lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        """For short decodes on the event loop (a token's text for logprobs)."""
        return self.need_tokenizer().decode(ids)

    async def decode_async(self, ids: list[int]) -> str:
        tokenizer = self._worker_tokenizer()
        return await self._in_tokenizer_thread(tokenizer.decode, ids)

    async def apply_chat_template(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """Token ids of the rendered conversation. `chat_template` replaces the tokenizer's
        (only with --trust-request-chat-template); `template_kwargs` reach the template as
        variables (vLLM's chat_template_kwargs, e.g. enable_thinking); `add_special_tokens`
        adds the tokenizer's special tokens (a BOS) on top of what the template writes."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIError("chat_template in a request needs the server started with "
                              "--trust-request-chat-template", 400, param="chat_template")
        kwargs = dict(template_kwargs or {})
        reserved = {"conversation", "tokenize", "add_generation_prompt", "chat_template",
                    "continue_final_message", "messages"} & set(kwargs)
        if reserved:
            raise OpenAIError(f"chat_template_kwargs may not set {sorted(reserved)}", 400,
                              param="chat_template_kwargs")
        tokenizer = self._worker_tokenizer()
        conversation = [_message_dict(m) for m in messages]
        self.check_text_length(sum(len(m["content"]) for m in conversation), "messages")

        def render() -> Any:
            rendered = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tokenize=not add_special_tokens,
                **kwargs,
            )
            if add_special_tokens:
                return tokenizer.encode(rendered, add_special_tokens=True)
            return rendered

        try:
            ids = await self._in_tokenizer_thread(render)
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
            # Up to the context, or the model's generation_config max_new_tokens if smaller.
            return min(self.max_model_len - prompt_len,
                       self.default_sampling.get("max_tokens") or self.max_model_len)
        if prompt_len + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                "completion.",
                400, param="max_tokens", code="context_length_exceeded",
            )
        return max_tokens


def _max_text_chars(tokenizer, max_model_len: int) -> int:
    """The most characters a text whose tokens fit max_model_len can have: every token's text is
    at most as long as its longest vocabulary entry (byte-level and SentencePiece spellings are
    never shorter than the text they stand for)."""
    try:
        longest = max(len(token) for token in tokenizer.get_vocab())
    except Exception:  # no tokenizer, or one without a vocabulary listing: no early bound
        return 1 << 62
    return max_model_len * max(longest, 1) * _NORMALIZER_SLACK


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
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


# Sampling fields the model's generation_config.json may give defaults for (vLLM's
# generation_config="auto"): used when the request leaves them out.
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params(
    req: SamplingExtras,
    ctx: ServingContext,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams of a request; its ValueErrors become 400s naming the field."""
    check_token_ids(req.stop_token_ids, ctx, "stop_token_ids")
    check_token_ids(req.allowed_token_ids, ctx, "allowed_token_ids")
    structured = structured_outputs_from(req, ctx.structured_outputs_config.backend)
    if req.length_penalty != 1.0:
        raise OpenAIError("length_penalty applies only with use_beam_search", 400,
                          param="length_penalty")
    defaults = ctx.default_sampling
    chosen = {name: getattr(req, name) for name in _MODEL_DEFAULTS}
    for name, value in chosen.items():
        if value is None and name in defaults:
            chosen[name] = defaults[name]
    if req.prompt_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.prompt_logprobs) if (
            req.prompt_logprobs >= 0) else -1
    kwargs: dict[str, Any] = dict(
        n=req.n,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if chosen["repetition_penalty"] is None else (
            chosen["repetition_penalty"]),
        temperature=1.0 if chosen["temperature"] is None else chosen["temperature"],
        top_p=1.0 if chosen["top_p"] is None else chosen["top_p"],
        top_k=chosen["top_k"] or 0,
        min_p=chosen["min_p"] or 0.0,
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logit_bias=_logit_bias(req.logit_bias, ctx),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        extra_args=req.vllm_xargs,
        structured_outputs=structured,
    )
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        param = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
        param = {"extra_args": "vllm_xargs"}.get(param, param)
        raise OpenAIError(str(exc), 400, param=param if param.isidentifier() else None) from exc


def check_token_ids(ids: list[int] | None, ctx: ServingContext, param: str) -> None:
    if ids is not None and any(not 0 <= t < ctx.vocab_size for t in ids):
        raise OpenAIError(f"{param} must be token ids in [0, {ctx.vocab_size})", 400,
                          param=param)


def _logit_bias(bias: dict[str, float] | None, ctx: ServingContext) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings -> bias in [-100, 100]) as SamplingParams takes it."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < ctx.vocab_size:
            raise OpenAIError(f"logit_bias keys must be token ids in [0, {ctx.vocab_size}), "
                              f"got {key[:32]!r}", 400, param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise OpenAIError(f"logit_bias values must be in [-100, 100], got {value}", 400,
                              param="logit_bias")
        out[int(key)] = value
    return out


async def validate_structured_outputs(params: SamplingParams, ctx: ServingContext) -> None:
    """400 now for a constraint the grammar backend cannot compile, rather than an error event
    in a stream that already started (compiling runs in the tokenizer thread; the engine reuses
    the result)."""
    if params.structured_outputs is None:
        return
    from ember.structured_output.validation import validate_structured_outputs as validate

    try:
        await ctx._in_tokenizer_thread(validate, params, ctx.structured_outputs_config,
                                       ctx._worker_tokenizer())
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="structured_outputs") from None


def check_priority(req: SamplingExtras, ctx: ServingContext) -> None:
    try:
        ctx.engine.processor.check_priority(req.priority)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="priority") from None


def truncate_prompt(ids: list[int], req: SamplingExtras, ctx: ServingContext) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: the context length)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return ids
    if k == 0:
        raise OpenAIError("truncate_prompt_tokens must be >= 1 or -1", 400,
                          param="truncate_prompt_tokens")
    keep = ctx.max_model_len if k == -1 else k
    if keep > ctx.max_model_len:
        raise OpenAIError(f"truncate_prompt_tokens={k} exceeds the maximum context length "
                          f"{ctx.max_model_len}", 400, param="truncate_prompt_tokens")
    return ids[-keep:]


def engine_prompt(ids: list[int], text: str | None, req: SamplingExtras) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if text is not None:
        prompt["prompt"] = text
    if req.cache_salt is not None:
        prompt["cache_salt"] = req.cache_salt
    return prompt


def beam_search_params(req: SamplingExtras, max_tokens: int):
    """vLLM's use_beam_search: n beams (best_of on completions), scored with length_penalty."""
    from ember.beam_search import BeamSearchParams

    for name in ("logprobs", "prompt_logprobs", "stop", "logit_bias", "allowed_token_ids",
                 "bad_words", "vllm_xargs"):
        value = getattr(req, name, None)
        if value not in (None, False, [], {}):
            raise OpenAIError(f"{name} cannot be combined with use_beam_search", 400,
                              param=name)
    try:
        return BeamSearchParams(
            beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as exc:
        raise OpenAIError(str(exc), 400, param="use_beam_search") from None


def check_stream_options(req: SamplingExtras) -> bool:
    """Whether to send a usage chunk; stream_options without stream is a 400 (as OpenAI)."""
    if req.stream_options is not None and not req.stream:
        raise OpenAIError("stream_options is only allowed when stream is true", 400,
                          param="stream_options")
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def continuous_usage(req: SamplingExtras) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage so far on every chunk."""
    return bool(req.stream and req.stream_options and req.stream_options.continuous_usage_stats)


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
