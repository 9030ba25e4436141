"""Gemma3ForCausalLM (text): the Gemma decoder with per-head q/k norms and separate rope bases
for local (sliding-window) and global layers (ember.models.gemma_common); and
Gemma3ForConditionalGeneration (the 4B/12B/27B checkpoints) run as text only: its registry entry
declares ``text_config``, so ember.config hands the model the checkpoint's text config, and the
vision tower's and projector's weights are skipped. Image inputs are not supported.

HF's Gemma 3 reads no attn_logit_softcapping (released configs set none), so neither does this;
final_logit_softcapping is applied when set.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ember.models.gemma_common import GemmaForCausalLM, GemmaSpec

# Checkpoint prefixes of the multimodal model: the language model's (both layouts transformers
# has saved), and the vision parts, which a text-only run never reads.
_RENAMES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")


class Gemma3ForCausalLM(GemmaForCausalLM):
    gemma_spec = GemmaSpec(qk_norm=True, attn_soft_cap=False, per_layer_rope=True)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint (built from its text config)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_text_weights(weights))


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]
                  ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    for name, tensor in weights:
        if name.startswith(_VISION):
            continue
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor
