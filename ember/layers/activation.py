"""Gated activations for the fused gate_up projection (one Triton kernel on CUDA in half
precision, ember.kernels.silu_and_mul; the torch ops elsewhere). Given the down projection
(``quant_for``), the kernel writes the product already quantized when that layer asks for it
(an fp8 layer), as a QuantizedActivation: with one scale per group of columns where the layer
takes them (decode batches of an fp8 layer), so a row is quantized by many programs at once;
or in int8 for a 4-bit layer's integer GEMV (ember.kernels.int8_act).
On the CPU in float32, one native call (ember.kernels.cpu.layer_ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember import kernels
from ember.kernels import dispatch
from ember.kernels.config import kernel_config
from ember.kernels.cpu import layer_ops
from ember.layers.linear import Linear, QuantizedActivation, wanted_input_dtype


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of width 2d: the SwiGLU of Llama-family MLPs, taking
    the output of one fused gate_up matmul instead of two separate projections."""

    def __init__(self) -> None:
        super().__init__()
        self.use_kernel = dispatch.layer_kernels_enabled()
        self.quantized_producer = self.use_kernel and kernel_config().quantized_producers
        self.use_cpu_ops = layer_ops.configured()

    def forward(self, x: torch.Tensor,
                quant_for: Linear | None = None) -> torch.Tensor | QuantizedActivation:
        if self.use_kernel and dispatch.takes_kernel(x):
            dtype = wanted_input_dtype(quant_for, x) if self.quantized_producer else None
            if dtype == torch.float8_e4m3fn:
                group = quant_for.quantized_input_group(x)
                return QuantizedActivation(*kernels.silu_and_mul.silu_and_mul_fp8(x, group))
            if dtype == torch.int8:
                return QuantizedActivation(*kernels.silu_and_mul.silu_and_mul_int8(x))
            return kernels.silu_and_mul.silu_and_mul(x)
        if self.use_cpu_ops and layer_ops.takes(x) and layer_ops.rows_of(x) is not None:
            return layer_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
