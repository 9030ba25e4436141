"""The four registries (models, attention backends, quantization methods, platforms) and their
built-in entries. Importing this module imports no model, backend or platform code."""

from __future__ import annotations

from ember.registry.base import Entry, LazyRegistry

ModelRegistry: LazyRegistry = LazyRegistry("model architecture")
AttentionBackendRegistry: LazyRegistry = LazyRegistry("attention backend")
QuantizationRegistry: LazyRegistry = LazyRegistry("quantization method")
PlatformRegistry: LazyRegistry = LazyRegistry("platform")

_BUILTIN_MODELS = {
    "LlamaForCausalLM": "ember.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "ember.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "ember.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "ember.models.qwen3:Qwen3ForCausalLM",
}
_BUILTIN_BACKENDS = {
    "sdpa": (
        "ember.attention_backends.sdpa:SdpaBackend",
        {"devices": ["cpu", "cuda"], "dtypes": ["float32", "float16", "bfloat16"],
         "head_sizes": "any", "sliding_window": True, "cuda_graphs": False, "priority": 0},
    ),
    "triton": (
        "ember.attention_backends.triton_backend:TritonBackend",
        {"devices": ["cuda"], "dtypes": ["float32", "float16", "bfloat16"],
         "head_sizes": [16, 32, 64, 128, 256], "sliding_window": True, "cuda_graphs": True,
         "priority": 10},
    ),
}
_BUILTIN_PLATFORMS = {
    "cpu": "ember.platforms.cpu:CpuPlatform",
}

for _name, _target in _BUILTIN_MODELS.items():
    ModelRegistry.register(_name, _target, owner="ember")
for _name, (_target, _caps) in _BUILTIN_BACKENDS.items():
    AttentionBackendRegistry.register(_name, _target, owner="ember", capabilities=_caps)
for _name, _target in _BUILTIN_PLATFORMS.items():
    PlatformRegistry.register(_name, _target, owner="ember")

__all__ = [
    "Entry",
    "LazyRegistry",
    "ModelRegistry",
    "AttentionBackendRegistry",
    "QuantizationRegistry",
    "PlatformRegistry",
]
