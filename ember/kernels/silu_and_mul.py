"""SiLU-and-mul: ``silu(x[..., :d]) * x[..., d:]``, the gate of a fused gate_up projection.

Torch rounds silu(gate) to the half dtype before the multiply; so does this kernel (SiLU's exp
and division may still differ from torch by an ulp). ``silu_and_mul_fp8`` writes the product
quantized for an fp8 down projection instead (float8_e4m3fn and one scale per row, what
ember.kernels.fp8_quant.per_token_fp8 would make of the half-precision product);
``silu_and_mul_int8`` in int8 for a 4-bit one's integer GEMV (ember.kernels.int8_act).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels import fp8_quant, int8_act
from ember.kernels.fp8_quant import per_token_scale
from ember.kernels.int8_act import empty_int8_rows, group_tile, store_groups
from ember.kernels.launch import cdiv, next_power_of_2, pdl_options, warps_for_block
from ember.kernels.store_kv import quantize_fp8, soft_fp8

FP8_MAX = tl.constexpr(fp8_quant.FP8_MAX)  # jit globals must be constexpr
MIN_SCALE = tl.constexpr(fp8_quant.MIN_SCALE)
# Columns one program of silu_and_mul_fp8 holds (32 warps, 16 per thread): Llama-8B's 14,336
# in one pass.
FP8_BLOCK_MAX = 16384


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    # Grid (tokens, column blocks). The product of the rounded activation and `up` is exact in
    # float32 before its one rounding.
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    ty = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)  # torch's silu expression
    tl.store(out_ptr + tok * stride_out + offs, (act * up).to(ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, d,
                             BLOCK: tl.constexpr, GROUPED: tl.constexpr, SOFT: tl.constexpr,
                             PDL: tl.constexpr):
    # GROUPED: grid (tokens, groups), a program quantizes its BLOCK columns with a scale of
    # their own (stored at [token, group]). Otherwise one program per token, as wide as the row
    # (up to BLOCK_MAX columns: one load round trip, the largest magnitude, the quantized row).
    # A wider row takes two passes, the second reading gate and up again (from L2) and
    # recomputing the product. At decode batch sizes a handful of programs run, so a narrow
    # program looping over the row would be latency-bound.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + tok * stride_x
    q_row = q_ptr + tok * stride_q
    ty = x_ptr.dtype.element_ty
    if GROUPED:
        group = tl.program_id(1)
        offs = group * BLOCK + tl.arange(0, BLOCK)
        y = _silu_mul_row(x_row, offs, d, ty)
        scale, inv = per_token_scale(tl.max(tl.abs(y), 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + tok * tl.num_programs(1) + group, scale)
        q = quantize_fp8(y, inv, FP8_MAX, SOFT)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < d)
    elif BLOCK >= d:
        offs = tl.arange(0, BLOCK)
        y = _silu_mul_row(x_row, offs, d, ty)
        scale, inv = per_token_scale(tl.max(tl.abs(y), 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + tok, scale)
        q = quantize_fp8(y, inv, FP8_MAX, SOFT)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < d)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, d, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_silu_mul_row(x_row, offs, d, ty)))
        scale, inv = per_token_scale(tl.max(amax, 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + tok, scale)
        for start in range(0, d, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            q = quantize_fp8(_silu_mul_row(x_row, offs, d, ty), inv, FP8_MAX, SOFT)
            tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=offs < d)


@triton.jit
def _silu_and_mul_int8_kernel(x_ptr, words_ptr, scale_ptr, sums_ptr, stride_x, d,
                              GROUP: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    # Grid (tokens, blocks of GROUPS groups): each program quantizes whole groups of its own.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    cols, groups = group_tile(tl.program_id(1) * GROUPS, GROUPS, GROUP)
    y = _silu_mul_row(x_ptr + tok * stride_x, cols, d, x_ptr.dtype.element_ty)
    store_groups(y, groups, d // GROUP, words_ptr + tok * (d // 8),
                 scale_ptr + tok * (d // GROUP), sums_ptr + tok * (d // GROUP), GROUP)


@triton.jit
def _silu_mul_row(x_row, offs, d, ty):
    """silu(gate) * up at ``offs`` of one row, rounded to the half dtype ``ty`` (as torch's),
    in float32."""
    mask = offs < d
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    return (act * up).to(ty).to(tl.float32)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2d] -> silu(x[..., :d]) * x[..., d:], a new contiguous [..., d] tensor."""
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out.numel() == 0:
        return out
    rows = x2.shape[0]
    block = min(next_power_of_2(d), 1024)
    _silu_and_mul_kernel[(rows, cdiv(d, block))](
        x2, out, x2.stride(0), d, d, BLOCK=block, num_warps=warps_for_block(block),
        **pdl_options(x2),
    )
    return out


def silu_and_mul_fp8(x: torch.Tensor, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, 2d] -> (q float8_e4m3fn [T, d], scales float32 [T, 1]) with q * scales ~=
    silu_and_mul(x) (``per_token_fp8`` of it, bit for bit). With ``group`` (a power of two
    dividing d) one scale per row and ``group`` columns instead, scales [T, d / group] (each
    group as per_token_fp8 would quantize it alone): the row is spread over d / group programs,
    where one scale per row needs one program to see the whole row."""
    d = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    if group:
        assert d % group == 0 and group & (group - 1) == 0, f"group {group} for {d} columns"
    groups = d // group if group else 1
    q = torch.empty(x.shape[0], d, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(x.shape[0], groups, dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return q, scales
    block = group or min(next_power_of_2(d), FP8_BLOCK_MAX)
    _silu_and_mul_fp8_kernel[(x.shape[0], groups)](
        x, q, scales, x.stride(0), q.stride(0), d, BLOCK=block, GROUPED=bool(group),
        SOFT=soft_fp8(x), num_warps=max(4, min(32, block // 512)), **pdl_options(x),
    )
    return q, scales


def silu_and_mul_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, 2d] -> (q, scales, sums): silu_and_mul(x) for a 4-bit layer's integer GEMV, in
    ember.kernels.int8_act's form (what ``quantize_int8`` makes of the half-precision
    product); d a multiple of its group."""
    d = x.shape[-1] // 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, scales, sums = empty_int8_rows(x.shape[0], d, x.device)
    if q.numel():
        groups = int8_act.GROUPS_PER_PROGRAM
        _silu_and_mul_int8_kernel[(x.shape[0], cdiv(d // int8_act.GROUP, groups))](
            x, q.view(torch.int64), scales, sums, x.stride(0), d, GROUP=int8_act.GROUP,
            GROUPS=groups, num_warps=4, **pdl_options(x))
    return q, scales, sums
