"""Rotary position embeddings with HF transformers' conventions (rotate_half, not interleaved).

Scaling types: "default", "linear", "llama3" (Llama 3.1) and "longrope" (Phi-3: per-dimension
short or long factors and a cos/sin scale; see ``longrope_inv_freq``). Settings come from
``config.rope_parameters`` (transformers 5) or ``config.rope_theta`` + ``config.rope_scaling``
(transformers 4). cos/sin are computed once per forward from the positions, in float32 exactly as
HF does, and shared by every layer; there is no position table, so no max-length limit and no
buffer to move between devices.

On CUDA in half precision ``apply_qk`` rotates q and k in place with one Triton kernel
(ember.kernels.rotary), bit-identical to the torch ops of ``apply``; on the CPU in float32 with
one native call (ember.kernels.cpu.layer_ops), bit-identical too.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from ember import kernels
from ember.kernels import dispatch
from ember.kernels.cpu import layer_ops
from ember.layers.norm import RMSNorm

_SUPPORTED = ("default", "linear", "llama3", "longrope")


def rope_settings(config: Any) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict with at least "rope_type") from an HF config of either era."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and "rope_theta" not in params:
        # Per-layer-type settings ({"full_attention": {...}, ...}): these models use one kind.
        nested = [v for v in params.values() if isinstance(v, dict)]
        params = params.get("full_attention", nested[0] if nested else params)
    if not isinstance(params, dict) or not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    scaling = dict(params)
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), scaling


def _inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # Same expression as HF (int64 arange cast to float32), so the frequencies are identical.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (exponents / rotary_dim))
    kind = scaling["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, blended, scaled)
    if kind == "longrope":
        factors = scaling["long_factor" if scaling.get("ember_use_long") else "short_factor"]
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"longrope: {len(factors)} factors for a rotary dim of {rotary_dim} "
                             f"(needs {rotary_dim // 2})")
        # HF's expression: 1 / (factors * theta ** (arange / dim)).
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu")
                      * theta ** (exponents / rotary_dim))
    raise ValueError(f"unsupported rope_type {kind!r}; supported: {', '.join(_SUPPORTED)}")


def longrope_settings(config: Any, scaling: dict[str, Any]) -> tuple[bool, float]:
    """(use the long factors, cos/sin scale) of a LongRoPE config.

    HF switches factors per forward pass on the batch's longest position; that cannot be kept
    with a paged cache (prefix-cached or chunked keys were rotated by an earlier pass), so, as
    vLLM does, the engine's context limit decides once: the long factors when max_model_len
    (``config.ember_max_model_len``, set by ember.config; max_position_embeddings when absent)
    exceeds original_max_position_embeddings. HF agrees token for token whenever every
    sequence stays within the original length (short) or every prompt passes it (long)."""
    original = scaling.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    if not original:
        raise ValueError("longrope scaling needs original_max_position_embeddings")
    max_len = getattr(config, "ember_max_model_len", None) or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / original
    scale = scaling.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return max_len > original, float(scale)


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, Hq, D] and k [T, Hk, D] as one [T, Hq + Hk, D] view when k's heads directly follow
    q's in memory (both views of one fused qkv output), else None. None under torch.compile:
    dynamo cannot trace data pointers, and inductor fuses the two rotations anyway."""
    if torch.compiler.is_compiling():
        return None
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.device != k.device:
        return None
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.stride()[1:] != k.stride()[1:]:
        return None
    if q.shape[0] > 1 and q.stride(0) != k.stride(0):  # a size-1 dim's stride is arbitrary
        return None
    head_stride = q.stride(1)
    if q.stride(2) != 1 or head_stride != q.shape[2]:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * head_stride * q.element_size():
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None  # two allocations that happen to touch: the joint view would overrun q's
    if q.shape[0] > 1 and q.stride(0) < (q.shape[1] + k.shape[1]) * head_stride:
        return None  # rows overlap: not two slices of one row
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` dims of each head; the rest pass through."""

    def __init__(
        self, head_size: int, theta: float, scaling: dict[str, Any] | None = None,
        rotary_dim: int | None = None, attention_scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        scaling = dict(scaling or {})
        scaling.setdefault("rope_type", "default")
        # A plain attribute, not a buffer: models are built on the meta device and materialised
        # with to_empty(), which would leave a buffer uninitialised. Moved lazily per device.
        self._inv_freq = _inv_freq(self.rotary_dim, theta, scaling)
        # LongRoPE multiplies cos and sin (in float32, before the cast) as HF does.
        self.attention_scaling = attention_scaling
        self._per_device: dict[torch.device, torch.Tensor] = {}
        self.use_kernel = dispatch.layer_kernels_enabled()
        self.use_cpu_ops = layer_ops.configured()

    @classmethod
    def from_config(cls, config: Any, head_size: int) -> RotaryEmbedding:
        theta, scaling = rope_settings(config)
        partial = scaling.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1))
        attention_scaling = 1.0
        if scaling["rope_type"] == "longrope":
            scaling["ember_use_long"], attention_scaling = longrope_settings(config, scaling)
        return cls(head_size, theta, scaling, int(head_size * (partial or 1.0)), attention_scaling)

    def inv_freq_on(self, device: torch.device) -> torch.Tensor:
        """The inverse frequencies on ``device``, copied there once. (Called for the model's
        device before torch.compile traces it: a copy made while tracing would change the
        cache the trace was guarded on, and the next call would compile it again.)"""
        inv = self._per_device.get(device)
        if inv is None:
            inv = self._per_device.setdefault(device, self._inv_freq.to(device))
        return inv

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [T, 1, rotary_dim // 2] (broadcast over heads), in ``dtype``."""
        inv = self.inv_freq_on(positions.device)
        if (self.use_cpu_ops and dtype == torch.float32 and positions.dtype == torch.int64
                and positions.dim() == 1 and positions.is_contiguous() and layer_ops.takes(inv)):
            return layer_ops.cos_sin(positions, inv, self.attention_scaling)
        freqs = positions.float()[:, None] * inv
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_size]. Equals HF's ``x * cos + rotate_half(x) * sin``."""
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_size:
            parts.append(x[..., self.rotary_dim :])
        return torch.cat(parts, dim=-1)

    def apply_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        qk_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``apply`` to q and k, after ``qk_norms`` = (q_norm, k_norm) over each head where
        given (Qwen3). With the fused kernel or the native CPU op they are rotated (and normed)
        in place (they may be views of the fused qkv output) and returned; otherwise new tensors
        are returned."""
        if self.use_kernel and dispatch.takes_kernel(q):
            if qk_norms is not None and not self._norm_fuses(q, qk_norms):
                q, k = qk_norms[0](q), qk_norms[1](k)
                qk_norms = None
            weights = None if qk_norms is None else (qk_norms[0].weight, qk_norms[1].weight)
            eps = 0.0 if qk_norms is None else qk_norms[0].eps
            kernels.rotary.rotary_inplace(q, k, cos, sin, self.rotary_dim, weights, eps)
            return q, k
        if qk_norms is not None:
            q, k = qk_norms[0](q), qk_norms[1](k)
        if (self.use_cpu_ops and layer_ops.takes(q) and layer_ops.rotary_fits(q, cos)
                and layer_ops.rotary_fits(k, cos) and sin.is_contiguous()):
            # In place, as the CUDA kernel: q and k in one native call.
            layer_ops.rotary_inplace(q, k, cos, sin, self.rotary_dim)
            return q, k
        joint = _adjacent_heads(q, k)
        if joint is not None:
            # One pass over q's and k's heads together: the same arithmetic per element, half
            # the torch calls (a CPU decode step is bound by their count, not their work).
            rotated = self.apply(joint, cos, sin)
            return rotated[:, : q.shape[1]], rotated[:, q.shape[1] :]
        return self.apply(q, cos, sin), self.apply(k, cos, sin)

    def _norm_fuses(self, q: torch.Tensor, qk_norms: tuple[RMSNorm, RMSNorm]) -> bool:
        """Whether the rotary kernel can do these norms too: plain RMSNorms over whole heads
        that all rotate, with one eps and weights in q's dtype."""
        q_norm, k_norm = qk_norms
        return (type(q_norm) is RMSNorm and type(k_norm) is RMSNorm
                and q_norm.eps == k_norm.eps and self.rotary_dim == self.head_size
                and q_norm.weight.dtype == k_norm.weight.dtype == q.dtype
                and q_norm.weight.shape == k_norm.weight.shape == (self.head_size,))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        return self.apply(q, cos, sin), self.apply(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, rotary_dim={self.rotary_dim}"


class PendingRotation(NamedTuple):
    """A rotation of q and k that the attention layer does, or hands to its backend to do as
    it attends (``AttentionImpl.fuses_rotary``): one kernel fewer a layer."""

    rope: RotaryEmbedding
    cos: torch.Tensor
    sin: torch.Tensor
    qk_norms: tuple[RMSNorm, RMSNorm] | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope.apply_qk(q, k, self.cos, self.sin, self.qk_norms)

    def tables_to_hand_over(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) where a backend may rotate in the rotary kernel's place: where that
        kernel would run (CUDA, half precision, the layer kernels on), with no norm before it.
        Otherwise None: the layer rotates."""
        if self.qk_norms is None and self.rope.use_kernel and dispatch.takes_kernel(q):
            return self.cos, self.sin
        return None
