"""GGUF checkpoints: parse the header, build the model config from its metadata, and yield its tensors
in HF layout, one at a time: dequantized to float32, or (inside ``keep_quantized()``, which the
``gguf`` quantization method opens while the model loads) the quantized weights of the decoder's
linear layers as their raw blocks (uint8 [rows, row bytes], tagged with ``gguf_qtype``).

The header is parsed by ember.models.loader.gguf_header (ours, not ``gguf.GGUFReader``: faster,
and damage is a ``ValueError`` naming the file). Dequantization is ember's torch block decoder
(ember.quantization.gguf_blocks) for the types it knows and ``gguf.quants.dequantize`` for the
rest; the two are bit-identical (tested), so the numbers are what transformers produces from the
same file.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf.constants import GGMLQuantizationType

from ember.models.loader.gguf_config import GGUFModelConfig
from ember.models.loader.gguf_header import (
    GGUFHeader,
    GGUFTensorInfo,
    corrupt_error,
    read_gguf_header,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

__all__ = ["GGUFHeader", "GGUFTensorInfo", "gguf_hf_config", "gguf_model_config", "hf_model_type",
           "hf_param_name", "iter_gguf_weights", "keep_quantized", "read_gguf_header"]

# ---------------------------------------------------------------------------------------------
# Config

# GGUF architecture -> (HF model_type, HF architecture class, metadata key holding head_dim)
_ARCHS: dict[str, tuple[str, str, str | None]] = {
    "llama": ("llama", "LlamaForCausalLM", "rope.dimension_count"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", None),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "attention.key_length"),
}
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_IDS = ("bos", "eos", "padding", "unknown")


def hf_model_type(gguf_architecture: str) -> str | None:
    """The HF model_type ember maps a GGUF architecture to, or None if it has no mapping."""
    spec = _ARCHS.get(gguf_architecture)
    return spec[0] if spec else None


def gguf_hf_config(path: str) -> PretrainedConfig:
    """The transformers config described by the GGUF metadata (what transformers builds too)."""
    return gguf_model_config(path).to_transformers()


def gguf_model_config(path: str) -> GGUFModelConfig:
    """The config the engine runs a GGUF file with: gguf_hf_config's values without importing
    transformers' config classes (ember.models.loader.gguf_config)."""
    header = read_gguf_header(path)
    arch, meta = header.architecture, header.metadata
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF file {path!r} has architecture {arch!r}, which ember cannot load "
            f"(supported: {', '.join(sorted(_ARCHS))})"
        )
    model_type, hf_arch, head_dim_key = _ARCHS[arch]
    kwargs: dict[str, Any] = {"architectures": [hf_arch]}
    for gguf_key, hf_key in _CONFIG_KEYS.items():
        if f"{arch}.{gguf_key}" in meta:
            kwargs[hf_key] = meta[f"{arch}.{gguf_key}"]
    if head_dim_key and f"{arch}.{head_dim_key}" in meta:
        kwargs["head_dim"] = meta[f"{arch}.{head_dim_key}"]
    if "vocab_size" not in kwargs and "tokenizer.ggml.tokens" in meta:
        kwargs["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    for name in _TOKEN_IDS:
        if f"tokenizer.ggml.{name}_token_id" in meta:
            hf_name = {"padding": "pad", "unknown": "unk"}.get(name, name)
            kwargs[f"{hf_name}_token_id"] = meta[f"tokenizer.ggml.{name}_token_id"]
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in header.tensors:
        # transformers ignores these too; short contexts are unaffected.
        logger.warning(
            "GGUF file %s: its rope scaling (%s) is not applied; outputs past the original "
            "context length may differ from llama.cpp's",
            path,
            "rope_freqs tensor" if scaling == "none" else scaling,
        )
    # llama.cpp drops output.weight when the head shares the embedding matrix.
    kwargs["tie_word_embeddings"] = "output.weight" not in header.tensors
    missing = [
        k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if k not in kwargs
    ]
    if missing:
        raise ValueError(f"GGUF file {path!r} lacks metadata for {missing} ({arch}.* keys)")
    return GGUFModelConfig(model_type, **kwargs)


# ---------------------------------------------------------------------------------------------
# Weights

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def hf_param_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors HF models have no slot for."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute_rope(w: np.ndarray, n_head: int, path: str, name: str) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF's rotary embedding pairs dimension i with i + d/2 inside each head; llama.cpp's converter
    reorders each head's rows so the pairs sit side by side (its rope is GPT-J style). Putting
    the rows back gives exactly the matrix HF loads, so HF's rotary code applies unchanged."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(
            f"GGUF file {path!r}: {name} has {rows} rows, not a multiple of 2 x {n_head} heads"
        )
    # llama.cpp did reshape(n_head, 2, half, ...).swapaxes(1, 2); this is its inverse.
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF names of the decoder's linear weights: the ones the gguf method keeps quantized.
_LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
_FLOAT_QTYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_KEEP_QUANTIZED: list[bool] = []


