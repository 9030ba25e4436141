"""Pieces shared by the 4-bit kernels (int4_gemv, int4_gemm): reading a tile of a 4-bit weight
in ember's in-memory form (AWQ's layout, ember.quantization.int4_common) and the group
correction that turns a dot over raw 4-bit values into the dequantized product.

The kernels never dequantize a weight element. For a tile of K rows inside one group g,
sum_k x[k] * (q[k, n] - z[g, n]) * s[g, n] = s[g, n] * (sum_k x[k] q[k, n] - z[g, n] sum_k x[k]):
the dot runs on q (0..15, exact in any float type) and each (row, column) of the output pays
one multiply-add per tile instead of each weight element paying a subtract and a multiply.
A tile therefore never straddles two groups: BLOCK_K divides the group size.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def awq_shifts(BLOCK_N: tl.constexpr):
    """Bit offset of each of BLOCK_N columns in its int32 pack: AWQ stores column 8c + j at
    4 * i where AWQ_ORDER[i] = j, i.e. i = j // 2 + 4 * (j % 2)."""
    j = tl.arange(0, BLOCK_N) % 8
    return ((j // 2) + (j % 2) * 4) * 4


@triton.jit
def expand_packs(packed, BLOCK_N: tl.constexpr):
    """[R, BLOCK_N // 8] (or [BLOCK_N // 8]) int32 packs -> the 4-bit values [R, BLOCK_N]: each
    pack repeated 8 times along the last dim (three interleaves), then shifted per column."""
    packed = tl.interleave(packed, packed)
    packed = tl.interleave(packed, packed)
    packed = tl.interleave(packed, packed)
    return (packed >> awq_shifts(BLOCK_N)) & 0xF


@triton.jit
def load_q_tile(qw_ptr, k0, K, n0, NP, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 4-bit values [BLOCK_K, BLOCK_N] (int32) of rows k0.. and columns n0.. of a weight
    stored as [K, NP = N / 8] int32 packs; 0 outside the weight."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_p = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    mask = (offs_k < K)[:, None] & (offs_p < NP)[None, :]
    packed = tl.load(qw_ptr + offs_k.to(tl.int64)[:, None] * NP + offs_p[None, :], mask=mask,
                     other=0)
    return expand_packs(packed, BLOCK_N)


@triton.jit
def group_correction(part, xsum, qz_ptr, s_ptr, g, n0, N, NP, BLOCK_N: tl.constexpr):
    """(part - xsum * z) * s for group ``g``: ``part`` [M, BLOCK_N] = x . q over the tile's
    rows, ``xsum`` [M] = the sum of x over the same rows (both fp32)."""
    offs_p = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    z = tl.load(qz_ptr + g * NP + offs_p, mask=offs_p < NP, other=0)
    z = expand_packs(z, BLOCK_N).to(tl.float32)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    s = tl.load(s_ptr + g.to(tl.int64) * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    return (part - xsum[:, None] * z[None, :]) * s[None, :]
