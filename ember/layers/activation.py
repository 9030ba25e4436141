"""Gated activations for the fused gate_up projection (one fused Triton kernel on CUDA in half
precision, see ember.layers.fused_ops; the torch ops elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers import fused_ops


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of width 2d: the SwiGLU of Llama-family MLPs, taking
    the output of one fused gate_up matmul instead of two separate projections."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ops.fused_ops_enabled(x):
            return fused_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
