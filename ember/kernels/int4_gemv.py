"""int4_gemv: a 4-bit (AWQ / GPTQ) linear layer for 1-4 rows, streaming the packed weight.

Decoding a few sequences, the layer is a read of its weight: 4-bit storage moves a quarter of a
bf16 weight's bytes, so the kernel's job is to keep HBM busy. One program per BLOCK_N output
columns (times K splits) reads each column's packs (ember's column-major form) as one
contiguous run, BLOCK_K rows a step, and multiplies on the CUDA cores (bfloat16 pairs in
inline PTX on a GPU, ember.kernels.int4_tile: no layout change, no shared memory); a partial
per pack, summed once at the end. The loads of two tiles are in flight per thread, the
weight's first two before the PDL wait; whether each thread loads its packs 16 bytes at a time
or 8 is tuned per shape (ember.kernels.tuning). With 2-4 rows (ROWS, a constexpr) each pack
is unpacked once and multiplied with every row: the arithmetic grows by the products only, and
a row's result is bit for bit its one-row launch with the same tiles. K splits merge in the
kernel (ember.kernels.split_k: deterministic, no second kernel). More rows take the weight
dequantized for the call and cuBLAS (ember.kernels.int4_dequant)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.int4_tile import (
    row_tile_weights,
    rows_tile_product,
    rows_tile_x,
    store_row_totals,
    stream_start,
)
from ember.kernels.launch import cdiv, compiled_for_gpu, num_sms, pdl_options
from ember.kernels.split_k import split_k_launch
from ember.kernels.tuning import DeviceTuning, Int4GemvConfig, tuning_for

MAX_ROWS = 4  # rows one launch takes; the layer dequantizes the weight for more


@triton.jit
def _int4_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
                      N, K, K8, k_per_split, stride_x, stride_o, GROUP: tl.constexpr,
                      SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED_HALF: tl.constexpr,
                      X_WORDS: tl.constexpr, WIDE_LOADS: tl.constexpr, ROWS: tl.constexpr,
                      ROWS_P: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # A register double buffer without copies: the loop body takes two tiles and reissues each
    # one's loads right after its arithmetic.
    n0, k_lo, k_hi, K8, w_first, w_second = stream_start(
        qw_ptr, qz_ptr, s_ptr, N, K, K8, k_per_split, GROUP, SUB, BLOCK_N, BLOCK_K, WIDE_LOADS,
        PDL)
    x_first = rows_tile_x(x_ptr, stride_x, k_lo, k_hi, ROWS, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    x_second = rows_tile_x(x_ptr, stride_x, k_lo + BLOCK_K, k_hi, ROWS, SUB, BLOCK_K,
                           PACKED_HALF, X_WORDS)
    zero = tl.zeros([BLOCK_N, BLOCK_K // SUB, SUB // 8], dtype=tl.float32)
    accs = (zero, zero, zero, zero)
    for k0 in range(k_lo, k_hi, 2 * BLOCK_K):
        accs = rows_tile_product(w_first, x_first, accs, x_ptr, stride_x, k0, k_hi, ROWS, SUB,
                                 BLOCK_K, PACKED_HALF)
        w_first = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0 + 2 * BLOCK_K, k_hi, n0, N, K8,
                                   GROUP, SUB, BLOCK_K, BLOCK_N)
        x_first = rows_tile_x(x_ptr, stride_x, k0 + 2 * BLOCK_K, k_hi, ROWS, SUB, BLOCK_K,
                              PACKED_HALF, X_WORDS)
        accs = rows_tile_product(w_second, x_second, accs, x_ptr, stride_x, k0 + BLOCK_K, k_hi,
                                 ROWS, SUB, BLOCK_K, PACKED_HALF)
        w_second = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0 + 3 * BLOCK_K, k_hi, n0, N, K8,
                                    GROUP, SUB, BLOCK_K, BLOCK_N)
        x_second = rows_tile_x(x_ptr, stride_x, k0 + 3 * BLOCK_K, k_hi, ROWS, SUB, BLOCK_K,
                               PACKED_HALF, X_WORDS)
    acc0, acc1, acc2, acc3 = accs
    t0 = tl.sum(tl.sum(acc0, 2), 1)
    t1 = t0
    t2 = t0
    t3 = t0
    if ROWS > 1:
        t1 = tl.sum(tl.sum(acc1, 2), 1)
    if ROWS > 2:
        t2 = tl.sum(tl.sum(acc2, 2), 1)
    if ROWS > 3:
        t3 = tl.sum(tl.sum(acc3, 2), 1)
    store_row_totals(t0, t1, t2, t3, n0, N, bias_ptr, out_ptr, stride_o, part_ptr, counters_ptr,
                     pid_n, pid_k, ROWS, ROWS_P, BLOCK_N, SPLIT_K, HAS_BIAS)


def row_sub_tile(group_size: int, block_k: int) -> int:
    """Rows per sub-tile of the GEMV: the largest power of two <= block_k dividing
    the group (a group is a multiple of 8 rows), so no sub-tile straddles two groups."""
    sub = 1 << (min(group_size, block_k).bit_length() - 1)
    while sub > 8 and group_size % sub:
        sub //= 2
    return sub


def int4_gemv_config(n: int, k: int, device: torch.device, rows: int = 1) -> Int4GemvConfig:
    """The tuned tiles for ``rows`` rows and an [k, n] weight on ``device``
    (ember.kernels.tuning), with the K splits resolved: a split of 0 splits K until the grid
    holds the entry's programs per SM (each split at least two steps of K)."""
    return _resolved_config(tuning_for(device), n, k, num_sms(device), rows)


