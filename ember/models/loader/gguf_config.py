"""The model config a GGUF file describes, built without transformers' config classes.

Importing a transformers 5 config class (``LlamaConfig``) imports its model registry and
``torch.distributed.tensor``: about 2 s, most of a GGUF model's load on a small CPU. The engine
reads a few dozen plain attributes from a config, so for GGUF files it gets this object instead:
the metadata's values over the defaults transformers' class gives the fields ember's models read
(tests/test_gguf.py checks every attribute against transformers' config from the same file).
``to_transformers()`` builds transformers' own config for whoever needs one (HF baselines).
"""

from __future__ import annotations

from typing import Any

# Defaults of the transformers config classes (transformers 5), per model type, for the fields a
# GGUF file's metadata does not carry; a field a class lacks is left out here too (ember's models
# read those with the same defaults transformers' modeling code uses).
_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": None,
    "dtype": None,
}
_WINDOWLESS = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "qwen2": {"max_position_embeddings": 32768, **_WINDOWLESS},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128, "attention_bias": False,
              **_WINDOWLESS},
}


class GGUFModelConfig:
    """Attributes as a transformers config has them (``model_type``, ``architectures``,
    ``hidden_size``, ``head_dim``, ...); ``kwargs`` are the values read from the file."""

    def __init__(self, model_type: str, **kwargs: Any) -> None:
        if model_type not in _DEFAULTS:
            raise ValueError(f"no GGUF config defaults for model type {model_type!r}")
        self.model_type = model_type
        self._kwargs = dict(kwargs)
        values = {**_COMMON, **_DEFAULTS[model_type], **kwargs}
        values.setdefault("num_key_value_heads", values["num_attention_heads"])
        if model_type == "llama":  # LlamaConfig derives it; Qwen2Config has none
            values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
        # transformers 5 keeps the rope settings here (ember.layers.rotary reads either form).
        values["rope_parameters"] = {"rope_theta": float(values["rope_theta"]),
                                     "rope_type": "default"}
        self.__dict__.update(values)

    def get_text_config(self, decoder: bool = False) -> GGUFModelConfig:
        return self

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def to_transformers(self) -> Any:
        """transformers' config class for this model type, from the same file values."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self._kwargs)

    def __repr__(self) -> str:
        return f"GGUFModelConfig({self.to_dict()})"
