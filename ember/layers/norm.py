"""RMSNorm, computed exactly as HF transformers does (float32 statistics, weight applied after
casting back), so float32 and bfloat16 models both match HF bit for bit.

On CUDA in half precision the norm (and the residual add before it, ``forward_with_residual``)
runs as one Triton kernel instead (ember.kernels.rms_norm); elsewhere the torch ops. Given the
linear layer it feeds (``quant_for``), the kernel writes the rows already quantized when that
layer asks for it (``Linear.quantized_input_dtype``: fp8 rows for an fp8 layer, int8 for a
4-bit layer's integer GEMV), and the result is a QuantizedActivation. On the CPU in float32 it
is one native call (ember.kernels.cpu.layer_ops), equal to the torch ops to rounding.
"""

from __future__ import annotations

import torch
from torch import nn

from ember import kernels
from ember.kernels import dispatch
from ember.kernels.config import kernel_config
from ember.kernels.cpu import layer_ops
from ember.layers.linear import Linear, QuantizedActivation, wanted_input_dtype


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalising over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self._shape = (hidden_size,)
        self.use_kernel = dispatch.layer_kernels_enabled()
        self.quantized_producer = self.use_kernel and kernel_config().quantized_producers
        self.use_cpu_ops = layer_ops.configured()

    def forward(self, x: torch.Tensor,
                quant_for: Linear | None = None) -> torch.Tensor | QuantizedActivation:
        if self.use_kernel and dispatch.takes_kernel(x):
            quantized = self._quantized(quant_for, x)
            if quantized is not None:
                return quantized[0]
            return kernels.rms_norm.rms_norm(x, self.weight, self.eps)
        if self._takes_cpu_ops(x):
            return layer_ops.rms_norm(x, self.weight, self.eps)
        return self._forward_torch(x)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor, quant_for: Linear | None = None
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """(norm(x + residual), x + residual): a block's residual add fused with the next norm.

        ``x`` (a branch output the caller no longer needs) may be overwritten with the sum.
        """
        if self.use_kernel and dispatch.takes_kernel(x):
            quantized = self._quantized(quant_for, x, residual)
            if quantized is not None:
                return quantized
            return kernels.rms_norm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if (self._takes_cpu_ops(x) and layer_ops.rows_of(x) is not None
                and layer_ops.rows_of(residual) is not None):
            return layer_ops.rms_norm(x, self.weight, self.eps, residual), x
        # In place, as the decoder always did (branch.add_(residual)): no extra allocation.
        h = x.add_(residual)
        return self._forward_torch(h), h

    def _takes_cpu_ops(self, x: torch.Tensor) -> bool:
        return (self.use_cpu_ops and self.weight.dtype == torch.float32
                and layer_ops.takes(x) and layer_ops.norm_rows(x) is not None)

    def _quantized(self, layer: Linear | None, x: torch.Tensor,
                   residual: torch.Tensor | None = None,
                   ) -> tuple[QuantizedActivation, torch.Tensor | None] | None:
        """(the norm quantized as ``layer`` asks, x + residual), or None where it asks for x
        as it is."""
        dtype = wanted_input_dtype(layer, x) if self.quantized_producer else None
        if dtype == torch.float8_e4m3fn:
            q, scale, h = kernels.rms_norm.rms_norm_fp8(x, self.weight, self.eps, residual)
            return QuantizedActivation(q, scale), h
        if dtype == torch.int8:
            q, scale, sums, h = kernels.rms_norm.rms_norm_int8(x, self.weight, self.eps,
                                                               residual)
            return QuantizedActivation(q, scale, sums), h
        return None

    def _forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same ops as below in one call (bit-identical in float32, where no cast sits
            # between them): a CPU decode step is bound by the number of torch calls.
            return torch.rms_norm(x, self._shape, self.weight, self.eps)
        in_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # HF casts back to the input dtype before the weight multiply; doing it the other way
        # round changes bf16 results.
        return self.weight * h.to(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
