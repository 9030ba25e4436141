"""Which loader fills a model's weights, chosen once by the checkpoint's format.

Formats: "safetensors" (an HF directory), "gguf" (one .gguf file, dequantized tensor by tensor)
and "dummy" (random values, the config alone). `weight_format` reads the format from the resolved
ModelConfig (an explicit `load_format` must match the files), and `load_weights` builds the model
with the loader registered for it. Every loader builds from the resolved HF config, so
`hf_overrides` and `trust_remote_code` reach the model as they reached the config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ember.attention_backends.base import AttentionBackend
    from ember.config import ModelConfig

# (config, model class, attention backend, dtype, device, progress) -> the loaded model
WeightLoader = Callable[
    ["ModelConfig", "type[nn.Module]", "type[AttentionBackend]", "torch.dtype", "torch.device",
     "bool | None"],
    "nn.Module",
]


def weight_format(cfg: ModelConfig) -> str:
    """The format whose loader reads `cfg`'s weights; ValueError when `load_format` names one
    the files are not in."""
    if cfg.load_format == "dummy":
        return "dummy"
    found = "gguf" if cfg.is_gguf else "safetensors"
    if cfg.load_format not in ("auto", found):
        raise ValueError(f"load_format={cfg.load_format!r}, but {cfg.path!r} holds {found} weights")
    return found


def _load_safetensors(cfg, model_cls, attn_backend, dtype, device, progress):
    from ember.models.loader import (
        beyond_num_layers,
        check_safetensors,
        iter_safetensors,
        load_model,
        safetensors_files,
    )

    if getattr(cfg, "hub", None) is not None:  # a hub name: the shards come now, not before
        from ember.models.loader.hub import fetch_weights

        fetch_weights(cfg.hub, progress)
    files = safetensors_files(cfg.path)
    check_safetensors(files)
    # Layers that hf_overrides cut off are never read from disk.
    weights = iter_safetensors(files, progress, beyond_num_layers(cfg.hf_config))
    return load_model(cfg.hf_config, model_cls, attn_backend, dtype, device, weights=weights)


def _load_gguf(cfg, model_cls, attn_backend, dtype, device, progress):
    from ember.models.loader import beyond_num_layers, load_model
    from ember.models.loader.gguf import iter_gguf_weights

    weights = iter_gguf_weights(cfg.path, cfg.hf_config, progress=progress,
                                skip=beyond_num_layers(cfg.hf_config))
    return load_model(cfg.hf_config, model_cls, attn_backend, dtype, device, weights=weights)


def _load_dummy(cfg, model_cls, attn_backend, dtype, device, progress):
    from ember.models.loader import load_model

    return load_model(cfg.hf_config, model_cls, attn_backend, dtype, device, load_format="dummy")


WEIGHT_LOADERS: dict[str, WeightLoader] = {
    "safetensors": _load_safetensors,
    "gguf": _load_gguf,
    "dummy": _load_dummy,
}


def load_weights(
    cfg: ModelConfig,
    model_cls: type[nn.Module],
    attn_backend: type[AttentionBackend],
    dtype: torch.dtype,
    device: torch.device,
    progress: bool | None = None,
) -> nn.Module:
    """Build `model_cls` on `device` and fill it with the loader for `cfg`'s weight format.
    `progress`: show a progress bar; None follows EMBER_DISABLE_PROGRESS."""
    loader = WEIGHT_LOADERS[weight_format(cfg)]
    return loader(cfg, model_cls, attn_backend, dtype, device, progress)
