"""Deprecated alias of ember.kernels.decode_attention (tables: ember.kernels.tuning)."""

from ember.attention_backends.triton_ops import DECODE_CONFIGS, DECODE_SPLIT_CONFIGS
from ember.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    decode_workspace_numel,
    default_config,
    paged_decode_attention,
)
from ember.kernels.tuning import default_tuning

DECODE_LATENCY_CONFIGS = dict(default_tuning().decode_latency)

__all__ = [
    "DECODE_CONFIGS",
    "DECODE_LATENCY_CONFIGS",
    "DECODE_SPLIT_CONFIGS",
    "DecodeConfig",
    "choose_num_splits",
    "decode_workspace_numel",
    "default_config",
    "paged_decode_attention",
]
