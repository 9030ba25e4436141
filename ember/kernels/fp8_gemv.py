"""fp8_gemv: an fp8 linear layer (float8_e4m3fn weight, one scale per output) for up to 16 rows.

At decode batch sizes the layer should stream its 1-byte weight at the copy bandwidth. Widening
fp8 tiles to bf16 for a bf16 tensor-core dot (W8A16) cost ~11 instructions a weight on sm_90 and
held the weight stream to 40-64% of the bandwidth. Here both operands stay fp8 and the dot runs
on Hopper's fp8 tensor cores (wgmma), which need 64 rows in their first operand: so the operands
are swapped, the weight tile [BLOCK_N >= 64, BLOCK_K] is the first operand straight from shared
memory and the few input rows, padded to 16, the second; the program computes out^T.

The activations are quantized as they are read, one scale per row and K tile: finer than
vLLM's per-token scales, and no pass over x before the weight stream starts. The scale is the
smallest power of two that brings the tile row's largest magnitude within e4m3's 448 (as MX
formats scale), made from the magnitude's bits: x / scale is then exact and costs a multiply,
where amax / 448 correctly rounded (as ember.kernels.fp8_quant divides) compiles to a
division sequence with a slow-path call in every loop step. e4m3 keeps 3 mantissa bits in
every binade, so only values that fall below its normal range lose precision to the coarser
scale. Each tile's dot is scaled by its x scales as it is added; the weight's per-channel
scale multiplies each output once at the end. The rows are padded to 16 (with 8, Triton 3.6
falls back to bf16 mma.sync and widens the weight).

x may also come quantized by the kernel that wrote it (RMSNorm, SiLU-and-mul): its row scales
then multiply each output once at the end, or, where the producer scaled each group of columns
on its own (a multiple of the K tile), each tile's dot by its group's scale.

Grid (output tiles, K splits): K splits merge in the kernel (ember.kernels.split_k). Tiles and
splits come from the device's rules in ember.kernels.tuning.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, num_sms, pdl_options
from ember.kernels.split_k import split_k_launch, split_k_total
from ember.kernels.store_kv import quantize_fp8, soft_fp8
from ember.kernels.tuning import SMALL_BATCH_LINEAR_MAX_ROWS as MAX_ROWS
from ember.kernels.tuning import DeviceTuning, Fp8GemvConfig, tuning_for

__all__ = ["MAX_ROWS", "Fp8GemvConfig", "fp8_gemv", "fp8_gemv_config"]

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _fp8_gemv_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, part_ptr,
                     counters_ptr, M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, X_FP8: tl.constexpr,
                     X_GROUP: tl.constexpr, SOFT: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:  # x comes from the kernel before (ember.kernels.launch.pdl_options)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x_mask = m_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if X_FP8 and X_GROUP > 0:  # quantized before, one scale per row and X_GROUP columns
            x_scale = tl.load(x_scale_ptr + offs_m * (K // X_GROUP) + k // X_GROUP, mask=m_mask,
                              other=0.0)
            acc += tl.dot(w, tl.trans(tl.load(x_tile, mask=x_mask, other=0.0))) * x_scale[None, :]
        elif X_FP8:  # quantized by the kernel that wrote x: both operands stream as they are
            acc += tl.dot(w, tl.trans(tl.load(x_tile, mask=x_mask, other=0.0)))
        else:
            x = tl.load(x_tile, mask=x_mask, other=0.0).to(tl.float32)
            x_scale, inv = _power_of_two_scale(tl.max(tl.abs(x), axis=1))
            xq = quantize_fp8(x, inv[:, None], FP8_MAX, SOFT).to(tl.float8e4nv)
            acc += tl.dot(w, tl.trans(xq)) * x_scale[None, :]
    out_mask = n_mask[:, None] & m_mask[None, :]
    acc, last = split_k_total(acc, part_ptr, counters_ptr, pid_n, pid_k,
                              offs_m[None, :] * N + offs_n[:, None], out_mask, M * N, SPLIT_K)
    if last:
        acc *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        if X_FP8 and X_GROUP == 0:
            acc *= tl.load(x_scale_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _power_of_two_scale(amax):
    """(scale, 1 / scale): the smallest power of two with amax / scale <= 448 (= 1.75 * 2^8),
    from amax's bits: 2^(e - 8), or 2^(e - 7) when its mantissa is above 1.75; 2^-126 for
    zero. x * (1 / scale) is then exact and within e4m3's range."""
    bits = amax.to(tl.int32, bitcast=True)
    exp = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    exp = tl.maximum(exp, 1)  # the biased exponent of the scale
    scale = (exp << 23).to(tl.float32, bitcast=True)
    return scale, ((254 - exp) << 23).to(tl.float32, bitcast=True)


