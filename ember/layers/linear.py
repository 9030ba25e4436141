"""Linear: ``nn.Linear`` whose small-batch calls on CUDA in half precision go to ember's
weight-streaming kernel (ember.kernels.small_batch_linear) instead of cuBLAS.

Which layers take it is fixed as the layer is built, from its weight size: against cuBLAS the
kernel wins for weights of up to tens of MB at every batch it takes (up to 16 rows), and on the
largest projections of an 8B model, where cuBLAS streams near the copy bandwidth, at one row
only. Larger weights (an lm_head is a plain nn.Linear anyway) keep cuBLAS. Subclassing
nn.Linear keeps parameter names, weight loading and quantization (which replaces nn.Linear
modules) unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember import kernels
from ember.kernels import dispatch
from ember.kernels.tuning import SMALL_BATCH_LINEAR_MAX_ROWS

# 64 MB in bf16: an 8B model's qkv and o_proj take the kernel at every batch up to 16.
SMALL_BATCH_MAX_WEIGHT_ELEMENTS = 32 * 2**20
# 256 MB: an 8B model's down and gate_up take it at batch 1 only.
LARGE_WEIGHT_MAX_ELEMENTS = 128 * 2**20


def small_batch_max_rows(in_features: int, out_features: int) -> int:
    """Up to how many rows a layer of this size takes the kernel (0: never)."""
    elements = in_features * out_features
    if elements > LARGE_WEIGHT_MAX_ELEMENTS:
        return 0
    return SMALL_BATCH_LINEAR_MAX_ROWS if elements <= SMALL_BATCH_MAX_WEIGHT_ELEMENTS else 1


class Linear(nn.Linear):
    """nn.Linear that sends calls of up to ``small_batch_max_rows`` rows on CUDA in half
    precision to ``small_batch_linear``; otherwise exactly nn.Linear (one attribute test per
    call: eager steps call every projection of every layer)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.small_batch_max_rows = (
            small_batch_max_rows(self.in_features, self.out_features)
            if dispatch.layer_kernels_enabled() else 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_batch_max_rows and x.dim() == 2 and dispatch.takes_kernel(x):
            return kernels.small_batch_linear.small_batch_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# Names this module exported before the kernel moved to ember.kernels.small_batch_linear.
_MOVED = {
    "small_batch_linear": "small_batch_linear",
    "small_gemm_config": "small_batch_linear_config",
    "GemmConfig": "SmallBatchLinearConfig",
    "SMALL_BATCH_MAX_ROWS": "MAX_ROWS",
}


def __getattr__(name: str) -> Any:
    new_name = _MOVED.get(name)
    if new_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"ember.layers.linear.{name} is deprecated: use "
                  f"ember.kernels.small_batch_linear.{new_name}", DeprecationWarning, stacklevel=2)
    return getattr(kernels.small_batch_linear, new_name)
