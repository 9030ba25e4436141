"""The 4-bit GEMV's tiles (ember.kernels.int4_gemv): reading a tile of a weight in ember's
in-memory form (column major: int32 [N, K/8], pack r of a column holding rows 8r + 2s and
8r + 2s + 1 in bits 4s and 16 + 4s; ember.quantization.int4_common) with its zero points,
scales and 1-4 rows of x, and the product over packs. A tile is read in sub-tiles that each
lie inside one group, so each pack's partial takes its group's zero and scale once.

The kernel never converts integers to floats (a quarter-rate instruction on NVIDIA GPUs, which
would bound a 4-bit GEMV below the memory bandwidth): a float is built from its bit pattern.
For half-precision x on a GPU the products run in inline PTX on bfloat16 pairs:
``unpack_pairs_bf16x2`` makes, with one mask-and-or (lop3) of the pack shifted by 4s, the pair
(128 + q[2s], 128 + q[2s + 1]) and with a packed subtract of (128 + z) exactly q - z, once for
every row; ``two_packs_dot_bf16x2`` takes two packs' pairs (the even and odd pack of a
thread's pair, split in registers) with x's pairs (x[2s], x[2s + 1]), which a bfloat16 row
holds in one 32-bit word (read as int64 words, a pack's four pairs in two loads), in one chain
of eight packed multiply-adds; the pair's halves become float32 by their bits. At one row the
loop issues about 2.8 instructions a weight as ptxas compiles it (64 x 256 tiles; 3.4 with a
dot a pack and the zero points and scales moved apart). Its rounding is that of
bfloat16 products summed over eight weights (2^-9 relative on each partial, the output's own
precision), well below the 4-bit weights' quantization error. The zero point and the scale of
a (column, sub-tile) travel to the packs' layout as one int64 (one layout change a tile, made
where each thread holds one). float32 x (and the interpreter) takes float32 multiply-adds with
the zero point applied per pack."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pair_shift(j):
    """Bit offset of row j (0..7, a constexpr or a tensor) of a pack: rows 2s and 2s + 1 sit
    at 4s and 16 + 4s."""
    return (j % 2) * 16 + (j // 2) * 4


@triton.jit
def unpack_pairs_bf16x2(packs, zeros2):
    """The four bfloat16 pairs (q[2s] - z, q[2s + 1] - z) of each pack, as int32 bits: one
    ``lop3`` a pair and a packed subtract (with several rows of x, once for all of them). CUDA
    only."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 sh;
        lop3.b32 $0, $4, 0x000f000f, 0x43004300, 0xea;
        shr.u32 sh, $4, 4;
        lop3.b32 $1, sh, 0x000f000f, 0x43004300, 0xea;
        shr.u32 sh, $4, 8;
        lop3.b32 $2, sh, 0x000f000f, 0x43004300, 0xea;
        shr.u32 sh, $4, 12;
        lop3.b32 $3, sh, 0x000f000f, 0x43004300, 0xea;
        sub.rn.bf16x2 $0, $0, $5;
        sub.rn.bf16x2 $1, $1, $5;
        sub.rn.bf16x2 $2, $2, $5;
        sub.rn.bf16x2 $3, $3, $5;
        }""",
        constraints="=r,=r,=r,=r,r,r",
        args=[packs, zeros2], dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
        pack=1)


@triton.jit
def two_packs_dot_bf16x2(qa01, qa23, qa45, qa67, qb01, qb23, qb45, qb67, xa01, xa23, xa45, xa67,
                         xb01, xb23, xb45, xb67):
    """float32 sum of two packs' sixteen products (packs a and b of one column and group, from
    their unpacked pairs and one row's x pairs): bfloat16 multiply-adds into one pair, whose
    halves become float32 by their bits (a shift and a mask) and are added. CUDA only."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 acc, lo, hi;
        mul.rn.bf16x2 acc, $1, $9;
        fma.rn.bf16x2 acc, $2, $10, acc;
        fma.rn.bf16x2 acc, $3, $11, acc;
        fma.rn.bf16x2 acc, $4, $12, acc;
        fma.rn.bf16x2 acc, $5, $13, acc;
        fma.rn.bf16x2 acc, $6, $14, acc;
        fma.rn.bf16x2 acc, $7, $15, acc;
        fma.rn.bf16x2 acc, $8, $16, acc;
        shl.b32 lo, acc, 16;
        and.b32 hi, acc, 0xffff0000;
        add.f32 $0, lo, hi;
        }""",
        constraints="=f,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        args=[qa01, qa23, qa45, qa67, qb01, qb23, qb45, qb67, xa01, xa23, xa45, xa67, xb01,
              xb23, xb45, xb67], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0, k_hi, n0, N, K8, GROUP: tl.constexpr,
                     SUB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     MASKED: tl.constexpr = True):
    """The weight-side loads of one tile of the one-row product, rows k0..k0 + BLOCK_K in
    sub-tiles of SUB rows (each inside one group) of a weight with K8 packs a column: (packs
    [BLOCK_N, BLOCK_K / SUB, SUB / 8], zero points and scales [BLOCK_N, BLOCK_K / SUB], the
    scales as stored); 0 past k_hi and N unless MASKED is false (the tile lies inside both). A
    column's packs are one contiguous run."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    # Row offsets are never negative: shifts, not the signed division's rounding fix-ups.
    rows = (sub_start >> 3)[None, :, None] + tl.arange(0, SUB // 8)[None, None, :]
    pack_ptrs = qw_ptr + offs_n.to(tl.int64)[:, None, None] * K8 + rows
    g = (sub_start.to(tl.uint32) // GROUP).to(tl.int32)[None, :]
    z_ptrs = qz_ptr + g * (N // 8) + (offs_n >> 3)[:, None]
    s_ptrs = s_ptr + g * N + offs_n[:, None]
    if MASKED:
        mask = (offs_n < N)[:, None] & (sub_start < k_hi)[None, :]
        packs = tl.load(pack_ptrs, mask=mask[:, :, None], other=0)
        z = tl.load(z_ptrs, mask=mask, other=0)
        scale = tl.load(s_ptrs, mask=mask, other=0.0)
    else:
        packs = tl.load(pack_ptrs)
        z = tl.load(z_ptrs)
        scale = tl.load(s_ptrs)
    z = (z >> ((offs_n % 8) * 4)[:, None]) & 0xF
    return packs, z, scale


@triton.jit
def _bf16_pair(x_ptr, offs, mask):
    """int32 bits of the bfloat16 pair (x[offs], x[offs + 1]), the first in the low half."""
    lo = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.bfloat16)
    hi = tl.load(x_ptr + offs + 1, mask=mask, other=0.0).to(tl.bfloat16)
    lo = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _words(x64):
    """The two bfloat16 pairs an int64 of x holds, as int32 bits (the low word first)."""
    return x64.to(tl.int32), (x64 >> 32).to(tl.int32)


@triton.jit
def row_tile_x(x_ptr, k0, k_hi, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
               PACKED_HALF: tl.constexpr, X_WORDS: tl.constexpr, MASKED: tl.constexpr = True):
    """The x-side loads of the same tile. With PACKED_HALF: for the even and the odd packs
    ([BLOCK_K / SUB, SUB / 16] each) the four bfloat16 pairs (x[8r + 2s], x[8r + 2s + 1]) as
    int32 bits (X_WORDS: x is bfloat16 and ``x_ptr`` its int64 view, two loads a pack; else x
    is converted). Otherwise nothing is loaded ahead (the float path reads x as it multiplies)
    and empty values stand in."""
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    # Packs 2p + e of each sub-tile: [BLOCK_K / SUB, SUB / 16, 2], split into e = 0 and 1.
    rows = ((sub_start >> 3)[:, None, None] + 2 * tl.arange(0, SUB // 16)[None, :, None]
            + tl.arange(0, 2)[None, None, :])
    mask = (sub_start < k_hi)[:, None, None]
    if PACKED_HALF:
        if X_WORDS:
            if MASKED:
                x0123 = tl.load(x_ptr + 2 * rows, mask=mask, other=0)
                x4567 = tl.load(x_ptr + 2 * rows + 1, mask=mask, other=0)
            else:
                x0123 = tl.load(x_ptr + 2 * rows)
                x4567 = tl.load(x_ptr + 2 * rows + 1)
            x0123_a, x0123_b = tl.split(x0123)
            x4567_a, x4567_b = tl.split(x4567)
            xa01, xa23 = _words(x0123_a)
            xa45, xa67 = _words(x4567_a)
            xb01, xb23 = _words(x0123_b)
            xb45, xb67 = _words(x4567_b)
        else:
            xa01, xb01 = tl.split(_bf16_pair(x_ptr, 8 * rows, mask))
            xa23, xb23 = tl.split(_bf16_pair(x_ptr, 8 * rows + 2, mask))
            xa45, xb45 = tl.split(_bf16_pair(x_ptr, 8 * rows + 4, mask))
            xa67, xb67 = tl.split(_bf16_pair(x_ptr, 8 * rows + 6, mask))
        return (xa01, xa23, xa45, xa67), (xb01, xb23, xb45, xb67)
    else:
        empty = tl.zeros([BLOCK_K // SUB, SUB // 16], dtype=tl.int32)
        return (empty, empty, empty, empty), (empty, empty, empty, empty)


@triton.jit
def _float_row_product(packs, z, scale, x_ptr, k0, k_hi, SUB: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / SUB, SUB / 8] float32: per pack, the dequantized product of the row
    of x at ``x_ptr`` with the tile, in float32 multiply-adds with the zero point applied per
    pack (float32 x, and the interpreter)."""
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    offs = (sub_start[:, None] + 8 * tl.arange(0, SUB // 8)[None, :])[None, :, :]
    mask = (sub_start < k_hi)[None, :, None]
    t = tl.zeros(packs.shape, dtype=tl.float32)
    xs = tl.zeros(offs.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        x = tl.load(x_ptr + offs + j, mask=mask, other=0.0).to(tl.float32)
        t += ((packs >> pair_shift(j)) & 0xF).to(tl.float32) * x
        xs += x
    return (t - xs * z.to(tl.float32)[:, :, None]) * scale.to(tl.float32)[:, :, None]


@triton.jit
def rows_tile_x(x_ptr, stride_x, k0, k_hi, ROWS: tl.constexpr, SUB: tl.constexpr,
                BLOCK_K: tl.constexpr, PACKED_HALF: tl.constexpr, X_WORDS: tl.constexpr,
                MASKED: tl.constexpr = True):
    """``row_tile_x`` of rows 0..3 of x (``stride_x`` apart, in x_ptr's elements); the rows
    past ROWS (1-4) stand in as row 0's tile and are never used."""
    x0 = row_tile_x(x_ptr, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS, MASKED)
    x1 = x0
    x2 = x0
    x3 = x0
    if ROWS > 1:
        x1 = row_tile_x(x_ptr + stride_x, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS, MASKED)
    if ROWS > 2:
        x2 = row_tile_x(x_ptr + 2 * stride_x, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS,
                        MASKED)
    if ROWS > 3:
        x3 = row_tile_x(x_ptr + 3 * stride_x, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS,
                        MASKED)
    return x0, x1, x2, x3


@triton.jit
def _even_odd(t):
    """The even and odd packs of a tile along its last dimension (a register split: each
    thread holds its packs in pairs)."""
    shape: tl.constexpr = t.shape
    return tl.split(tl.reshape(t, [shape[0], shape[1], shape[2] // 2, 2]))


@triton.jit
def _zero_scale_word(z, scale):
    """One int64 per (column, sub-tile), made where each thread holds one (before the layout
    change to the packs' layout, one conversion for both): the zero point's bfloat16 pair
    (128 + z, 128 + z) in the low word and the float32 scale's bits in the high word."""
    zeros2 = ((z | 0x4300) * 0x10001).to(tl.uint32).to(tl.uint64)
    scale_bits = scale.to(tl.float32).to(tl.uint32, bitcast=True).to(tl.uint64)
    return (scale_bits << 32) | zeros2


@triton.jit
def _word_zeros_scale(word):
    """The zero-point pair (int32) and the float32 scale of a ``_zero_scale_word``: its two
    words, no arithmetic."""
    zeros2 = word.to(tl.uint32).to(tl.int32, bitcast=True)
    return zeros2, (word >> 32).to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _row_pairs_product(qa, qb, xs):
    """[BLOCK_N, BLOCK_K / SUB, SUB / 16] float32: per pair of packs, the sum of one row's
    products (x's pairs ``xs`` from ``row_tile_x``)."""
    qa01, qa23, qa45, qa67 = qa
    qb01, qb23, qb45, qb67 = qb
    xa, xb = xs
    xa01, xa23, xa45, xa67 = xa
    xb01, xb23, xb45, xb67 = xb
    return two_packs_dot_bf16x2(qa01, qa23, qa45, qa67, qb01, qb23, qb45, qb67,
                                xa01[None, :, :], xa23[None, :, :], xa45[None, :, :],
                                xa67[None, :, :], xb01[None, :, :], xb23[None, :, :],
                                xb45[None, :, :], xb67[None, :, :])


@triton.jit
def rows_tile_product(weights, xs, accs, x_ptr, stride_x, k0, k_hi, ROWS: tl.constexpr,
                      SUB: tl.constexpr, BLOCK_K: tl.constexpr, PACKED_HALF: tl.constexpr):
    """The dequantized product of ROWS (1-4) rows of x (``xs`` from ``rows_tile_x``) with the
    tile ``row_tile_weights`` loaded, added to their float32 accumulators ``accs`` ([BLOCK_N,
    BLOCK_K / SUB, SUB / 16] with PACKED_HALF, a partial per two packs; else [BLOCK_N, BLOCK_K
    / SUB, SUB / 8]): each pack is unpacked once and multiplied with every row; the
    accumulators past ROWS come back untouched."""
    packs, z, scale = weights
    x0, x1, x2, x3 = xs
    acc0, acc1, acc2, acc3 = accs
    if PACKED_HALF:
        zeros2, scale3 = _word_zeros_scale(_zero_scale_word(z, scale)[:, :, None])
        even, odd = _even_odd(packs)
        qa = unpack_pairs_bf16x2(even, zeros2)
        qb = unpack_pairs_bf16x2(odd, zeros2)
        acc0 += _row_pairs_product(qa, qb, x0) * scale3
        if ROWS > 1:
            acc1 += _row_pairs_product(qa, qb, x1) * scale3
        if ROWS > 2:
            acc2 += _row_pairs_product(qa, qb, x2) * scale3
        if ROWS > 3:
            acc3 += _row_pairs_product(qa, qb, x3) * scale3
    else:  # x read as it is multiplied (row_tile_x loaded nothing)
        acc0 += _float_row_product(packs, z, scale, x_ptr, k0, k_hi, SUB, BLOCK_K)
        if ROWS > 1:
            acc1 += _float_row_product(packs, z, scale, x_ptr + stride_x, k0, k_hi, SUB, BLOCK_K)
        if ROWS > 2:
            acc2 += _float_row_product(packs, z, scale, x_ptr + 2 * stride_x, k0, k_hi, SUB,
                                       BLOCK_K)
        if ROWS > 3:
            acc3 += _float_row_product(packs, z, scale, x_ptr + 3 * stride_x, k0, k_hi, SUB,
                                       BLOCK_K)
    return acc0, acc1, acc2, acc3
