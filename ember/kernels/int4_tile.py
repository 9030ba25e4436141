"""Pieces shared by the 4-bit kernels (int4_gemv, int4_gemm): reading a tile of a 4-bit weight
in ember's in-memory form (AWQ's layout, ember.quantization.int4_common) and the group
correction that turns a dot over raw 4-bit values into the dequantized product.

The kernels never dequantize a weight element. For a tile of K rows inside one group g,
sum_k x[k] * (q[k, n] - z[g, n]) * s[g, n] = s[g, n] * (sum_k x[k] q[k, n] - z[g, n] sum_k x[k]):
the dot runs on q (0..15, exact in any float type) and each (row, column) of the output pays
one multiply-add per tile instead of each weight element paying a subtract and a multiply.
A tile therefore never straddles two groups: BLOCK_K divides the group size.

Nor does it convert integers to floats (a quarter-rate instruction on NVIDIA GPUs, which would
bound a 4-bit GEMV below the memory bandwidth): a 16-bit operand is built from its bit pattern,
q | 0x4300 being the bfloat16 128 + q (0x6400: the float16 1024 + q), and the correction
subtracts that offset with the zero point (float32, where products of such values would round,
subtracts 2^23 exactly instead: ``q_operand``).
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
def q_operand(q, DTYPE: tl.constexpr):
    """4-bit values q (int32, 0..15) as ``DTYPE`` values offset by ``q_offset(DTYPE)``, made
    from bit patterns (see the module docstring)."""
    if DTYPE == tl.bfloat16:
        return (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float16:
        return (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def q_offset(DTYPE: tl.constexpr):
    if DTYPE == tl.bfloat16:
        return 128.0
    elif DTYPE == tl.float16:
        return 1024.0
    else:
        return 0.0


@triton.jit
def group_correction(part, xsum, qz_ptr, s_ptr, g, n0, N, NP, offset, BLOCK_N: tl.constexpr):
    """(part - xsum * (z + offset)) * s for group ``g``: ``part`` [M, BLOCK_N] = x . q over the
    tile's rows with q carrying ``offset`` (q_operand), ``xsum`` [M] = the sum of x over the
    same rows (both fp32)."""
    offs_p = n0 // 8 + tl.arange(0, BLOCK_N // 8)
    z = tl.load(qz_ptr + g * NP + offs_p, mask=offs_p < NP, other=0)
    z = expand_packs(z, BLOCK_N).to(tl.float32) + offset
    offs_n = n0 + tl.arange(0, BLOCK_N)
    s = tl.load(s_ptr + g.to(tl.int64) * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    return (part - xsum[:, None] * z[None, :]) * s[None, :]
