"""Pieces shared by the 4-bit kernels (int4_gemv, int4_gemm): reading a tile of a 4-bit weight in
ember's in-memory form (K-packed: int32 [K/8, N], row 8r + i of a column in bits 4i..4i+3 of
pack r; ember.quantization.int4_common), the one-row multiply-add over packs, and the group
correction that turns a product over raw 4-bit values into the dequantized one.

The kernels never dequantize a weight element. For a tile of K rows inside one group g,
sum_k x[k] * (q[k, n] - z[g, n]) * s[g, n] = s[g, n] * (sum_k x[k] q[k, n] - z[g, n] sum_k x[k]):
the product runs on q (0..15, exact in any float type) and each (row, column) of the output pays
one multiply-add per tile instead of each weight element paying a subtract and a multiply.
A tile therefore never straddles two groups: BLOCK_K divides the group size.

Nor does it convert integers to floats (a quarter-rate instruction on NVIDIA GPUs, which would
bound a 4-bit GEMV below the memory bandwidth): a float is built from its bit pattern. For the
tensor cores, q | 0x4300 is the bfloat16 128 + q (0x6400: the float16 1024 + q) and the
correction subtracts that offset with the zero point. For the one-row multiply-adds, nibble j
of a pack masked in place and or-ed into 0x4B000000 is the float32 2^23 + q * 16^j, exact
while q * 16^j < 2^23 (j <= 4; the top three nibbles are shifted down by 20 first): one mask and
one subtract per weight, with x pre-scaled by 16^-j (exact: a power of two). That path serves
float32 x. For half-precision x on a GPU, ``pack_dot_bf16x2`` computes a pack's eight products in
inline PTX on bfloat16 pairs: one mask-and-or (lop3) makes two nibbles the pair (128 + q_i,
128 + q_i+4), a packed subtract of (128 + z) makes them exactly q - z, and packed multiply-adds
take them with x's pair. The pack's four pairs accumulate in bfloat16 before one float32 add:
about 2.4 instructions per weight against 3 and more. Its rounding is that of bfloat16 products
summed over four weights (2^-9 relative on each pack's partial, the output's own precision),
well below the 4-bit weights' quantization error.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_packs(qw_ptr, k0, K, n0, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The int32 packs [BLOCK_K // 8, BLOCK_N] holding rows k0..k0 + BLOCK_K and columns n0.. of
    a weight stored K-packed ([K / 8, N]); 0 outside the weight or past row K."""
    offs_r = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = (offs_r < K // 8)[:, None] & (offs_n < N)[None, :]
    return tl.load(qw_ptr + offs_r.to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask,
                   other=0)


@triton.jit
def load_q_tile(qw_ptr, k0, K, n0, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The 4-bit values [BLOCK_K, BLOCK_N] (int32) of rows k0.. and columns n0..; 0 outside."""
    packs = load_packs(qw_ptr, k0, K, n0, N, BLOCK_K, BLOCK_N)
    shifts = tl.arange(0, 8) * 4
    q = (packs[:, None, :] >> shifts[None, :, None]) & 0xF
    return tl.reshape(q, (BLOCK_K, BLOCK_N))


@triton.jit
def _nibble_times(packs, MASK: tl.constexpr):
    """float32 q * 16^j of the nibble ``MASK`` selects (0xF << 4j, j <= 4), from bits."""
    return ((packs & MASK) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def pack_row_products(packs, x_ptr, k0, k_hi, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one row of x: (t [BLOCK_K // 8, BLOCK_N], xs [BLOCK_K // 8]) with t[r, n] =
    sum_i x[8r + i] q[8r + i, n] over the eight rows of pack r and xs[r] their x sum (float32;
    rows from k0, none past k_hi). Multiply-adds on the CUDA cores: the pack never leaves the
    thread that loaded it."""
    offs = k0 + 8 * tl.arange(0, BLOCK_K // 8)
    mask = offs < k_hi
    high = packs >> 20  # nibbles 5..7 at bits 0..11
    xs = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
    t = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(8):
        x = tl.load(x_ptr + offs + i, mask=mask, other=0.0).to(tl.float32)
        xs += x
        if i < 5:
            t += (x * (1.0 / (1 << (4 * i))))[:, None] * _nibble_times(packs, 0xF << (4 * i))
        else:
            t += (x * (1.0 / (1 << (4 * (i - 5)))))[:, None] * _nibble_times(
                high, 0xF << (4 * (i - 5)))
    return t, xs


@triton.jit
def pack_dot_bf16x2(packs, zeros2, x04, x15, x26, x37):
    """float32 sum_i x[i] (q[i] - z) of each pack (see the module docstring): ``zeros2`` the
    bfloat16 pair (128 + z, 128 + z) of the pack's column, ``xIJ`` the bfloat16 pair (x[I],
    x[J]) of the pack's rows, all as int32 bits. CUDA only (inline PTX, sm_90)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 qa, qb, qc, qd, sh;
        .reg .b16 lo, hi;
        .reg .f32 flo, fhi;
        lop3.b32 qa, $1, 0x000f000f, 0x43004300, 0xea;
        shr.u32 sh, $1, 4;
        lop3.b32 qb, sh, 0x000f000f, 0x43004300, 0xea;
        shr.u32 sh, $1, 8;
        lop3.b32 qc, sh, 0x000f000f, 0x43004300, 0xea;
        shr.u32 sh, $1, 12;
        lop3.b32 qd, sh, 0x000f000f, 0x43004300, 0xea;
        sub.rn.bf16x2 qa, qa, $2;
        sub.rn.bf16x2 qb, qb, $2;
        sub.rn.bf16x2 qc, qc, $2;
        sub.rn.bf16x2 qd, qd, $2;
        mul.rn.bf16x2 qa, qa, $3;
        fma.rn.bf16x2 qa, qb, $4, qa;
        fma.rn.bf16x2 qa, qc, $5, qa;
        fma.rn.bf16x2 qa, qd, $6, qa;
        mov.b32 {lo, hi}, qa;
        cvt.f32.bf16 flo, lo;
        cvt.f32.bf16 fhi, hi;
        add.f32 $0, flo, fhi;
        }""",
        constraints="=f,r,r,r,r,r,r",
        args=[packs, zeros2, x04, x15, x26, x37], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _bf16_pair(x_ptr, offs, mask, i: tl.constexpr):
    """int32 bits of the bfloat16 pair (x[offs + i], x[offs + i + 4]), the first in the low half."""
    lo = tl.load(x_ptr + offs + i, mask=mask, other=0.0).to(tl.bfloat16)
    hi = tl.load(x_ptr + offs + i + 4, mask=mask, other=0.0).to(tl.bfloat16)
    lo = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


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
def group_zero_scale(qz_ptr, s_ptr, g, n0, N, BLOCK_N: tl.constexpr):
    """Group ``g``'s zero points (int32) and scales (float32) [BLOCK_N] of columns n0.. (zeros
    packed eight columns to an int32, column 8c + i in bits 4i..4i+3)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    z = tl.load(qz_ptr + g * (N // 8) + offs_n // 8, mask=mask, other=0)
    z = (z >> ((offs_n % 8) * 4)) & 0xF
    s = tl.load(s_ptr + g * N + offs_n, mask=mask, other=0.0).to(tl.float32)
    return z, s


@triton.jit
def one_row_weights(qw_ptr, qz_ptr, s_ptr, k0, k_hi, n0, N, GROUP: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight-side loads of one tile (rows k0.., inside one group) of the one-row product:
    (packs, zero points, scales), all [BLOCK_K // 8, BLOCK_N]; 0 when k0 >= k_hi. Zero points
    and scales are read in the tile's shape (each column's repeated down the rows, from L1):
    read as vectors, they would be moved into the tile's layout through shared memory with
    block-wide barriers in every step."""
    packs = load_packs(qw_ptr, k0, k_hi, n0, N, BLOCK_K, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_K // 8)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = ((offs_n < N) & (k0 < k_hi))[None, :]
    g = k0 // GROUP
    z = tl.load(qz_ptr + g * (N // 8) + offs_n[None, :] // 8 + 0 * offs_r[:, None], mask=mask,
                other=0)
    z = (z >> ((offs_n % 8) * 4)[None, :]) & 0xF
    scale = tl.load(s_ptr + g * N + offs_n[None, :] + 0 * offs_r[:, None], mask=mask,
                    other=0.0).to(tl.float32)
    return packs, z, scale


@triton.jit
def one_row_x(x_ptr, k0, k_hi, BLOCK_K: tl.constexpr, PACKED_HALF: tl.constexpr):
    """The x-side loads of the same tile: with PACKED_HALF the bfloat16 pairs (x[8r + i],
    x[8r + i + 4]) for i = 0..3 as int32 bits [BLOCK_K // 8]; otherwise nothing is loaded
    ahead (the float32 path reads x as it multiplies) and four empty values stand in."""
    offs = k0 + 8 * tl.arange(0, BLOCK_K // 8)
    mask = offs < k_hi
    if PACKED_HALF:
        return (_bf16_pair(x_ptr, offs, mask, 0), _bf16_pair(x_ptr, offs, mask, 1),
                _bf16_pair(x_ptr, offs, mask, 2), _bf16_pair(x_ptr, offs, mask, 3))
    else:
        empty = tl.zeros([BLOCK_K // 8], dtype=tl.int32)
        return empty, empty, empty, empty


@triton.jit
def one_row_tile(weights, xpairs, x_ptr, k0, k_hi, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, PACKED_HALF: tl.constexpr):
    """[BLOCK_K // 8, BLOCK_N] float32: per pack row, the dequantized product of one row of x
    with the tile whose loads ``one_row_weights`` and ``one_row_x`` made."""
    packs, z, scale = weights
    if PACKED_HALF:
        x04, x15, x26, x37 = xpairs
        t = pack_dot_bf16x2(packs, (z | 0x4300) * 0x10001, x04[:, None], x15[:, None],
                            x26[:, None], x37[:, None])
        return t * scale
    else:
        t, xs = pack_row_products(packs, x_ptr, k0, k_hi, BLOCK_K, BLOCK_N)
        return (t - xs[:, None] * z.to(tl.float32)) * scale


@triton.jit
def group_correction(part, xsum, qz_ptr, s_ptr, g, n0, N, offset, BLOCK_N: tl.constexpr):
    """(part - xsum * (z + offset)) * s for group ``g``: ``part`` [M, BLOCK_N] = x . q over the
    tile's rows with q carrying ``offset`` (q_operand), ``xsum`` [M] = the sum of x over the
    same rows (both fp32)."""
    z, s = group_zero_scale(qz_ptr, s_ptr, g, n0, N, BLOCK_N)
    return (part - xsum[:, None] * (z.to(tl.float32) + offset)[None, :]) * s[None, :]
