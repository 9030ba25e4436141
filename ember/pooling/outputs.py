"""The outputs of pooling requests, in vLLM's shapes.

`PoolingRequestOutput.outputs.data` is the pooled tensor; the task views turn it into
`EmbeddingRequestOutput` (`.outputs.embedding`, a list of floats), `ClassificationRequestOutput`
(`.outputs.probs`) and `ScoringRequestOutput` (`.outputs.score`, a float).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor: the pooled vector of one request


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


OutputT = TypeVar("OutputT")


@dataclass
class PoolingRequestOutput(Generic[OutputT]):
    request_id: str
    outputs: OutputT
    prompt_token_ids: list[int]
    finished: bool = True


def _vector(out: PoolingRequestOutput, what: str) -> list[float]:
    data = out.outputs.data
    if data.dim() != 1:
        raise ValueError(f"{what} is one vector, got shape {tuple(data.shape)}")
    return data.tolist()


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(_vector(out, "an embedding")),
                   out.prompt_token_ids, out.finished)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(_vector(out, "a class distribution")),
                   out.prompt_token_ids, out.finished)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ScoringRequestOutput:
        data = out.outputs.data
        if data.numel() != 1:
            raise ValueError(f"a score is one value, got shape {tuple(data.shape)}: a "
                             "cross-encoder needs num_labels == 1")
        return cls(out.request_id, ScoringOutput(float(data.reshape(-1)[0])),
                   out.prompt_token_ids, out.finished)
