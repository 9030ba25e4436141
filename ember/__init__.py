"""ember: a high-throughput, plugin-oriented LLM inference engine.

The public names resolve on first use, so `import ember` imports neither torch nor any plugin.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import ember.plugins  # noqa: F401  wires plugin discovery into the registries (registry.hooks)

__version__ = "0.1.0"

_LAZY = {
    "LLM": "ember.entrypoints.llm:LLM",
    "SamplingParams": "ember.sampling_params:SamplingParams",
    "BeamSearchParams": "ember.beam_search:BeamSearchParams",
    "StructuredOutputsParams": "ember.sampling_params:StructuredOutputsParams",
    "TextPrompt": "ember.inputs:TextPrompt",
    "TokensPrompt": "ember.inputs:TokensPrompt",
    "RequestOutput": "ember.outputs:RequestOutput",
    "CompletionOutput": "ember.outputs:CompletionOutput",
    "EngineArgs": "ember.config:EngineArgs",
    "LLMEngine": "ember.engine.llm_engine:LLMEngine",
    "AsyncLLM": "ember.engine.async_llm:AsyncLLM",
    "ModelRegistry": "ember.registry:ModelRegistry",
    # pooling models (ember.pooling)
    "PoolingParams": "ember.pooling.params:PoolingParams",
    "PoolingRequestOutput": "ember.pooling.outputs:PoolingRequestOutput",
    "EmbeddingRequestOutput": "ember.pooling.outputs:EmbeddingRequestOutput",
    "ClassificationRequestOutput": "ember.pooling.outputs:ClassificationRequestOutput",
    "ScoringRequestOutput": "ember.pooling.outputs:ScoringRequestOutput",
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:
    from ember.beam_search import BeamSearchParams  # noqa: F401
    from ember.config import EngineArgs  # noqa: F401
    from ember.engine.llm_engine import LLMEngine  # noqa: F401
    from ember.entrypoints.llm import LLM  # noqa: F401
    from ember.inputs import TextPrompt, TokensPrompt  # noqa: F401
    from ember.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from ember.pooling.outputs import (  # noqa: F401
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )
    from ember.pooling.params import PoolingParams  # noqa: F401
    from ember.registry import ModelRegistry  # noqa: F401
    from ember.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: F401


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ember' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
