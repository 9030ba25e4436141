"""Gated activations for the fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of width 2d: the SwiGLU of Llama-family MLPs, taking
    the output of one fused gate_up matmul instead of two separate projections."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
