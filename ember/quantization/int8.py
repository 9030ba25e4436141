"""int8 weight-only quantization: one symmetric scale per output channel.

Weights take a quarter of their float32 memory. With 16-bit activations the layer runs through
torch's int8 weight-only GEMM (`_weight_int8pack_mm`, CPU and CUDA); otherwise the weight is
dequantized per call, which saves memory but not time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.quantization.base import QuantizationMethod

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


class Int8WeightOnly(QuantizationMethod):
    name = "int8"

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q.contiguous(), scale

    def dequantize(self, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, scale = state
        return q.float() * scale[:, None]

    def apply(self, state, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = state
        if x.dtype in _FUSED_DTYPES:
            flat = x.reshape(-1, x.shape[-1])
            try:
                y = torch.ops.aten._weight_int8pack_mm(flat, q, scale.to(x.dtype))
            except (RuntimeError, NotImplementedError):
                y = F.linear(flat, self.dequantize(state).to(x.dtype))
            y = y.view(*x.shape[:-1], q.shape[0])
            return y if bias is None else y + bias
        return F.linear(x, self.dequantize(state).to(x.dtype), bias)
