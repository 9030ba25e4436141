"""Deprecated alias of ember.kernels.prefill_attention (tables: ember.kernels.tuning)."""

from ember.attention_backends.triton_ops import PREFILL_CONFIGS
from ember.kernels.prefill_attention import PrefillConfig, paged_prefill_attention

__all__ = ["PREFILL_CONFIGS", "PrefillConfig", "paged_prefill_attention"]
