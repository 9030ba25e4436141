"""w4a8_gemv: a 4-bit (AWQ / GPTQ) linear layer for 1-4 rows of int8 activations, in integer
dot products.

The bfloat16 GEMV (ember.kernels.int4_gemv) spends ~3.4 instructions a weight: more than an
SM issues while HBM delivers 4-bit weights at full rate, so it reads at about half the copy
bandwidth. Here x arrives quantized by the kernel that wrote it (ember.kernels.int8_act: int8,
one scale per row and 128 columns, in the packs' row order), and a pack's eight products are a
mask, a shift, a mask and two ``dp4a`` (four int8 products summed into an int32 each): under
one instruction a weight (the compiled loop, with its loads, addresses and the per-group
reduction, ~1.8 at one row; docs/benchmarks.md). Each sub-tile (inside one weight group and
one x group) sums its packs' integer dots and applies the scales once, in float32:
scale_w * (scale_x * dot - z * sums_x). Where weight groups are smaller than x's 128
columns, the sub-tile sums its own x bytes (two more dp4a a pack). The integer dot is exact;
the result differs from the bf16 GEMV's by the activations' 8-bit rounding (per group of 128:
half a step of amax / 127).

The weight streams as in int4_gemv (ember.kernels.int4_tile: column-major packs, two tiles in
flight per thread, the first two loaded before the PDL wait); K splits merge in the kernel
(ember.kernels.split_k). Where every tile is whole (EVEN) a tile loads under one predicate,
without per-element masks. With 2-4 rows each pack is unpacked once for all of them. Without
a GPU (the interpreter) dp4a is computed from its bytes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.int4_gemv import row_sub_tile, with_splits
from ember.kernels.int4_tile import row_tile_weights, store_row_totals, stream_start, tile_load
from ember.kernels.int8_act import GROUP as X_GROUP
from ember.kernels.launch import cdiv, compiled_for_gpu, num_sms, pdl_options
from ember.kernels.split_k import split_k_launch
from ember.kernels.tuning import DeviceTuning, Int4GemvConfig, tuning_for

MAX_ROWS = 4


@triton.jit
def _nibble_bytes(packs):
    """(low, high): a pack's nibbles as bytes, rows 0, 4, 1, 5 and rows 2, 6, 3, 7."""
    return packs & 0x0F0F0F0F, (packs >> 4) & 0x0F0F0F0F


@triton.jit
def _dp4a_emulated(u, s, acc):
    """dp4a.u32.s32 from its bytes: unsigned bytes of ``u`` times signed bytes of ``s``."""
    for i in tl.static_range(4):
        acc += ((u >> (8 * i)) & 0xFF) * ((s << (24 - 8 * i)) >> 24)
    return acc


@triton.jit
def _pack_dot(low, high, xa, xb, ASM: tl.constexpr):
    """int32: a pack's eight products with one row's int8 x (words xa, xb)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            dp4a.u32.s32 $0, $1, $3, 0;
            dp4a.u32.s32 $0, $2, $4, $0;
            }""",
            constraints="=r,r,r,r,r", args=[low, high, xa, xb], dtype=tl.int32, is_pure=True,
            pack=1)
    return _dp4a_emulated(high, xb, _dp4a_emulated(low, xa, tl.zeros_like(low)))


