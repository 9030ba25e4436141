"""Deprecated: the fused kernels moved to ember.kernels (one module per op).

Kept so that code importing ``ember.layers.fused_ops`` keeps working; each name resolves to its
new home on first use (so importing this module still imports no triton) and importing it warns.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

warnings.warn("ember.layers.fused_ops is deprecated: the kernels live in ember.kernels "
              "(rms_norm, rotary, silu_and_mul, argmax, launch)", DeprecationWarning, stacklevel=2)

_MOVED = {
    "rms_norm": "ember.kernels.rms_norm",
    "fused_add_rms_norm": "ember.kernels.rms_norm",
    "rotary_inplace": "ember.kernels.rotary",
    "silu_and_mul": "ember.kernels.silu_and_mul",
    "argmax_rows": "ember.kernels.argmax",
    "greedy_argmax": "ember.layers.sampler",
    "pdl_options": "ember.kernels.launch",
    "merge_counters": "ember.kernels.launch",
    "compiled_for_gpu": "ember.kernels.launch",
    "MERGE_COUNTERS": "ember.kernels.launch",
}


def fused_ops_enabled(x: torch.Tensor) -> bool:
    """Whether the layers run ``x`` through ember's kernels (see ember.kernels.dispatch)."""
    from ember.kernels import dispatch

    return dispatch.layer_kernels_enabled() and dispatch.takes_kernel(x)


def __getattr__(name: str) -> Any:
    if name == "ARGMAX_MAX_ROWS":
        from ember.layers.sampler import GREEDY_KERNEL_MAX_ROWS

        return GREEDY_KERNEL_MAX_ROWS
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
