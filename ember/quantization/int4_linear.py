"""The linear-layer side shared by AWQ and GPTQ: a LinearMethod whose layer, once loaded, holds a
4-bit weight in ember's in-memory form (ember.quantization.int4_common: column-major
``qweight`` [N, K/8], ``qzeros`` [G, N/8], ``scales`` [G, N], and ``perm`` for GPTQ's desc_act), and
computes it:

- on CUDA (outside a torch.compile trace) with ember's Triton kernels: for 1-2 rows (decoding
  one or two sequences) on the CUDA cores, ``w4a8_gemv`` on the int8 rows the norm or
  SiLU-and-mul (or, for o_proj, attention) before wrote (``quantized_input_dtype``;
  KernelConfig.int4_int8_activations), else (half rows, desc_act, the switch off)
  ``int4_gemv``; ``int4_mma`` on the tensor cores
  for 3-64 half-precision rows (whole 128-row tiles inside each group; otherwise, and in
  float32, ``int4_gemv`` up to 4 rows); more rows, the weight dequantized for the call
  (``int4_dequant``) and cuBLAS;
- elsewhere (the CPU) in torch: the weight is dequantized for the call and multiplied. That
  saves memory, not time (the CPU's fast 4-bit path is GGUF's).

Scales are kept in float16 for half-precision models (the checkpoints' own dtype: no rounding)
and in float32 for float32 models. AWQ and GPTQ differ only in what they create and load and in
``to_int4``, which turns the loaded checkpoint tensors into ember's form once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels.config import kernel_config
from ember.layers.linear import Linear, LinearMethod, QuantizedActivation
from ember.quantization.int4_common import (
    PACK,
    Int4Weight,
    check_int4_shapes,
    dequantize_packed,
)


def scales_dtype(model_dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if model_dtype == torch.float32 else torch.float16


def int_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.int32), requires_grad=False)


def replace_weight(layer: Linear, name: str, tensor: torch.Tensor | None,
                   attrs: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Put ``tensor`` (None: nothing) where parameter ``name`` was, with new loading metadata."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer._weight_attrs.pop(name, None)
    if tensor is not None:
        layer.register_weight(name, nn.Parameter(tensor, requires_grad=False), attrs or {})


GEMV_ROWS = 2  # up to this many rows int4_gemv beats int4_mma (docs/benchmarks.md)
W4A8_ROWS = 2  # up to this many rows the layer asks for int8 activations (w4a8_gemv)
MMA_ROWS = 64  # up to this many rows int4_mma beats the dequantized weight and cuBLAS


def _kernels_take(x: torch.Tensor) -> bool:
    from ember.kernels import dispatch

    return dispatch.on_gpu(x) and dispatch.triton_installed()


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                scales: torch.Tensor, group_size: int, perm: torch.Tensor | None,
                bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """x [..., K] times a 4-bit weight in ember's form, + bias: the kernels on CUDA, torch
    elsewhere."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if perm is not None:
        x2 = x2.index_select(1, perm)
    if _kernels_take(x2):
        from ember import kernels

        # One or two rows: the CUDA-core GEMV streams the packed weight fastest; 3-64 rows the
        # tensor-core kernel (its cost grows little with the rows: a Llama-8B layer 86 against
        # 154 us at 4 rows on an H100, 257 against 378 dequantized at 64); more, the weight is
        # dequantized for the call and cuBLAS multiplies (as vLLM's AWQ layer does from 256
        # rows). docs/benchmarks.md.
        rows = x2.shape[0]
        if (GEMV_ROWS < rows <= MMA_ROWS and x2.dtype != torch.float32
                and kernels.int4_mma.int4_mma_supported(x2.shape[1], group_size)
                and kernels.kernel_config().int4_tensor_cores):
            y = kernels.int4_mma.int4_mma(x2, qweight, qzeros, scales, group_size, bias)
        elif rows <= kernels.int4_gemv.MAX_ROWS:
            y = kernels.int4_gemv.int4_gemv(x2, qweight, qzeros, scales, group_size, bias)
        else:
            w = kernels.int4_dequant.int4_dequantize(qweight, qzeros, scales, group_size,
                                                     x2.dtype)
            y = F.linear(x2, w, bias)
    else:
        w = dequantize_packed(qweight, qzeros, scales, group_size)  # rows already in perm order
        y = F.linear(x2, w.t().to(x2.dtype), bias)
    return y.view(*shape[:-1], y.shape[-1])


