"""The Llama-family decoder (Llama, SmolLM2, Mistral; Qwen2 and Qwen3 configure it) with paged
attention, fused qkv and gate_up projections, and HF-name weight loading.

Tensor parallelism: the projections are ember.layers.parallel_linear's (q/k/v and gate/up
column-parallel, o and down row-parallel), the embedding and LM head vocabulary-parallel, so each
rank holds its heads, its slice of the MLP and its KV heads. Pipeline parallelism: a stage builds
only its own decoder layers (others are empty placeholders, so parameter names stay HF's); a stage
after the first receives the hidden states and residual from the one before, a stage before the
last sends them on. Each stage's attention layers index its own KV caches from 0.

What differs between the family's architectures is a ``DecoderSpec`` (biases, per-head q/k norm);
``qwen2.py`` and ``qwen3.py`` are thin subclasses that set it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ember.attention_backends.base import AttentionBackend
from ember.distributed import parallel_state as ps
from ember.layers.activation import SiluAndMul
from ember.layers.attention import Attention, ForwardContext
from ember.layers.linear import QuantizedActivation
from ember.layers.norm import RMSNorm
from ember.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ember.layers.rotary import PendingRotation, RotaryEmbedding
from ember.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, parallel_logits
from ember.layers.weight_prefetch import join_prefetches, prefetch_weights
from ember.models.hf_weights import FusedHFWeightsMixin


@dataclass(frozen=True)
class DecoderSpec:
    """The switches that tell the family's architectures apart. None = read from the config."""

    qkv_bias: bool | None = None  # None: config.attention_bias
    o_bias: bool | None = None  # None: config.attention_bias
    mlp_bias: bool | None = None  # None: config.mlp_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope


