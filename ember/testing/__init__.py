"""ember's conformance kit for plugin authors: importable pytest helpers.

    from ember.testing import check_attention_backend, check_model_against_transformers
    from ember.testing import check_quantization_method, check_quantized_linear

- check_attention_backend(backend_cls, device=, dtypes=, grid=): your backend against the SDPA
  reference over decode / prefill / chunked prefill / prefix hits / GQA / mixed batches;
- check_model_against_transformers(arch_or_cls, hf_config, ...): your model against its
  transformers implementation on a tiny random checkpoint (logits and greedy tokens);
- check_quantization_method(method, ...): your method's matmul against its dequantized weights;
- check_quantized_linear(method, make_tensors, ...): a checkpoint-path method's linear layers,
  loaded from checkpoint tensors, against the weights those tensors stand for
  (ember.testing.quantized_checkpoints writes such tensors and whole checkpoints).
Each raises AssertionError naming the failing case, and returns summary lines otherwise. The
submodules import torch; this package does not until a helper is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "check_attention_backend": "ember.testing.attention",
    "AttentionGrid": "ember.testing.attention",
    "Scenario": "ember.testing.attention",
    "check_model_against_transformers": "ember.testing.models",
    "run_ember_logits": "ember.testing.models",
    "check_quantization_method": "ember.testing.quantization",
    "check_quantized_linear": "ember.testing.quantized_linear",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'ember.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = sorted(_LAZY)
