"""Pydantic models of the OpenAI API that ember serves (requests, responses, stream chunks).

Field names, defaults and shapes follow OpenAI's API so the official `openai` client works
unchanged; vLLM's extra request fields (top_k, min_p, repetition_penalty, guided_*, priority, ...)
ride along with vLLM's names. A request field this server does not know is a 400 naming it, never
silently ignored. Bounds that protect the engine (finite floats, n <= 128, logprobs <= 20, 64-bit
seeds) live here, so a bad value is a 400 before it reaches the engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # vLLM's default max_logprobs; OpenAI's top_logprobs limit
MAX_N = 128  # OpenAI's limit on choices per request


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are ignored (newer clients send more); NaN and Infinity are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class OpenAIRequest(OpenAIModel):
    """What clients send. Strict types, as OpenAI's schema: "3" is not an integer, "yes" and 1
    are not booleans, true is not a token id (an int may still stand for a float). Unknown fields
    are refused: a parameter that would have no effect must say so."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


# ---- errors and shared pieces ------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class StreamOptions(OpenAIRequest):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ember"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class SamplingExtras(OpenAIRequest):
    """Sampling fields both endpoints share: OpenAI's plus vLLM's extras."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # torch's seed range
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    request_id: str | None = Field(default=None, max_length=256)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    prompt_logprobs: int | None = Field(default=None, ge=-1, le=MAX_LOGPROBS)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = Field(default=None, min_length=1)
    return_tokens_as_token_ids: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    vllm_xargs: dict[str, Any] | None = None  # -> SamplingParams.extra_args (logits processors)
    # Structured outputs (vLLM's current field, and the older guided_* ones)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


# ---- /v1/completions ---------------------------------------------------------------------
class CompletionRequest(SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None (the first) or {token id: PromptLogprob}.
PromptLogprobsList = list[dict[int, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class CompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None



# ---- /v1/chat/completions ----------------------------------------------------------------
class ContentPart(OpenAIRequest):
    type: str
    text: str | None = None


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Earlier turns of a tool-using conversation, passed to the chat template as given.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsList | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- /tokenize, /detokenize, /version (the pooling endpoints: protocol_pooling.py) ---------
class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class VersionResponse(OpenAIModel):
    version: str
