"""Deprecated: the attention kernels moved to ember.kernels (store_kv, prefill_attention,
decode_attention). This package and its modules re-export them under their old names.
"""

import warnings

from ember.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    decode_workspace_numel,
    paged_decode_attention,
)
from ember.kernels.prefill_attention import PrefillConfig, paged_prefill_attention
from ember.kernels.store_kv import store_kv
from ember.kernels.tuning import default_tuning

warnings.warn("ember.attention_backends.triton_ops is deprecated: use ember.kernels.store_kv, "
              "ember.kernels.prefill_attention and ember.kernels.decode_attention",
              DeprecationWarning, stacklevel=2)

DECODE_CONFIGS = dict(default_tuning().decode)
DECODE_SPLIT_CONFIGS = dict(default_tuning().decode_split)
PREFILL_CONFIGS = dict(default_tuning().prefill)

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
