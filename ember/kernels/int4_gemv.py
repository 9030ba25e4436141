"""int4_gemv: a 4-bit (AWQ / GPTQ) linear layer for up to 16 rows, streaming the packed weight.

At decode batch sizes the layer is a read of its weight: 4-bit storage moves a quarter of a
bf16 weight's bytes, so the kernel's job is to keep HBM busy. One program per BLOCK_N output
columns (times K splits) walks its K range in BLOCK_K-row tiles of the K-packed int32 weight
(ember.kernels.int4_tile). One row (FMA) multiplies and adds in float32 on the CUDA cores: each
thread expands the packs it loaded, one mask and one subtract per weight, and keeps a partial
per pack row, summed once at the end; the weight tile never changes layout. More rows expand
the tile to 4-bit values and multiply with the rows of x padded to one tl.dot tile. The
group's zero and scale are applied once per tile. K splits merge in the kernel
(ember.kernels.split_k: deterministic, no second kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.int4_tile import (
    group_correction,
    load_q_tile,
    one_row_tile,
    one_row_weights,
    one_row_x,
    q_offset,
    q_operand,
)
from ember.kernels.launch import (
    cdiv,
    compiled_for_gpu,
    dot_precision,
    num_sms,
    pdl_options,
)
from ember.kernels.split_k import split_k_launch, split_k_total

MAX_ROWS = 16


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
                      M, N, K, stride_xm, stride_om, k_per_split, GROUP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                      FMA: tl.constexpr, PACKED_HALF: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if FMA:
        # Two tiles of loads in flight per thread: the loop body takes two tiles and reissues
        # each one's loads (weights, zero points, scales and x, so no L2 latency is waited for
        # at a tile's start) right after its arithmetic: a register double buffer without
        # copies. The weight depends on no earlier kernel: the first two tiles of it are read
        # before the PDL wait, while the kernel before (RMSNorm, attention) still runs.
        w_first = one_row_weights(qw_ptr, qz_ptr, s_ptr, k_lo, k_hi, n0, N, GROUP, BLOCK_K,
                                  BLOCK_N)
        w_second = one_row_weights(qw_ptr, qz_ptr, s_ptr, k_lo + BLOCK_K, k_hi, n0, N, GROUP,
                                   BLOCK_K, BLOCK_N)
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if FMA:  # one row: [pack rows, BLOCK_N] partial sums, added up once at the end
        x_first = one_row_x(x_ptr, k_lo, k_hi, BLOCK_K, PACKED_HALF)
        x_second = one_row_x(x_ptr, k_lo + BLOCK_K, k_hi, BLOCK_K, PACKED_HALF)
        acc_rows = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, 2 * BLOCK_K):
            acc_rows += one_row_tile(w_first, x_first, x_ptr, k0, k_hi, BLOCK_K, BLOCK_N,
                                     PACKED_HALF)
            w_first = one_row_weights(qw_ptr, qz_ptr, s_ptr, k0 + 2 * BLOCK_K, k_hi, n0, N,
                                      GROUP, BLOCK_K, BLOCK_N)
            x_first = one_row_x(x_ptr, k0 + 2 * BLOCK_K, k_hi, BLOCK_K, PACKED_HALF)
            acc_rows += one_row_tile(w_second, x_second, x_ptr, k0 + BLOCK_K, k_hi, BLOCK_K,
                                     BLOCK_N, PACKED_HALF)
            w_second = one_row_weights(qw_ptr, qz_ptr, s_ptr, k0 + 3 * BLOCK_K, k_hi, n0, N,
                                       GROUP, BLOCK_K, BLOCK_N)
            x_second = one_row_x(x_ptr, k0 + 3 * BLOCK_K, k_hi, BLOCK_K, PACKED_HALF)
        acc = tl.sum(acc_rows, 0)[None, :]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            q = load_q_tile(qw_ptr, k0, k_hi, n0, N, BLOCK_K, BLOCK_N)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & (offs_k < k_hi)[None, :], other=0.0)
            part = tl.dot(x, q_operand(q, x.dtype), input_precision=DOT_PREC)
            xsum = tl.sum(x.to(tl.float32), 1)
            acc += group_correction(part, xsum, qz_ptr, s_ptr, k0 // GROUP, n0, N, q_offset(x.dtype),
                                    BLOCK_N)
    out_mask = m_mask[:, None] & n_mask[None, :]
    acc, last = split_k_total(acc, part_ptr, counters_ptr, pid_n, pid_k,
                              offs_m[:, None] * N + offs_n[None, :], out_mask, M * N, SPLIT_K)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def block_k_for(group_size: int, block_k: int) -> int:
    """The largest power of two <= block_k (and >= 16, tl.dot's minimum) dividing the group."""
    while block_k > 16 and group_size % block_k:
        block_k //= 2
    return block_k


@functools.lru_cache(maxsize=1024)
def int4_gemv_config(n: int, k: int, group_size: int, sms: int,
                     rows: int = 1) -> tuple[int, int, int, int, int, bool]:
    """(block_n, block_k, split_k, num_warps, num_stages, fma) for an [k, n] weight: tiles of
    128 rows, and K splits until the grid holds about ``programs_per_sm`` programs per SM (a
    decode projection of 4096 outputs has few tiles); a weight with a tile for every SM is not
    split. One row: multiply-adds on the CUDA cores over 128-wide tiles with 4 warps: on an
    H200 (``ember.bench.quant kernels --sweep`` at Llama-3.1-8B's projections, 2026-12-02) two
    programs per SM beat three and four, and gate_up's 224 tiles ran fastest unsplit (35.8
    against 38.6 us split in two). More rows: 64-wide tensor-core tiles (not swept)."""
    fma = rows == 1
    block_n = 128 if fma else 64
    block_k = block_k_for(group_size, 128)
    tiles = cdiv(n, block_n)
    steps = cdiv(k, block_k)
    split_k = 1 if tiles >= sms else max(1, min(cdiv(2 * sms, tiles), steps // 2 or 1))
    return block_n, block_k, split_k, 4, 4, fma


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None,
              config: tuple | None = None) -> torch.Tensor:
    """x [M <= 16, K] times the 4-bit weight in ember's form (qweight [K/8, N] K-packed, qzeros
    [G, N/8], scales [G, N]); ``group_size`` rows per group (K for one group). Output in x's
    dtype.
    ``config`` = (block_n, block_k, split_k, num_warps, num_stages[, fma]) overrides the rule;
    fma (float32 multiply-adds instead of tl.dot) applies to one row only."""
    m, k = x.shape
    n = qweight.shape[1]
    assert m <= MAX_ROWS and qweight.shape[0] * 8 == k and scales.shape[1] == n
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k, split_k, num_warps, num_stages, *rest = (
        config or int4_gemv_config(n, k, group_size, num_sms(x.device), m))
    fma = bool(rest and rest[0]) and m == 1
    assert group_size % block_k == 0 or group_size == k, "a tile must not straddle two groups"
    step = 2 * block_k if fma else block_k  # the one-row loop takes two tiles a step
    n_tiles = cdiv(n, block_n)
    splits = split_k_launch(k, split_k, step, m, n, n_tiles, out)
    _int4_gemv_kernel[(n_tiles, splits.split_k)](
        x, qweight, qzeros, scales, bias if bias is not None else scales, out, splits.partials,
        splits.counters, m, n, k, x.stride(0), out.stride(0), splits.k_per_split, GROUP=group_size,
        BLOCK_M=1 if fma else MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits.split_k,
        HAS_BIAS=bias is not None, DOT_PREC=dot_precision(x.dtype), FMA=fma,
        PACKED_HALF=fma and x.dtype != torch.float32 and compiled_for_gpu(x), num_warps=num_warps,
        num_stages=num_stages, **pdl_options(x),
    )
    return out