def _cfg(config: Any, name: str, default: Any) -> Any:
    value = getattr(config, name, None)
    return default if value is None else value


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """The layer's window: Qwen2/3 list per-layer types, Mistral has one window for all."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and window is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, layer_idx: int,
                 attn_backend: type[AttentionBackend], dtype: torch.dtype,
                 prefix: str = "", cache_index: int | None = None) -> None:  # fmt: skip
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = _cfg(config, "num_key_value_heads", total_heads)
        self.head_size = _cfg(config, "head_dim", hidden // total_heads)
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias if spec.qkv_bias is None else spec.qkv_bias
        o_bias = attn_bias if spec.o_bias is None else spec.o_bias
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, total_heads, total_kv_heads,
                                          qkv_bias, dtype=dtype, prefix=f"{prefix}.qkv_proj")
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hidden, o_bias, dtype=dtype,
                                        prefix=f"{prefix}.o_proj")
        # The attention blocks after this one whose qkv_proj is read into L2 beside this one's
        # attention with o_proj (a plain list: not submodules). The model fills it.
        self.followed_by: list[DecoderAttention] = []
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, dtype)
        self.attn = Attention(
            self.num_heads, self.head_size, self.head_size**-0.5, self.num_kv_heads,
            layer_idx if cache_index is None else cache_index,
            attn_backend, sliding_window=layer_sliding_window(config, layer_idx),
        )

    def shard_sizes(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def forward(self, x: torch.Tensor | QuantizedActivation, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        # Where their methods want it (4-bit layers decoding one or two sequences), o_proj's
        # weight and the next qkv_proj's are read into L2 beside attention, whose short kernels
        # leave the memory idle (looked up here: a post-load quantization replaces layers).
        prefetch_weights([self.o_proj, *(after.qkv_proj for after in self.followed_by)], qkv)
        q, k, v = qkv.split(self.shard_sizes(), dim=-1)
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        # Qwen3's per-head norms go with the rotation (on CUDA, one kernel for the three),
        # which the attention backend may do as it attends.
        rotation = PendingRotation(rope, cos, sin,
                                   (self.q_norm, self.k_norm) if self.qk_norm else None)
        # A 4-bit o_proj takes the attention output in int8 where the backend writes it.
        return self.o_proj(self.attn(q, k, v, ctx, quant_for=self.o_proj, rotation=rotation))


class DecoderMLP(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, dtype: torch.dtype,
                 prefix: str = "") -> None:  # fmt: skip
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}: only silu is implemented")
        bias = bool(getattr(config, "mlp_bias", False)) if spec.mlp_bias is None else spec.mlp_bias
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, self.shard_sizes(), bias, dtype=dtype,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.intermediate_size = self.gate_up_proj.output_sizes[0]  # this rank's
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias,
                                           dtype=dtype, prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def shard_sizes(self) -> list[int]:
        return [self.intermediate_size, self.intermediate_size]

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x), quant_for=self.down_proj))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, layer_idx: int,
                 attn_backend: type[AttentionBackend], dtype: torch.dtype,
                 prefix: str = "", cache_index: int | None = None) -> None:  # fmt: skip
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = DecoderAttention(config, spec, layer_idx, attn_backend, dtype,
                                          prefix=f"{prefix}.self_attn", cache_index=cache_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = DecoderMLP(config, spec, dtype, prefix=f"{prefix}.mlp")

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """h: the previous layer's MLP output (the embeddings for the first layer, whose
        ``residual`` is None). Returns this layer's MLP output and the residual stream it is
        still to be added to: the next norm does that add (as vLLM does), so that on CUDA the
        add and the norm are one fused kernel. Without the fused kernels the arithmetic is
        HF's, op for op (branch + residual, then norm), so float32 results agree exactly."""
        # The norms are told the projection they feed: an fp8 one takes its input quantized by
        # the norm's kernel (ember.layers.norm).
        qkv_proj = self.self_attn.qkv_proj
        if residual is None:
            residual = h
            x = self.input_layernorm(h, quant_for=qkv_proj)
        else:
            x, residual = self.input_layernorm.forward_with_residual(h, residual, qkv_proj)
        h = self.self_attn(x, rope, cos, sin, ctx)
        after_norm = getattr(self.mlp, "forward_after_norm", None)
        if after_norm is not None:  # the block may fuse the norm (the MoE router does)
            return after_norm(h, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm.forward_with_residual(
            h, residual, self.mlp.gate_up_proj)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, attn_backend: type[AttentionBackend],
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.pp_size = ps.get_pp_size()
        self.first_stage, self.last_stage = ps.is_first_stage(), ps.is_last_stage()
        self.start_layer, self.end_layer = (
            ps.stage_layers(config.num_hidden_layers) if self.pp_size > 1
            else (0, config.num_hidden_layers))
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.first_stage or (tied and self.last_stage):  # the last stage's tied LM head
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                       dtype, prefix="model.embed_tokens")
        start = self.start_layer
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, i, attn_backend, dtype, prefix=f"model.layers.{i}",
                         cache_index=i - start)
            if start <= i < self.end_layer else StageMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        built = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        for layer, after in zip(built, built[1:]):
            layer.self_attn.followed_by.append(after.self_attn)
        if self.last_stage:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        head_size = (_cfg(config, "head_dim", config.hidden_size // config.num_attention_heads)
                     if config.num_hidden_layers else 0)
        self.rotary_emb = RotaryEmbedding.from_config(config, head_size)

    def owned_layers(self) -> list[nn.Module]:
        return list(self.layers)[self.start_layer:self.end_layer]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        if self.pp_size > 1:
            return self._stage_forward(input_ids, positions, ctx)
        h = self.embed_tokens(input_ids)
        # cos/sin once per step, shared by all layers.
        cos, sin = self.rotary_emb.cos_sin(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, self.rotary_emb, cos, sin, ctx)
        join_prefetches()
        if residual is None:  # no layers
            return self.norm(h)
        return self.norm.forward_with_residual(h, residual)[0]

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        """One pipeline stage: its layers between a receive from the stage before and a send
        to the stage after (the final norm on the last). A stage that is not the last returns
        its hidden states, which nothing reads (the runner samples on the last stage only)."""
        comm, tp = ps.get_comm(), ps.get_tp_size()
        residual: torch.Tensor | None = None
        if self.first_stage:
            h = self.embed_tokens(input_ids)
        else:
            shape = (input_ids.shape[0], self.hidden_size)
            h, residual = comm.recv([shape, shape], self.dtype, ps.get_rank() - tp)
        cos, sin = self.rotary_emb.cos_sin(positions, h.dtype)
        for layer in self.layers[self.start_layer:self.end_layer]:
            h, residual = layer(h, residual, self.rotary_emb, cos, sin, ctx)
        join_prefetches()
        if not self.last_stage:
            comm.send([h, residual], ps.get_rank() + tp)
            return h
        return self.norm.forward_with_residual(h, residual)[0]


class LlamaForCausalLM(FusedHFWeightsMixin, nn.Module):
    """Causal LM over ``DecoderModel``; parameter names follow HF's except the fused ones."""

    spec: ClassVar[DecoderSpec] = DecoderSpec()
    # Read by the engine: tensor_parallel_size > 1 needs a model that splits its layers.
    supports_tensor_parallel: ClassVar[bool] = True
    supports_pipeline_parallel: ClassVar[bool] = True

    def __init__(self, config: Any, attn_backend: type[AttentionBackend],
                 dtype: torch.dtype = torch.float32) -> None:  # fmt: skip
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = DecoderModel(config, self.spec, attn_backend, dtype)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings and self.model.last_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype,
                                          prefix="lm_head")
        # KV-cache geometry the engine sizes its cache from: this rank's layers and KV heads.
        owned = self.model.owned_layers()
        first = owned[0].self_attn
        self.num_layers: int = len(owned)
        self.num_kv_heads: int = first.num_kv_heads
        self.head_size: int = first.head_size
        self.sliding_windows: list[int | None] = [
            layer.self_attn.attn.sliding_window for layer in owned
        ]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:  # fmt: skip
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.model.last_stage:  # memory profiling only: the runner samples on the last
            return torch.zeros(hidden.shape[0], self.config.vocab_size, device=hidden.device)
        head = self.model.embed_tokens if self.tie_word_embeddings else self.lm_head
        return parallel_logits(head, hidden)

    # ---- weight loading ----------------------------------------------------------------------

    def _other_stage(self, name: str) -> bool:
        """Whether `name` belongs to a layer (or the embedding, norm, head) another pipeline
        stage holds."""
        model = self.model
        if model.pp_size == 1:
            return False
        parts = name.split(".")
        if name.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit():
            return not model.start_layer <= int(parts[2]) < model.end_layer
        return name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


class StageMissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds (no parameters, never called)."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's weights and layout; its sliding_window (maybe None) comes from config."""

    spec = DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False)
