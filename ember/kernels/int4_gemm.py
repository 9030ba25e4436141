"""int4_gemm: a 4-bit (AWQ / GPTQ) linear layer for many rows (prefill, large decode batches).

A tiled GEMM: one program per [BLOCK_M, BLOCK_N] output tile walks K in BLOCK_K-row tiles of the
packed weight, expands each to 4-bit values in registers (ember.kernels.int4_tile), multiplies
with x's tile on the tensor cores and applies the group's zero and scale to the tile's partial
product. The weight is read once per row of tiles, so at large M the kernel is bound by the
tensor cores, not by the weight. Programs are ordered in groups of GROUP_M row tiles so the
weight tiles they share are still in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.int4_gemv import block_k_for
from ember.kernels.int4_tile import group_correction, load_q_tile, q_offset, q_operand
from ember.kernels.launch import cdiv, dot_precision, pdl_options


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, M, N, K, stride_xm,
                      stride_om, group_size,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                      PDL: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    n0 = pid_n * BLOCK_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        q = load_q_tile(qw_ptr, k0, K, K, n0, N, BLOCK_K, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                    other=0.0)
        part = tl.dot(x, q_operand(q, x.dtype), input_precision=DOT_PREC)
        xsum = tl.sum(x.to(tl.float32), 1)
        acc += group_correction(part, xsum, qz_ptr, s_ptr, k0 // group_size, n0, N,
                                q_offset(x.dtype), BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def int4_gemm_config(m: int, group_size: int,
                     elem_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_warps, num_stages) by row count. Not tuned on hardware
    yet: the usual shapes of a Hopper fp16 GEMM with a 4-bit B operand; float32 inputs take
    half-size tiles (twice the bytes per element in shared memory)."""
    if elem_bytes > 2:
        return 32 if m <= 32 else 64, 64, block_k_for(group_size, 32), 4, 3
    if m <= 32:
        return 32, 64, block_k_for(group_size, 128), 4, 4
    if m <= 128:
        return 64, 128, block_k_for(group_size, 64), 4, 4
    return 128, 128, block_k_for(group_size, 64), 8, 3


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None,
              config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] times the 4-bit weight (as ember.kernels.int4_gemv.int4_gemv takes it), any M.
    ``config`` = (block_m, block_n, block_k, num_warps, num_stages) overrides the rule."""
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.shape[1] * 8 == k and scales.shape[1] == n
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k, num_warps, num_stages = config or int4_gemm_config(
        m, group_size, x.element_size())
    assert group_size % block_k == 0 or group_size == k, "a tile must not straddle two groups"
    grid = (cdiv(m, block_m) * cdiv(n, block_n),)
    _int4_gemm_kernel[grid](
        x, qweight, qzeros, scales, bias if bias is not None else scales, out, m, n, k,
        x.stride(0), out.stride(0), group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        HAS_BIAS=bias is not None, DOT_PREC=dot_precision(x.dtype), num_warps=num_warps,
        num_stages=num_stages, **pdl_options(x),
    )
    return out
