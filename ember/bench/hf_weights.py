"""The weights ember loads, in HF's naming, so HF transformers can run on exactly the same tensors."""

from __future__ import annotations


def ember_weights_for_hf(model_config) -> dict:
    """HF state dict for a model config: the GGUF dequantized, or the safetensors as stored."""
    import torch

    if model_config.is_gguf:
        from ember.models.loader.gguf import iter_gguf_weights

        pairs = iter_gguf_weights(model_config.path, model_config.hf_config)
    else:
        from ember.models.loader import iter_safetensors, safetensors_files

        pairs = iter_safetensors(safetensors_files(model_config.path))
    return {name: tensor.to(torch.float32) for name, tensor in pairs}
