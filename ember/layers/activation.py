"""Gated activations for the fused gate_up projection (one Triton kernel on CUDA in half
precision, ember.kernels.silu_and_mul; the torch ops elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember import kernels
from ember.kernels import dispatch


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of width 2d: the SwiGLU of Llama-family MLPs, taking
    the output of one fused gate_up matmul instead of two separate projections."""

    def __init__(self) -> None:
        super().__init__()
        self.use_kernel = dispatch.layer_kernels_enabled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and dispatch.takes_kernel(x):
            return kernels.silu_and_mul.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