@triton.jit
def _x_tile(x_ptr, xs_ptr, xsum_ptr, k0, k_hi, XG: tl.constexpr, SUB: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
            ASM: tl.constexpr):
    """One row's int8 x for a tile: the words (xa, xb) [BLOCK_N, BLOCK_K / SUB, SUB / 8] of
    each pack (``x_ptr``: the row as int64, one a pack; the same for every column) and each
    sub-tile's scale and sum [BLOCK_N, BLOCK_K / SUB]."""
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    inside = sub_start < k_hi
    # Loaded at the weight tile's shape (every column's thread its own copy, from L1): in
    # the packs' own register layout, where a [BLOCK_K / SUB, SUB / 8] load would be moved
    # there through shared memory every tile.
    packs_at = (tl.zeros([BLOCK_N, 1, 1], tl.int32) + (sub_start // 8)[None, :, None]
                + tl.arange(0, SUB // 8)[None, None, :])
    groups_at = tl.zeros([BLOCK_N, 1], tl.int32) + (sub_start // XG)[None, :]
    words = tile_load(x_ptr + packs_at, inside[None, :, None], k0 < k_hi, EVEN)
    xs = tile_load(xs_ptr + groups_at, inside[None, :], k0 < k_hi, EVEN)
    xa = words.to(tl.int32)  # the low word: rows 0, 4, 1, 5 (int8_act's order)
    xb = (words >> 32).to(tl.int32)
    if SUB < XG:  # weight groups smaller than x's: the sub-tile's own sum of x
        ones = tl.full(xa.shape, 0x01010101, tl.int32)
        xsum = tl.sum(_pack_dot(ones, ones, xa, xb, ASM), axis=2).to(tl.float32) * xs
    else:
        xsum = tile_load(xsum_ptr + groups_at, inside[None, :], k0 < k_hi, EVEN)
    return xa, xb, xs, xsum


@triton.jit
def _rows_x(x_ptr, xs_ptr, xsum_ptr, stride_x, stride_xs, k0, k_hi, ROWS: tl.constexpr,
            XG: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
            EVEN: tl.constexpr, ASM: tl.constexpr):
    """``_x_tile`` of rows 0..3; rows past ROWS stand in as row 0's and are never used."""
    x0 = _x_tile(x_ptr, xs_ptr, xsum_ptr, k0, k_hi, XG, SUB, BLOCK_K, BLOCK_N, EVEN, ASM)
    x1 = x0
    x2 = x0
    x3 = x0
    if ROWS > 1:
        x1 = _x_tile(x_ptr + stride_x, xs_ptr + stride_xs, xsum_ptr + stride_xs, k0, k_hi, XG,
                     SUB, BLOCK_K, BLOCK_N, EVEN, ASM)
    if ROWS > 2:
        x2 = _x_tile(x_ptr + 2 * stride_x, xs_ptr + 2 * stride_xs, xsum_ptr + 2 * stride_xs,
                     k0, k_hi, XG, SUB, BLOCK_K, BLOCK_N, EVEN, ASM)
    if ROWS > 3:
        x3 = _x_tile(x_ptr + 3 * stride_x, xs_ptr + 3 * stride_xs, xsum_ptr + 3 * stride_xs,
                     k0, k_hi, XG, SUB, BLOCK_K, BLOCK_N, EVEN, ASM)
    return x0, x1, x2, x3


@triton.jit
def _row_product(low, high, zf, scale, x, ASM: tl.constexpr):
    """[BLOCK_N, BLOCK_K / SUB] float32: each sub-tile's dequantized product with one row."""
    xa, xb, xs, xsum = x
    dot = tl.sum(_pack_dot(low, high, xa, xb, ASM), axis=2)
    return scale * (dot.to(tl.float32) * xs - zf * xsum)


@triton.jit
def _tile_product(weights, xs, accs, ROWS: tl.constexpr, ASM: tl.constexpr):
    packs, z, scale = weights
    x0, x1, x2, x3 = xs
    acc0, acc1, acc2, acc3 = accs
    low, high = _nibble_bytes(packs)
    zf = z.to(tl.float32)
    acc0 += _row_product(low, high, zf, scale, x0, ASM)
    if ROWS > 1:
        acc1 += _row_product(low, high, zf, scale, x1, ASM)
    if ROWS > 2:
        acc2 += _row_product(low, high, zf, scale, x2, ASM)
    if ROWS > 3:
        acc3 += _row_product(low, high, zf, scale, x3, ASM)
    return acc0, acc1, acc2, acc3


@triton.jit
def _w4a8_gemv_kernel(x_ptr, xs_ptr, xsum_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr,
                      part_ptr, counters_ptr, N, K, K8, k_per_split, stride_x, stride_xs,
                      stride_o, GROUP: tl.constexpr, XG: tl.constexpr, SUB: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, WIDE_LOADS: tl.constexpr, ROWS: tl.constexpr,
                      ROWS_P: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr,
                      PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n0, k_lo, k_hi, K8, w_first, w_second = stream_start(
        qw_ptr, qz_ptr, s_ptr, N, K, K8, k_per_split, GROUP, SUB, BLOCK_N, BLOCK_K, WIDE_LOADS,
        PDL, EVEN)
    x_first = _rows_x(x_ptr, xs_ptr, xsum_ptr, stride_x, stride_xs, k_lo, k_hi, ROWS, XG, SUB,
                      BLOCK_K, BLOCK_N, EVEN, ASM)
    x_second = _rows_x(x_ptr, xs_ptr, xsum_ptr, stride_x, stride_xs, k_lo + BLOCK_K, k_hi, ROWS,
                       XG, SUB, BLOCK_K, BLOCK_N, EVEN, ASM)
    zero = tl.zeros([BLOCK_N, BLOCK_K // SUB], dtype=tl.float32)
    accs = (zero, zero, zero, zero)
    for k0 in range(k_lo, k_hi, 2 * BLOCK_K):
        accs = _tile_product(w_first, x_first, accs, ROWS, ASM)
        w_first = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0 + 2 * BLOCK_K, k_hi, n0, N, K8,
                                   GROUP, SUB, BLOCK_K, BLOCK_N, EVEN)
        x_first = _rows_x(x_ptr, xs_ptr, xsum_ptr, stride_x, stride_xs, k0 + 2 * BLOCK_K, k_hi,
                          ROWS, XG, SUB, BLOCK_K, BLOCK_N, EVEN, ASM)
        accs = _tile_product(w_second, x_second, accs, ROWS, ASM)
        w_second = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0 + 3 * BLOCK_K, k_hi, n0, N, K8,
                                    GROUP, SUB, BLOCK_K, BLOCK_N, EVEN)
        x_second = _rows_x(x_ptr, xs_ptr, xsum_ptr, stride_x, stride_xs, k0 + 3 * BLOCK_K, k_hi,
                           ROWS, XG, SUB, BLOCK_K, BLOCK_N, EVEN, ASM)
    acc0, acc1, acc2, acc3 = accs
    t0 = tl.sum(acc0, 1)
    t1 = t0
    t2 = t0
    t3 = t0
    if ROWS > 1:
        t1 = tl.sum(acc1, 1)
    if ROWS > 2:
        t2 = tl.sum(acc2, 1)
    if ROWS > 3:
        t3 = tl.sum(acc3, 1)
    store_row_totals(t0, t1, t2, t3, n0, N, bias_ptr, out_ptr, stride_o, part_ptr, counters_ptr,
                     pid_n, pid_k, ROWS, ROWS_P, BLOCK_N, SPLIT_K, HAS_BIAS)


def w4a8_gemv_config(n: int, k: int, device: torch.device, rows: int = 1) -> Int4GemvConfig:
    """The tuned tiles for ``rows`` rows and an [k, n] weight on ``device``
    (ember.kernels.tuning), K splits resolved as int4_gemv resolves them."""
    return _resolved_config(tuning_for(device), n, k, num_sms(device), rows)


@functools.lru_cache(maxsize=1024)
def _resolved_config(tuning: DeviceTuning, n: int, k: int, sms: int, rows: int) -> Int4GemvConfig:
    return with_splits(tuning.w4a8_gemv_config(n, k, rows), n, k, sms)


def w4a8_gemv(xq: torch.Tensor, x_scales: torch.Tensor, x_sums: torch.Tensor,
              qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              group_size: int, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              config: tuple | None = None) -> torch.Tensor:
    """int8 rows (``xq`` [M <= MAX_ROWS, K] with their scales and sums [M, K / 128], the form
    of ember.kernels.int8_act) times the 4-bit weight in ember's form (qweight [N, K/8] column
    major, qzeros [G, N/8], scales [G, N]); ``group_size`` rows per group. Output [M, N] in
    ``out_dtype``. ``config`` (an Int4GemvConfig or its leading fields, K splits given)
    overrides the tuned one."""
    m, k = xq.shape
    n = qweight.shape[0]
    assert 1 <= m <= MAX_ROWS and qweight.shape[1] * 8 == k and scales.shape[1] == n
    assert xq.dtype == torch.int8 and xq.is_contiguous() and k % X_GROUP == 0
    assert x_scales.shape == x_sums.shape == (m, k // X_GROUP)
    assert x_scales.is_contiguous() and x_sums.is_contiguous()
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if n == 0:
        return out
    block_n, block_k, split_k, num_warps, num_stages, wide_loads, _ = (
        Int4GemvConfig(*config) if config else w4a8_gemv_config(n, k, xq.device, m))
    n_tiles = cdiv(n, block_n)
    sub = row_sub_tile(min(group_size, X_GROUP), block_k)
    splits = split_k_launch(k, split_k, 2 * block_k, m, n, n_tiles, out)
    x_words = xq.view(torch.int64)  # one int64 a pack: its two words of x
    _w4a8_gemv_kernel[(n_tiles, splits.split_k)](
        x_words, x_scales, x_sums, qweight, qzeros, scales,
        bias if bias is not None else scales, out, splits.partials, splits.counters, n, k,
        k // 8, splits.k_per_split, x_words.stride(0), x_scales.stride(0), out.stride(0),
        GROUP=group_size, XG=X_GROUP, SUB=sub, BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=splits.split_k, HAS_BIAS=bias is not None, WIDE_LOADS=wide_loads, ROWS=m,
        ROWS_P=1 << (m - 1).bit_length(), EVEN=n % block_n == 0 and k % (2 * block_k) == 0,
        ASM=compiled_for_gpu(xq), num_warps=num_warps,
        num_stages=num_stages, **pdl_options(xq))
    return out
