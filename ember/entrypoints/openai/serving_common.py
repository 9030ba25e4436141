"""What the completion and chat handlers share: the served model and its prompt checks (request ->
SamplingParams is serving_params', responses that notice a client leaving serving_streams').

Prompts are tokenized here, so their length is known and checked before the request reaches
the engine: a too-long prompt is a 400, not a failed stream. Tokenizing and chat templating run
in one worker thread with a tokenizer copy of its own (HF fast tokenizers must not be used from
two threads at once), never on the event loop, which must keep answering other clients; text so
long that no tokenization could fit the context is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ember.engine.async_llm import AsyncLLM
from ember.entrypoints.openai.chat_outputs import ServerParsers
from ember.entrypoints.openai.errors import OpenAIError
from ember.entrypoints.openai.protocol import ChatMessage
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
