"""per_token_fp8: dynamic per-token float8_e4m3fn quantization of activations, one kernel.

W8A8 layers (ember.quantization.fp8) feed torch._scaled_mm with x in fp8 and one float32 scale
per row: scale = max|x_row| / 448 (the e4m3 maximum), q = x / scale. Done in torch that is four
kernels (abs, amax, divide, cast) per layer; here one program per row reads the row twice (the
second read hits L2) and writes q and its scale. Rounding is round-to-nearest-even, as torch's
cast; under TRITON_INTERPRET the value is rounded on the e4m3 grid first (the interpreter's own
cast is wrong on mantissa carry, see ember.kernels.store_kv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import next_power_of_2, pdl_options
from ember.kernels.store_kv import quantize_fp8, soft_fp8

FP8_MAX = 448.0
# The smallest scale: an all-zero row quantizes to zeros instead of dividing by zero.
MIN_SCALE = 1e-12


@triton.jit
def per_token_scale(amax, FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr):
    """(scale, 1 / scale) of a row whose largest magnitude is ``amax``: amax / 448, at least
    MIN_SCALE. Correctly rounded divisions (a compiler may otherwise multiply by 1/448 or
    approximate the reciprocal), so scales and values equal torch's bit for bit. Shared by the
    kernels that write activations quantized for an fp8 layer (RMSNorm, SiLU-and-mul)."""
    fp8_max = tl.full([], FP8_MAX_C, tl.float32)
    scale = tl.maximum(tl.math.div_rn(amax, fp8_max), MIN_SCALE_C)
    return scale, tl.math.div_rn(tl.full([], 1.0, tl.float32), scale)


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm,
                          FP8_MAX_C: tl.constexpr, MIN_SCALE_C: tl.constexpr,
                          BLOCK: tl.constexpr, SOFT: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale, inv = per_token_scale(tl.max(amax, 0), FP8_MAX_C, MIN_SCALE_C)
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0)
        q = quantize_fp8(x, inv, FP8_MAX_C, SOFT)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q float8_e4m3fn [M, K] row-major, scales float32 [M, 1])
    with x ~= q * scales."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    block = min(next_power_of_2(k), 4096)
    _per_token_fp8_kernel[(m,)](
        x, q, scales, k, x.stride(0), q.stride(0), FP8_MAX_C=FP8_MAX, MIN_SCALE_C=MIN_SCALE,
        BLOCK=block, SOFT=soft_fp8(x), num_warps=4 if block >= 1024 else 1, **pdl_options(x),
    )
    return q, scales
