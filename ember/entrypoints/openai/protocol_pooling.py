"""Pydantic models of the pooling endpoints, in vLLM's request and response shapes.

/v1/embeddings (OpenAI's: input as a string, strings, token ids or lists of them; encoding_format
float or base64; dimensions for Matryoshka models; user), /pooling, /classify, /score (text_1
against text_2) and /rerank = /v1/rerank (Jina / Cohere: query, documents, top_n,
return_documents). vLLM's extra fields ride along with vLLM's names (truncate_prompt_tokens,
add_special_tokens, priority, request_id, normalize, use_activation and its older spelling
activation). Unknown fields are refused by name, as on every endpoint (OpenAIRequest).
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from ember.entrypoints.openai.protocol import OpenAIModel, OpenAIRequest, UsageInfo, random_id

PromptInput = str | list[str] | list[int] | list[list[int]]


class PoolingExtras(OpenAIRequest):
    """What every pooling request takes."""

    model: str | None = None
    user: str | None = None  # OpenAI's end-user tag: accepted and unused, as in vLLM
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    request_id: str | None = Field(default=None, max_length=256)


class EmbeddingRequest(PoolingExtras):
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """/pooling: the model's pooled output as it is (an embedding, or class probabilities)."""

    use_activation: bool | None = None
    activation: bool | None = None  # vLLM's older name of use_activation


class ClassificationRequest(PoolingExtras):
    input: PromptInput
    add_special_tokens: bool = True
    use_activation: bool | None = None
    activation: bool | None = None


class ScoreRequest(PoolingExtras):
    text_1: str | list[str]
    text_2: str | list[str]
    use_activation: bool | None = None
    activation: bool | None = None


class RerankRequest(PoolingExtras):
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True
    use_activation: bool | None = None
    activation: bool | None = None


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