class Int4LinearMethod(LinearMethod):
    """What AWQ's and GPTQ's methods share: the checkpoint's three tensors (``qweight``,
    ``qzeros``, ``scales``) created in the checkpoint's layout, and, once the weight is in
    ember's form, the matmul. A format says its name, its ``qweight`` layout and any extra
    tensor (``create_extra_weights``)."""

    format_name = "int4"
    extra_weight_names: tuple[str, ...] = ()  # checkpoint tensors dropped once repacked

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size  # -1: one group over all input features

    def create_weights(self, layer: Linear, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:  # fmt: skip
        out = sum(output_sizes)
        group = check_int4_shapes(input_size, out, self.group_size, layer.prefix or "layer")
        for size in output_sizes:
            if size % PACK:  # qzeros (and AWQ's qweight) pack 8 outputs per int32
                raise ValueError(f"{layer.prefix}: {self.format_name} packs 8 outputs per int32; "
                                 f"a shard of {size} outputs cannot be loaded")
        groups = input_size // group
        attrs = self.checkpoint_attrs()
        layer.register_weight("qweight", int_param(*self.qweight_shape(input_size, out)),
                              attrs["qweight"])
        layer.register_weight("qzeros", int_param(groups, out // PACK), attrs["qzeros"])
        layer.activation_dtype = dtype  # the output's, where the input comes in int8
        layer.l2_prefetch = kernel_config().l2_prefetch  # read as the layer is built
        scales = torch.zeros(groups, out, dtype=scales_dtype(dtype))
        layer.register_weight("scales", nn.Parameter(scales, requires_grad=False),
                              attrs["scales"])
        self.create_extra_weights(layer, input_size, output_sizes)

    def qweight_shape(self, input_size: int, output_size: int) -> tuple[int, int]:
        """The checkpoint's qweight shape."""
        raise NotImplementedError

    def checkpoint_attrs(self) -> dict[str, dict[str, Any]]:
        """Loading metadata of the checkpoint's tensors."""
        raise NotImplementedError

    def to_int4(self, layer: Linear) -> Int4Weight:
        """The loaded checkpoint tensors in ember's form."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = self.to_int4(layer)
        attrs = self.packed_attrs()
        for name in self.extra_weight_names:
            replace_weight(layer, name, None)
        for name in ("qweight", "qzeros", "scales"):
            replace_weight(layer, name, getattr(weight, name).contiguous(), attrs[name])
        if weight.perm is not None:
            layer.register_buffer("perm", weight.perm)

    def create_extra_weights(self, layer: Linear, input_size: int,
                             output_sizes: list[int]) -> None:  # fmt: skip
        """Tensors a format has besides the three (GPTQ's g_idx)."""

    def _group(self, layer: Linear) -> int:
        return layer.in_features if self.group_size == -1 else self.group_size

    def quantized_input_dtype(self, layer: Linear, x: torch.Tensor) -> torch.dtype | None:
        from ember.kernels.int8_act import GROUP

        # GPTQ's desc_act layers permute x's columns first: they take it as it is.
        if (kernel_config().int4_int8_activations and x.shape[0] <= W4A8_ROWS
                and x.dtype in (torch.float16, torch.bfloat16) and _kernels_take(x)
                and layer.in_features % GROUP == 0 and getattr(layer, "perm", None) is None):
            return torch.int8
        return None

    def weights_to_prefetch(self, layer: Linear, rows: int) -> list[torch.Tensor]:
        # The GEMV rows, where the layer's time is its weight read.
        if (layer.l2_prefetch and rows <= W4A8_ROWS
                and _kernels_take(layer.qweight)):
            return [layer.qweight, layer.scales, layer.qzeros]
        return []

    def apply(self, layer: Linear, x: torch.Tensor | QuantizedActivation,
              bias: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        if isinstance(x, QuantizedActivation):
            from ember.kernels.w4a8_gemv import w4a8_gemv

            return w4a8_gemv(x.data, x.scale, x.sums, layer.qweight, layer.qzeros, layer.scales,
                             self._group(layer), layer.activation_dtype, bias)
        return int4_matmul(x, layer.qweight, layer.qzeros, layer.scales, self._group(layer),
                           getattr(layer, "perm", None), bias)

    def dequantize_weight(self, layer: Linear) -> torch.Tensor:
        """float32 W [out, in] the layer computes with (the quantization check's reference)."""
        return dequantize_packed(layer.qweight, layer.qzeros, layer.scales, self._group(layer),
                                 getattr(layer, "perm", None)).t()

    @staticmethod
    def packed_attrs() -> dict[str, dict[str, Any]]:
        """Loading metadata of the tensors in ember's form (qweight column major, 8 input rows
        per int32; zeros packed along the outputs as both formats pack them)."""
        column_packed = {"output_dim": 1, "input_dim": 0, "packed_dim": 1, "packed_factor": PACK}
        return {"qweight": {"output_dim": 0, "input_dim": 1, "packed_dim": 1,
                            "packed_factor": PACK},
                "qzeros": column_packed, "scales": {"output_dim": 1, "input_dim": 0}}
