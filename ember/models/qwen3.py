"""Qwen3ForCausalLM: the Llama-family decoder with per-head RMSNorm on q and k before rope."""

from __future__ import annotations

from ember.models.llama import DecoderSpec, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    # q/k/v/o biases follow config.attention_bias (False in released checkpoints).
    spec = DecoderSpec(mlp_bias=False, qk_norm=True)
