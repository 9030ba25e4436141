"""Gemma3ForCausalLM (text): the Gemma decoder with per-head q/k norms and separate rope bases
for local (sliding-window) and global layers (ember.models.gemma_common).

HF's Gemma 3 reads no attn_logit_softcapping (released configs set none), so neither does this;
final_logit_softcapping is applied when set. The multimodal Gemma3ForConditionalGeneration is not
registered: its checkpoints are refused by architecture name.
"""

from __future__ import annotations

from ember.models.gemma_common import GemmaForCausalLM, GemmaSpec


class Gemma3ForCausalLM(GemmaForCausalLM):
    gemma_spec = GemmaSpec(qk_norm=True, attn_soft_cap=False, per_layer_rope=True)
