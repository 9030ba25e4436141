"""The Gemma 2 / Gemma 3 decoder (text): what both share, switched by a ``GemmaSpec``.

Against the Llama family: RMSNorm scales by (1 + weight) and multiplies before casting back;
embeddings are scaled by sqrt(hidden_size); every block has four norms (the attention and MLP
outputs are normed before the residual add); the MLP is GeGLU (tanh-approximated GELU);
attention scores are scaled by query_pre_attn_scalar**-0.5 instead of head_dim**-0.5; layers
alternate sliding-window and global attention (``config.layer_types``); Gemma 2 soft-caps the
attention scores and the final logits (cap * tanh(x / cap)); Gemma 3 norms q and k per head and
gives local and global layers their own rope base (and scaling).

Weight loading is the shared loop of ember.models.hf_weights (each HF tensor to its parameter's
``weight_loader``, with its shard index within the fused qkv / gate_up projection).
Tensor and pipeline parallelism are not implemented for these models (supports_* = False).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ember.attention_backends.base import AttentionBackend
from ember.layers.attention import Attention, ForwardContext
from ember.layers.linear import Linear, compute_logits
from ember.layers.rotary import RotaryEmbedding
from ember.models.hf_weights import FusedHFWeightsMixin
from ember.models.llama import layer_sliding_window

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}
_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GemmaSpec:
    qk_norm: bool  # Gemma 3: (1 + weight) RMSNorm over each head of q and k before rope
    attn_soft_cap: bool  # Gemma 2: config.attn_logit_softcapping reaches attention
    per_layer_rope: bool  # Gemma 3: rope_parameters per layer type


class GemmaRMSNorm(nn.Module):
    """HF's Gemma RMSNorm: float32 statistics, x * (1 + weight) in float32, then the cast."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def _activation(config: Any) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in _GELU:
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma; "
                         f"supported: {', '.join(_GELU)}")
    return _GELU[act]


class GemmaMLP(nn.Module):
    """down(gelu(gate(x)) * up(x)) with gate and up as one fused projection."""

    def __init__(self, config: Any, dtype: torch.dtype, prefix: str = "") -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.approximate = _activation(config)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, False,
                                   dtype=dtype, output_sizes=self.shard_sizes(),
                                   prefix=f"{prefix}.gate_up_proj")
        self.down_proj = Linear(self.intermediate_size, config.hidden_size, False, dtype=dtype,
                                prefix=f"{prefix}.down_proj")

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.shard_sizes(), dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, spec: GemmaSpec, layer_idx: int,
                 attn_backend: type[AttentionBackend], dtype: torch.dtype,
                 prefix: str = "") -> None:  # fmt: skip
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // self.num_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, bias, dtype=dtype,
                               output_sizes=self.shard_sizes(), prefix=f"{prefix}.qkv_proj")
        self.o_proj = Linear(self.q_size, hidden, bias, dtype=dtype, prefix=f"{prefix}.o_proj")
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps, dtype)
        window = layer_sliding_window(config, layer_idx)
        self.layer_type = _LAYER_TYPES[0] if window is not None else _LAYER_TYPES[1]
        cap = getattr(config, "attn_logit_softcapping", None) if spec.attn_soft_cap else None
        self.attn = Attention(
            self.num_heads, self.head_size, config.query_pre_attn_scalar**-0.5,
            self.num_kv_heads, layer_idx, attn_backend, sliding_window=window,
            logits_soft_cap=cap or None,
        )

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.shard_sizes(), dim=-1)
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply_qk(q, k, cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: GemmaSpec, layer_idx: int,
                 attn_backend: type[AttentionBackend], dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = GemmaAttention(config, spec, layer_idx, attn_backend, dtype,
                                        prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GemmaMLP(config, dtype, prefix=f"{prefix}.mlp")
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, h: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor,
                sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        # HF's order: residual + norm(branch), so float32 results agree exactly.
        a = self.self_attn(self.input_layernorm(h), rope, cos, sin, ctx)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(m)


def _rope_params(config: Any, layer_type: str | None) -> dict[str, Any]:
    """The rope settings of one layer type (flat configs: the same for every layer)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    scaling = dict(params)
    scaling["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling["rope_type"] not in ("default", "linear"):
        raise ValueError(f"unsupported rope_type {scaling['rope_type']!r} for Gemma "
                         "(supported: default, linear)")
    return scaling


class GemmaModel(nn.Module):
    def __init__(self, config: Any, spec: GemmaSpec, attn_backend: type[AttentionBackend],
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding Gemma) is not "
                             "supported: ember's Gemma is a causal LM")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, device="cpu").to(dtype))
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, spec, i, attn_backend, dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        head_size = getattr(config, "head_dim", None) or config.hidden_size // \
            config.num_attention_heads
        types = _LAYER_TYPES if spec.per_layer_rope else (None,)
        ropes = {}
        for layer_type in types:
            scaling = _rope_params(config, layer_type)
            ropes[layer_type] = RotaryEmbedding(head_size, float(scaling["rope_theta"]), scaling)
        # Not submodules (they hold no parameters); one cos/sin per kind per step.
        self.ropes = ropes
        self.layer_rope = [
            layer.self_attn.layer_type if spec.per_layer_rope else None for layer in self.layers
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        h = self.embed_tokens(input_ids) * self.embed_scale
        cos_sin = {kind: rope.cos_sin(positions, h.dtype) for kind, rope in self.ropes.items()}
        for layer, kind in zip(self.layers, self.layer_rope):
            h = layer(h, self.ropes[kind], *cos_sin[kind], ctx)
        return self.norm(h)


class GemmaForCausalLM(FusedHFWeightsMixin, nn.Module):
    """Causal LM over ``GemmaModel``; parameter names follow HF's except the fused ones. The
    lm_head is tied to the embeddings unless the config says otherwise."""

    gemma_spec: ClassVar[GemmaSpec]
    supports_tensor_parallel: ClassVar[bool] = False
    supports_pipeline_parallel: ClassVar[bool] = False

    def __init__(self, config: Any, attn_backend: type[AttentionBackend],
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = GemmaModel(config, self.gemma_spec, attn_backend, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, False, dtype=dtype)
        self.final_soft_cap = getattr(config, "final_logit_softcapping", None) or None
        first = self.model.layers[0].self_attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = first.num_kv_heads
        self.head_size: int = first.head_size
        self.sliding_windows: list[int | None] = [
            layer.self_attn.attn.sliding_window for layer in self.model.layers
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        logits = compute_logits(head, hidden)
        if self.final_soft_cap is not None:
            # In float32 (HF: in the model's dtype; the same for float32 checkpoints).
            cap = self.final_soft_cap
            logits = torch.tanh(logits / cap) * cap
        return logits
