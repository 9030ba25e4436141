"""Qwen2ForCausalLM: the Llama-family decoder with biases on the q/k/v projections only."""

from __future__ import annotations

from ember.models.llama import DecoderSpec, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    spec = DecoderSpec(qkv_bias=True, o_bias=False, mlp_bias=False)
