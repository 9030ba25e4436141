"""GemmaForCausalLM for ember: paged attention through ember's Attention layer and rotary
embedding, with Gemma's own pieces written here.

What Gemma changes from Llama, each matched to HF transformers' GemmaForCausalLM:
- embeddings are multiplied by sqrt(hidden_size), rounded to the model dtype first;
- RMSNorm scales by (1 + weight), and multiplies before casting back (Llama casts first);
- the MLP is GeGLU with the tanh approximation of GELU;
- head_dim is explicit (256 in the released models), and lm_head is tied to the embeddings.
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


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, attn_backend: type, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = config.head_dim
        self.sizes = [self.num_heads * self.head_size] + [self.num_kv_heads * self.head_size] * 2
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.sizes), bias, dtype=dtype)
        self.o_proj = nn.Linear(self.sizes[0], config.hidden_size, bias, dtype=dtype)
        self.attn = Attention(self.num_heads, self.head_size, self.head_size**-0.5,
                              self.num_kv_heads, layer_idx, attn_backend)

    def shard_sizes(self) -> list[int]:
        return self.sizes

    def forward(self, x, rope: RotaryEmbedding, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = rope.apply(q.view(t, self.num_heads, self.head_size), cos, sin)
        k = rope.apply(k.view(t, self.num_kv_heads, self.head_size), cos, sin)
        return self.o_proj(self.attn(q, k, v, ctx))


class GemmaMLP(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in ("gelu_pytorch_tanh", "gelu"):  # HF maps legacy "gelu" to the tanh form
            raise ValueError(f"unsupported Gemma activation {act!r}")
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, False, dtype=dtype)
        self.down_proj = nn.Linear(self.intermediate, config.hidden_size, False, dtype=dtype)

    def shard_sizes(self) -> list[int]:
        return [self.intermediate, self.intermediate]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, attn_backend: type, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = GemmaAttention(config, layer_idx, attn_backend, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps,
                                                     dtype)
        self.mlp = GemmaMLP(config, dtype)

    def forward(self, h, rope, cos, sin, ctx):
        h = h + self.self_attn(self.input_layernorm(h), rope, cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class GemmaModel(nn.Module):
    def __init__(self, config: Any, attn_backend: type, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, attn_backend, dtype)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding.from_config(config, config.head_dim)
        self.normalizer = config.hidden_size**0.5

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # HF rounds the scale to the model dtype before multiplying (sqrt(3072) -> 55.5 in bf16).
        h = h * torch.tensor(self.normalizer, dtype=h.dtype, device=h.device)
        cos, sin = self.rotary_emb.cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, self.rotary_emb, cos, sin, ctx)
        return self.norm(h)


class GemmaForCausalLM(nn.Module):
    """ember's model interface: (config, attn_backend, dtype), forward, compute_logits,
    load_weights, and the KV geometry attributes the engine sizes its cache from."""

    def __init__(self, config: Any, attn_backend: type, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, attn_backend, dtype)
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_size: int = config.head_dim
        self.sliding_windows: list[int | None] = [None] * config.num_hidden_layers

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.model.embed_tokens.weight).float()  # tied lm_head

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                continue  # tied to embed_tokens / recomputed
            parts = name.split(".")
            shard = None
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                parts[-2] = fused
            target = ".".join(parts)
            if target not in params:
                raise ValueError(f"unknown Gemma weight {name!r}")
            dst = params[target].data
            if shard is not None:
                owner = self.get_submodule(target.rsplit(".", 2)[0])
                sizes = owner.shard_sizes()
                dst = dst.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"Gemma weight {name!r}: shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        missing = self._expected_names() - loaded
        if missing:
            raise ValueError(f"Gemma weights missing: {', '.join(sorted(missing)[:10])}")
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
