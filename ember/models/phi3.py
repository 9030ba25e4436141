"""Phi3ForCausalLM: the Llama-family decoder whose checkpoints store q/k/v as one ``qkv_proj``
and gate/up as one ``gate_up_proj`` (the layout ember fuses Llama's into), with LongRoPE scaling
(ember.layers.rotary: short or long per-dimension factors, chosen once from max_model_len)."""

from __future__ import annotations

from typing import Any

from ember.models.llama import DecoderSpec, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    spec = DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False)
    # The checkpoint's fused tensors load whole (no shard index), which the tensor-parallel
    # slicing of a fused projection does not handle.
    supports_tensor_parallel = False
    supports_pipeline_parallel = False

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r} for Phi3: only silu is implemented")
        super().__init__(config, *args, **kwargs)

    def expected_weight_names(self) -> set[str]:
        # Our parameter names are the checkpoint's (no q/k/v or gate/up split to expect).
        names = {name for name, _ in self.named_parameters()}
        if self.tie_word_embeddings:
            names.discard("lm_head.weight")
        return names
