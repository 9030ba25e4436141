"""Gemma2ForCausalLM: the Gemma decoder with soft-capped attention scores and final logits,
alternating sliding-window and global layers (ember.models.gemma_common)."""

from __future__ import annotations

from ember.models.gemma_common import GemmaForCausalLM, GemmaSpec


class Gemma2ForCausalLM(GemmaForCausalLM):
    gemma_spec = GemmaSpec(qk_norm=False, attn_soft_cap=True, per_layer_rope=False)
