"""MixtralForCausalLM: Mistral's attention (sliding window from the config, no biases) with a
mixture of ``num_local_experts`` SwiGLU experts in every layer, top ``num_experts_per_tok``
(2 in released checkpoints) renormalised, the routing weights kept in float32 as HF does.

Checkpoints name the block ``block_sparse_moe`` and the experts' projections w1 (gate), w3 (up)
and w2 (down).
"""

from __future__ import annotations

from typing import Any

from ember.models.llama import DecoderSpec
from ember.models.moe_decoder import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    spec = DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False)
    moe_block_name = "block_sparse_moe"
    expert_projections = {"w1": 0, "w3": 1, "w2": None}
    routing_weights_in_activation_dtype = False

    @classmethod
    def moe_shape(cls, config: Any) -> tuple[int, int, int, bool]:
        return config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True
