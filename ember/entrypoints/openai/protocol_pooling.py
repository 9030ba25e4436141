"""Pydantic models of the pooling endpoints, in vLLM's request and response shapes.

/v1/embeddings (OpenAI's: input as a string, strings, token ids or lists of them; encoding_format
float or base64; dimensions for Matryoshka models; user) or, instead of input, a chat
conversation (vLLM's EmbeddingChatRequest: messages rendered with the chat template), /pooling
(the same two forms), /classify, /score (text_1 against text_2) and /rerank = /v1/rerank =
/v2/rerank (Jina / Cohere: query, documents, top_n, return_documents). vLLM's extra fields ride
along with vLLM's names (truncate_prompt_tokens, add_special_tokens, priority, request_id,
normalize, use_activation and its older spelling activation). Unknown fields are refused by name,
as on every endpoint (OpenAIRequest).

The field groups are written once, as mixins that the request models combine: what every pooling
request takes (PoolingFields), a prompt as `input` (InputFields) or as a conversation
(ChatFields), how vectors come back (VectorFields) and the classifier's activation
(ActivationFields).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from ember.entrypoints.openai.protocol import (
    ChatMessage,
    OpenAIModel,
    OpenAIRequest,
    UsageInfo,
    random_id,
)

PromptInput = str | list[str] | list[int] | list[list[int]]


# ---- field groups (no endpoint takes one alone) -------------------------------------------
class PoolingFields(OpenAIRequest):
    """What every pooling request takes."""

    model: str | None = None
    user: str | None = None  # OpenAI's end-user tag: accepted and unused, as in vLLM
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    request_id: str | None = Field(default=None, max_length=256)


class InputFields(PoolingFields):
    """The prompts as OpenAI's `input` (texts or token ids)."""

    input: PromptInput
    add_special_tokens: bool = True


class ChatFields(PoolingFields):
    """The prompt as one conversation rendered by the chat template (vLLM's defaults: no
    generation prompt, no special tokens beyond what the template writes)."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False


class VectorFields(PoolingFields):
    """How pooled vectors come back."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None


class ActivationFields(PoolingFields):
    """A classifier's output activation (sigmoid / softmax), on by default."""

    use_activation: bool | None = None
    activation: bool | None = None  # vLLM's older name of use_activation


# ---- requests -------------------------------------------------------------------------------
class EmbeddingRequest(InputFields, VectorFields):
    pass


class EmbeddingChatRequest(ChatFields, VectorFields):
    pass


class PoolingRequest(InputFields, VectorFields, ActivationFields):
    """/pooling: the model's pooled output as it is (an embedding, or class probabilities)."""


class PoolingChatRequest(ChatFields, VectorFields, ActivationFields):
    pass


class ClassificationRequest(InputFields, ActivationFields):
    pass


class ScoreRequest(ActivationFields):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(ActivationFields):
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True


def _prompt_form(body: Any) -> str:
    """A body with `messages` is the chat form, anything else the input form (whose errors then
    name what is missing or unknown)."""
    return "chat" if isinstance(body, dict) and "messages" in body else "input"


# What /v1/embeddings and /pooling read: one of the two forms, chosen by the `messages` key.
EmbeddingRequestBody = Annotated[
    Annotated[EmbeddingRequest, Tag("input")] | Annotated[EmbeddingChatRequest, Tag("chat")],
    Discriminator(_prompt_form)]
PoolingRequestBody = Annotated[
    Annotated[PoolingRequest, Tag("input")] | Annotated[PoolingChatRequest, Tag("chat")],
    Discriminator(_prompt_form)]


# ---- responses -----------------------------------------------------------------------------
class EmbeddingResponseData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingResponseData(OpenAIModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("pool"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ClassificationData(OpenAIModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreResponseData(OpenAIModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(OpenAIModel):
    text: str


class RerankResult(OpenAIModel):
    index: int
    document: RerankDocument | None = None  # left out with return_documents=false
    relevance_score: float


class RerankUsage(OpenAIModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]
