"""int4_gemv: a 4-bit (AWQ / GPTQ) linear layer for up to 16 rows, streaming the packed weight.

At decode batch sizes the layer is a read of its weight: 4-bit storage moves a quarter of a
bf16 weight's bytes, so the kernel's job is to keep HBM busy. Two kernels over ember's
column-major packs (ember.kernels.int4_tile):

- one row (``_int4_gemv_row_kernel``): one program per BLOCK_N output columns (times K splits)
  reads each column's packs as one contiguous run, BLOCK_K rows a step, and multiplies on the
  CUDA cores (bfloat16 pairs in inline PTX on a GPU: no layout change, no shared memory); a
  partial per pack, summed once at the end. The loads of two tiles are in flight per thread,
  the weight's first two before the PDL wait.
- more rows (``_int4_gemv_dot_kernel``): each tile expanded to 4-bit values and multiplied with
  the rows of x padded to one tl.dot tile, the group's zero and scale applied once per tile.

K splits merge in the kernel (ember.kernels.split_k: deterministic, no second kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.int4_tile import (
    group_correction,
    load_q_tile,
    q_offset,
    q_operand,
    row_tile_product,
    row_tile_weights,
    row_tile_x,
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
def _int4_gemv_row_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr,
                          counters_ptr, N, K, k_per_split, GROUP: tl.constexpr,
                          SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          PACKED_HALF: tl.constexpr, X_WORDS: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # A register double buffer without copies: the loop body takes two tiles and reissues each
    # one's loads right after its arithmetic. The weight depends on no earlier kernel, so its
    # first two tiles are read before the PDL wait, while the kernel before still runs.
    w_first = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k_lo, k_hi, n0, N, K, GROUP, SUB, BLOCK_K,
                               BLOCK_N)
    w_second = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k_lo + BLOCK_K, k_hi, n0, N, K, GROUP,
                                SUB, BLOCK_K, BLOCK_N)
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_first = row_tile_x(x_ptr, k_lo, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    x_second = row_tile_x(x_ptr, k_lo + BLOCK_K, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    acc = tl.zeros([BLOCK_N, BLOCK_K // SUB, SUB // 8], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, 2 * BLOCK_K):
        acc += row_tile_product(w_first, x_first, x_ptr, k0, k_hi, SUB, BLOCK_K, PACKED_HALF)
        w_first = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0 + 2 * BLOCK_K, k_hi, n0, N, K,
                                   GROUP, SUB, BLOCK_K, BLOCK_N)
        x_first = row_tile_x(x_ptr, k0 + 2 * BLOCK_K, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
        acc += row_tile_product(w_second, x_second, x_ptr, k0 + BLOCK_K, k_hi, SUB, BLOCK_K,
                                PACKED_HALF)
        w_second = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0 + 3 * BLOCK_K, k_hi, n0, N, K,
                                    GROUP, SUB, BLOCK_K, BLOCK_N)
        x_second = row_tile_x(x_ptr, k0 + 3 * BLOCK_K, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < N)[None, :]
    total = tl.sum(tl.sum(acc, 2), 1)[None, :]
    total, last = split_k_total(total, part_ptr, counters_ptr, pid_n, pid_k, offs_n[None, :],
                                n_mask, N, SPLIT_K)
    if last:
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _int4_gemv_dot_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr,
                          counters_ptr, M, N, K, stride_xm, stride_om, k_per_split,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        q = load_q_tile(qw_ptr, k0, k_hi, K, n0, N, BLOCK_K, BLOCK_N)
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


def row_sub_tile(group_size: int, block_k: int) -> int:
    """Rows per sub-tile of the one-row kernel: the largest power of two <= block_k dividing
    the group (a group is a multiple of 8 rows), so no sub-tile straddles two groups."""
    sub = 1 << (min(group_size, block_k).bit_length() - 1)
    while sub > 8 and group_size % sub:
        sub //= 2
    return sub


@functools.lru_cache(maxsize=1024)
def int4_gemv_config(n: int, k: int, group_size: int, sms: int,
                     rows: int = 1) -> tuple[int, int, int, int, int, bool]:
    """(block_n, block_k, split_k, num_warps, num_stages, fma) for an [k, n] weight.
    One row: 16 columns x 1,024 rows a step in 4 warps, K split until the grid holds two
    programs per SM: on an H200 (a sweep of 51 tilings at Llama-3.1-8B's projections,
    2026-12-02) the best total over the four, each within 5% of its own best but o_proj
    (7.7 against 7.3 us). More rows: 64-wide tensor-core tiles of 128 rows (not swept), K
    split until the grid holds two programs per SM; a weight with a tile for every SM is not
    split."""
    fma = rows == 1
    if fma:
        block_n, block_k = 16, 1024
        tiles = cdiv(n, block_n)
        split_k = max(1, min(cdiv(2 * sms, tiles), cdiv(k, 2 * block_k)))
        return block_n, block_k, split_k, 4, 1, True
    block_n = 64
    block_k = block_k_for(group_size, 128)
    tiles = cdiv(n, block_n)
    steps = cdiv(k, block_k)
    split_k = 1 if tiles >= sms else max(1, min(cdiv(2 * sms, tiles), steps // 2 or 1))
    return block_n, block_k, split_k, 4, 4, False


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None,
              config: tuple | None = None) -> torch.Tensor:
    """x [M <= 16, K] times the 4-bit weight in ember's form (qweight [N, K/8] column major,
    qzeros [G, N/8], scales [G, N]); ``group_size`` rows per group (K for one group). Output
    in x's dtype. ``config`` = (block_n, block_k, split_k, num_warps, num_stages[, fma])
    overrides the rule; fma (the one-row kernel) applies to one row only."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m <= MAX_ROWS and qweight.shape[1] * 8 == k and scales.shape[1] == n
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k, split_k, num_warps, num_stages, *rest = (
        config or int4_gemv_config(n, k, group_size, num_sms(x.device), m))
    n_tiles = cdiv(n, block_n)
    bias_arg = bias if bias is not None else scales
    if bool(rest and rest[0]) and m == 1:
        sub = row_sub_tile(group_size, block_k)
        splits = split_k_launch(k, split_k, 2 * block_k, 1, n, n_tiles, out)
        packed_half = x.dtype != torch.float32 and compiled_for_gpu(x)
        words = packed_half and x.dtype == torch.bfloat16
        _int4_gemv_row_kernel[(n_tiles, splits.split_k)](
            x.view(torch.int32) if words else x, qweight, qzeros, scales, bias_arg, out,
            splits.partials, splits.counters, n, k, splits.k_per_split, GROUP=group_size,
            SUB=sub, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits.split_k,
            HAS_BIAS=bias is not None, PACKED_HALF=packed_half, X_WORDS=words,
            num_warps=num_warps, num_stages=num_stages, **pdl_options(x),
        )
        return out
    assert group_size % block_k == 0 or group_size == k, "a tile must not straddle two groups"
    splits = split_k_launch(k, split_k, block_k, m, n, n_tiles, out)
    _int4_gemv_dot_kernel[(n_tiles, splits.split_k)](
        x, qweight, qzeros, scales, bias_arg, out, splits.partials, splits.counters, m, n, k,
        x.stride(0), out.stride(0), splits.k_per_split, GROUP=group_size, BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits.split_k, HAS_BIAS=bias is not None,
        DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x),
    )
    return out
