"""Qwen3MoeForCausalLM: Qwen3's attention (per-head RMSNorm on q and k before rope) with
mixture-of-experts feed-forward layers.

A layer is sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``
stride (HF's rule); dense layers keep a SwiGLU MLP of ``intermediate_size``. Routing: softmax,
top ``num_experts_per_tok``, renormalised when ``norm_topk_prob``; experts of
``moe_intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from ember.models.llama import DecoderSpec
from ember.models.moe_decoder import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    # q/k/v/o biases follow config.attention_bias (False in released checkpoints).
    spec = DecoderSpec(mlp_bias=False, qk_norm=True)

    @classmethod
    def moe_shape(cls, config: Any) -> tuple[int, int, int, bool]:
        return (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                bool(config.norm_topk_prob))

    @classmethod
    def is_sparse_layer(cls, config: Any, layer_idx: int) -> bool:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
                and config.num_experts > 0 and (layer_idx + 1) % step == 0)