def fp8_gemv_config(n: int, k: int, device: torch.device | None = None,
                    quantized_x: bool = False) -> Fp8GemvConfig:
    """The tuned tiles for an [n, k] fp8 weight on ``device`` (ember.kernels.tuning), for x in
    16-bit or (``quantized_x``) already in fp8."""
    return _tuned_config(tuning_for(device), n, k, quantized_x)


@functools.lru_cache(maxsize=1024)
def _tuned_config(tuning: DeviceTuning, n: int, k: int, quantized_x: bool) -> Fp8GemvConfig:
    return tuning.fp8_gemv_config(n, k, quantized_x)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: tuple | None = None,
             x_scale: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [m <= MAX_ROWS, k] (16-bit) times ``weight`` (float8_e4m3fn [n, k]) * ``weight_scale``
    (float32 [n]) transposed, plus ``bias``: W8A8 (module docstring). x may instead come
    quantized, float8_e4m3fn with its float32 scales in ``x_scale``: one per row ([m] or [m, 1],
    as ember.kernels.fp8_quant.per_token_fp8 or a producer kernel writes them) or one per row
    and group of k / g columns ([m, g], g > 1: a producer that quantizes a row in several
    programs); the output is then ``out_dtype``. ``config`` (an Fp8GemvConfig, or its leading
    fields as a tuple) overrides the tuned tiles; a split of 0 means as many K splits as fill
    the SMs."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.dtype == torch.float8_e4m3fn
    x_fp8 = x.dtype == torch.float8_e4m3fn
    assert x_fp8 == (x_scale is not None), "an fp8 x comes with its row scales, a 16-bit x not"
    groups = x_scale.shape[-1] if x_fp8 and x_scale.dim() == 2 else 1
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(m, n, dtype=out_dtype or (torch.bfloat16 if x_fp8 else x.dtype),
                      device=x.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k, split_k, num_warps, num_stages = Fp8GemvConfig(
        *(config or fp8_gemv_config(n, k, x.device, x_fp8)))
    x_group = 0
    if groups > 1:
        x_group = k // groups
        assert x_group * groups == k and x_group % block_k == 0, (
            f"x scales per {x_group} columns need K tiles that divide them (tile {block_k})")
        x_scale = x_scale.contiguous()
    n_tiles = cdiv(n, block_n)
    if split_k == 0:  # enough splits for one program an SM, each at least two K tiles
        split_k = max(1, min(cdiv(num_sms(x.device), n_tiles), k // (2 * block_k)))
    splits = split_k_launch(k, split_k, block_k, m, n, n_tiles, out)
    _fp8_gemv_kernel[(n_tiles, splits.split_k)](
        x, x_scale if x_fp8 else weight_scale, weight, weight_scale,
        bias if bias is not None else weight_scale, out, splits.partials, splits.counters, m, n,
        k, x.stride(0), weight.stride(0), out.stride(0), splits.k_per_split, BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits.split_k, HAS_BIAS=bias is not None,
        X_FP8=x_fp8, X_GROUP=x_group, SOFT=soft_fp8(out), num_warps=num_warps,
        num_stages=num_stages, **pdl_options(x),
    )
    return out