@functools.lru_cache(maxsize=1024)
def _resolved_config(tuning: DeviceTuning, n: int, k: int, sms: int,
                     rows: int = 1) -> Int4GemvConfig:
    return with_splits(tuning.int4_gemv_config(n, k, rows), n, k, sms)


def with_splits(config: Int4GemvConfig, n: int, k: int, sms: int) -> Int4GemvConfig:
    """``config`` with its K splits resolved (a split of 0: until the grid holds the entry's
    programs per SM on ``sms`` SMs, each split at least two steps of K)."""
    if config.split_k == 0:
        split_k = max(1, min(cdiv(config.programs_per_sm * sms, cdiv(n, config.block_n)),
                             cdiv(k, 2 * config.block_k)))
        config = config._replace(split_k=split_k)
    return config


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int, bias: torch.Tensor | None = None,
              config: tuple | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] times the 4-bit weight in ember's form (qweight [N, K/8] column
    major, qzeros [G, N/8], scales [G, N]); ``group_size`` rows per group (K for one group).
    Output in x's dtype. ``config`` (an Int4GemvConfig or its leading fields, K splits given)
    overrides the tuned one."""
    m, k = x.shape
    n = qweight.shape[0]
    assert 1 <= m <= MAX_ROWS and qweight.shape[1] * 8 == k and scales.shape[1] == n
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    block_n, block_k, split_k, num_warps, num_stages, wide_loads, _ = (
        Int4GemvConfig(*config) if config else int4_gemv_config(n, k, x.device, m))
    n_tiles = cdiv(n, block_n)
    sub = row_sub_tile(group_size, block_k)
    splits = split_k_launch(k, split_k, 2 * block_k, m, n, n_tiles, out)
    packed_half = x.dtype != torch.float32 and compiled_for_gpu(x)
    # A bfloat16 row read as int32 words holds the x pairs the kernel multiplies (a view that
    # needs 4-byte alignment: rows starting at an odd element convert their pairs instead).
    words = (packed_half and x.dtype == torch.bfloat16 and x.storage_offset() % 2 == 0
             and (m == 1 or x.stride(0) % 2 == 0))
    x_arg = x.view(torch.int32) if words else x
    args = (x_arg, qweight, qzeros, scales, bias if bias is not None else scales, out,
            splits.partials, splits.counters, n, k, k // 8, splits.k_per_split)
    meta = dict(GROUP=group_size, SUB=sub, BLOCK_N=block_n, BLOCK_K=block_k,
                SPLIT_K=splits.split_k, HAS_BIAS=bias is not None, PACKED_HALF=packed_half,
                X_WORDS=words, WIDE_LOADS=wide_loads, num_warps=num_warps,
                num_stages=num_stages, **pdl_options(x))
    _int4_gemv_kernel[(n_tiles, splits.split_k)](*args, x_arg.stride(0), out.stride(0), ROWS=m,
                                                 ROWS_P=1 << (m - 1).bit_length(), **meta)
    return out
