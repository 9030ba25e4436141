"""Triton kernels of the paged attention path: KV store, prefill (any query length), decode.

Importing this package imports triton; the backend imports it only when it is chosen.
"""

from ember.attention_backends.triton_ops.decode import (
    DECODE_CONFIGS,
    DECODE_SPLIT_CONFIGS,
    DecodeConfig,
    choose_num_splits,
    decode_workspace_numel,
    paged_decode_attention,
)
from ember.attention_backends.triton_ops.prefill import (
    PREFILL_CONFIGS,
    PrefillConfig,
    paged_prefill_attention,
)
from ember.attention_backends.triton_ops.store_kv import store_kv

__all__ = [
    "DECODE_CONFIGS",
    "DECODE_SPLIT_CONFIGS",
    "PREFILL_CONFIGS",
    "DecodeConfig",
    "PrefillConfig",
    "choose_num_splits",
    "decode_workspace_numel",
    "paged_decode_attention",
    "paged_prefill_attention",
    "store_kv",
]
