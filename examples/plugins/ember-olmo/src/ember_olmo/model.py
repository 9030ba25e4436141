"""OlmoForCausalLM for ember: paged attention through ember's Attention layer and rotary
embedding, with OLMo's own pieces written here.

What OLMo (v1) changes from Llama, each matched to HF transformers' OlmoForCausalLM:
- its norms are LayerNorms with no weight and no bias (eps 1e-5), computed in float32;
- q, k and v may be clamped to [-clip_qkv, clip_qkv] before rope (config.clip_qkv);
- the lm_head is tied to the embeddings only when the config says so.
Weights: HF's q/k/v and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.attention import Attention, ForwardContext
from ember.layers.rotary import RotaryEmbedding

# HF name of a projection -> (our fused parameter, shard index)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def olmo_layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm without parameters, in float32 as HF computes it."""
    return F.layer_norm(x.float(), (x.shape[-1],), None, None, eps=1e-5).to(x.dtype)


class OlmoAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, attn_backend: type, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_size = config.hidden_size // self.num_heads
        self.sizes = [self.num_heads * self.head_size] + [self.num_kv_heads * self.head_size] * 2
        bias = bool(config.attention_bias)
        self.clip = config.clip_qkv
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias, dtype=dtype)
        self.o_proj = nn.Linear(self.sizes[0], config.hidden_size, bias, dtype=dtype)
        self.attn = Attention(self.num_heads, self.head_size, self.head_size**-0.5,
                              self.num_kv_heads, layer_idx, attn_backend)

    def shard_sizes(self) -> list[int]:
        return self.sizes

    def forward(self, x, rope: RotaryEmbedding, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = rope.apply(q.reshape(t, self.num_heads, self.head_size), cos, sin)
        k = rope.apply(k.reshape(t, self.num_kv_heads, self.head_size), cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx))


class OlmoMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported OLMo activation {config.hidden_act!r}")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, False, dtype=dtype)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, False, dtype=dtype)

    def shard_sizes(self) -> list[int]:
        return [self.intermediate, self.intermediate]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class OlmoDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, attn_backend: type, dtype: torch.dtype):
        super().__init__()
        self.self_attn = OlmoAttention(config, layer_idx, attn_backend, dtype)
        self.mlp = OlmoMLP(config, dtype)

    def forward(self, h, rope, cos, sin, ctx):
        h = h + self.self_attn(olmo_layer_norm(h), rope, cos, sin, ctx)
        return h + self.mlp(olmo_layer_norm(h))


class OlmoModel(nn.Module):
    def __init__(self, config: Any, attn_backend: type, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(OlmoDecoderLayer(config, i, attn_backend, dtype)
                                    for i in range(config.num_hidden_layers))
        head_size = config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding.from_config(config, head_size)

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, self.rotary_emb, cos, sin, ctx)
        return olmo_layer_norm(h)


class OlmoForCausalLM(nn.Module):
    """ember's model interface: (config, attn_backend, dtype), forward, compute_logits,
    load_weights, and the KV geometry attributes the engine sizes its cache from."""

    def __init__(self, config: Any, attn_backend: type, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = OlmoModel(config, attn_backend, dtype)
        self.tied = bool(config.tie_word_embeddings)
        if not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, False, dtype=dtype)
        first = self.model.layers[0].self_attn
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = first.num_kv_heads
        self.head_size: int = first.head_size
        self.sliding_windows: list[int | None] = [None] * config.num_hidden_layers

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens if self.tied else self.lm_head
        return F.linear(hidden, head.weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if (name == "lm_head.weight" and self.tied) or name.endswith("rotary_emb.inv_freq"):
                continue  # tied to embed_tokens / recomputed
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                parts[-2] = fused
            target = ".".join(parts)
            if target not in params:
                raise ValueError(f"unknown OLMo weight {name!r}")
            dst = params[target].data
            if shard is not None:
                owner = self.get_submodule(target.rsplit(".", 2)[0])
                sizes = owner.shard_sizes()
                dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"OLMo weight {name!r}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        missing = self._expected_names() - loaded
        if missing:
            raise ValueError(f"OLMo weights missing: {', '.join(sorted(missing)[:10])}")
        return loaded

    def _expected_names(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _UNFUSED:
                names |= {".".join([*parts[:-2], p, parts[-1]]) for p in _UNFUSED[parts[-2]]}
            else:
                names.add(name)
        return names