@contextlib.contextmanager
def keep_quantized() -> Iterator[None]:
    """Within the block, ``iter_gguf_weights`` yields quantized linear weights as raw blocks."""
    _KEEP_QUANTIZED.append(True)
    try:
        yield
    finally:
        _KEEP_QUANTIZED.pop()


def _raw_blocks(path: str, f: Any, info: GGUFTensorInfo) -> np.ndarray:
    """uint8 [rows, row bytes]: the tensor's blocks as stored (rows stay whole blocks)."""
    f.seek(info.offset)
    raw = f.read(info.nbytes)
    if len(raw) != info.nbytes:  # the file shrank since the header was validated
        raise corrupt_error(path, f"tensor {info.name!r} is cut short")
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    return np.frombuffer(raw, dtype=np.uint8).reshape(rows, -1)


def _dequantize(path: str, f: Any, info: GGUFTensorInfo) -> np.ndarray:
    import torch
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    from ember.quantization import gguf_blocks

    if info.qtype in gguf_blocks.SUPPORTED and info.qtype not in _FLOAT_QTYPES and (
            len(info.shape) == 2):
        # ember's torch decoder: bit-identical to the gguf package's (tests check every type)
        # and several times faster than its numpy (1.5 s for the default model's embedding).
        raw = torch.from_numpy(_raw_blocks(path, f, info).copy())
        return gguf_blocks.dequantize(raw, info.qtype, tuple(info.shape)).numpy()
    f.seek(info.offset)
    raw = f.read(info.nbytes)
    if len(raw) != info.nbytes:  # the file shrank since the header was validated
        raise corrupt_error(path, f"tensor {info.name!r} is cut short")
    data = np.frombuffer(raw, dtype=np.uint8).reshape(
        quant_shape_to_byte_shape(info.shape, info.qtype)
    )
    try:
        out = dequantize(data, info.qtype)
    except NotImplementedError as e:
        raise NotImplementedError(
            f"GGUF file {path!r}: tensor {info.name!r} has type {info.qtype.name}, "
            "which the gguf package cannot dequantize"
        ) from e
    return out.reshape(info.shape).astype(np.float32, copy=False)


def iter_gguf_weights(
    path: str, config: PretrainedConfig, *, progress: bool | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, float32 tensor in HF layout) for every tensor, one at a time.

    Only one tensor is dequantized at a time, so peak memory is the largest tensor, not the model.
    Tensors with no HF parameter (e.g. llama.cpp's ``rope_freqs``) are skipped with a warning.
    `progress`: show a tqdm bar; None follows EMBER_DISABLE_PROGRESS. HF names for which `skip`
    is true are not dequantized (layers that hf_overrides cut off)."""
    import torch
    from tqdm.auto import tqdm

    from ember import envs

    if progress is None:
        progress = not envs.disable_progress_bars()
    header = read_gguf_header(path)
    permute = header.architecture == "llama"  # qwen GGUFs keep HF's (NeoX) rope layout
    n_head = config.num_attention_heads
    n_kv_head = getattr(config, "num_key_value_heads", None) or n_head
    skipped = []
    with open(path, "rb") as f:
        bar = tqdm(
            header.tensors.values(),
            desc="Loading GGUF tensors",
            unit="tensor",
            disable=not progress,
        )
        for info in bar:
            hf_name = hf_param_name(info.name)
            if hf_name is None:
                skipped.append(info.name)
                continue
            if skip is not None and skip(hf_name):
                continue
            raw = (bool(_KEEP_QUANTIZED) and info.qtype not in _FLOAT_QTYPES
                   and _LINEAR_WEIGHT.match(hf_name) is not None)
            w = _raw_blocks(path, f, info) if raw else _dequantize(path, f, info)
            if permute and ".attn_q." in info.name:
                w = _unpermute_rope(w, n_head, path, info.name)
            elif permute and ".attn_k." in info.name:
                w = _unpermute_rope(w, n_kv_head, path, info.name)
            if raw:
                tensor = torch.from_numpy(np.ascontiguousarray(w).copy())
                tensor.gguf_qtype = info.qtype  # type: ignore[attr-defined]
                tensor.gguf_shape = info.shape  # type: ignore[attr-defined]
                yield hf_name, tensor
                continue
            # F32/F16 come back as read-only views of the read buffer: copy only those.
            yield hf_name, torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
    if skipped:
        logger.warning("GGUF file %s: skipped tensors with no HF parameter: %s", path, skipped)
