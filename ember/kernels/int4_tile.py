"""The 4-bit GEMV's tiles (ember.kernels.int4_gemv): reading a tile of a weight in ember's
in-memory form (column major: int32 [N, K/8], pack r of a column holding rows 8r + 2s and
8r + 2s + 1 in bits 4s and 16 + 4s; ember.quantization.int4_common) with its zero points,
scales and 1-4 rows of x, and the product over packs. A tile is read in sub-tiles that each
lie inside one group, so each pack's partial takes its group's zero and scale once.

The kernel never converts integers to floats (a quarter-rate instruction on NVIDIA GPUs, which
would bound a 4-bit GEMV below the memory bandwidth): a float is built from its bit pattern.
For half-precision x on a GPU a pack's eight products run in inline PTX on bfloat16 pairs:
``unpack_pairs_bf16x2`` makes, with one mask-and-or (lop3) of the pack shifted by 4s, the pair
(128 + q[2s], 128 + q[2s + 1]) and with a packed subtract of (128 + z) exactly q - z, once for
every row; ``pairs_dot_bf16x2`` takes the pairs with x's pairs (x[2s], x[2s + 1]), which a
bfloat16 row holds in one 32-bit word, in packed multiply-adds. The pack's four pairs
accumulate in bfloat16 before one float32 add: about 2.4 instructions per weight of
arithmetic at one row; the whole loop, with the loads, their addresses and masks and the zero
points' and scales' move to the packs' layout, compiles to 3.4 for sm90 (gate_up's 64 x 256
tiles; docs/benchmarks.md has a leaner loop that was slower). Its rounding is that of
bfloat16 products summed over four weights (2^-9 relative on each pack's partial, the output's
own precision), well below the 4-bit weights' quantization error. float32 x (and the
interpreter) takes float32 multiply-adds with the zero point applied per pack."""

from __future__ import annotations

import triton
import triton.language as tl

from ember.kernels.split_k import split_k_total


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
def pairs_dot_bf16x2(q01, q23, q45, q67, x01, x23, x45, x67):
    """float32 sum of a pack's eight products from its unpacked pairs and one row's x pairs
    (bfloat16 multiply-adds, one float32 add). CUDA only."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 acc;
        .reg .b16 lo, hi;
        .reg .f32 flo, fhi;
        mul.rn.bf16x2 acc, $1, $5;
        fma.rn.bf16x2 acc, $2, $6, acc;
        fma.rn.bf16x2 acc, $3, $7, acc;
        fma.rn.bf16x2 acc, $4, $8, acc;
        mov.b32 {lo, hi}, acc;
        cvt.f32.bf16 flo, lo;
        cvt.f32.bf16 fhi, hi;
        add.f32 $0, flo, fhi;
        }""",
        constraints="=f,r,r,r,r,r,r,r,r",
        args=[q01, q23, q45, q67, x01, x23, x45, x67], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def row_tile_weights(qw_ptr, qz_ptr, s_ptr, k0, k_hi, n0, N, K8, GROUP: tl.constexpr,
                     SUB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN: tl.constexpr = False):
    """The weight-side loads of one tile of the one-row product, rows k0..k0 + BLOCK_K in
    sub-tiles of SUB rows (each inside one group) of a weight with K8 packs a column: (packs
    [BLOCK_N, BLOCK_K / SUB, SUB / 8], zero points and scales [BLOCK_N, BLOCK_K / SUB]); 0 past
    k_hi. A column's packs are one contiguous run. EVEN: every tile is whole (N a multiple of
    BLOCK_N, each split whole tiles), so a tile is loaded or not as one (a tile past k_hi is
    left undefined, for a caller that never uses it): no per-element masks or zero fill."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    mask = (offs_n < N)[:, None] & (sub_start < k_hi)[None, :]
    rows = (sub_start // 8)[None, :, None] + tl.arange(0, SUB // 8)[None, None, :]
    packs = tile_load(qw_ptr + offs_n.to(tl.int64)[:, None, None] * K8 + rows, mask[:, :, None],
                       k0 < k_hi, EVEN)
    g = (sub_start // GROUP)[None, :]
    z = tile_load(qz_ptr + g * (N // 8) + (offs_n // 8)[:, None], mask, k0 < k_hi, EVEN)
    z = (z >> ((offs_n % 8) * 4)[:, None]) & 0xF
    scale = tile_load(s_ptr + g * N + offs_n[:, None], mask, k0 < k_hi, EVEN).to(tl.float32)
    return packs, z, scale


@triton.jit
def tile_load(ptrs, mask, inside, EVEN: tl.constexpr):
    """A tile's load: EVEN, all or nothing (``inside``, one predicate, no zero fill); else
    per element, 0 where ``mask`` is false."""
    if EVEN:
        return tl.load(ptrs, mask=inside)
    return tl.load(ptrs, mask=mask, other=0)


@triton.jit
def stream_start(qw_ptr, qz_ptr, s_ptr, N, K, K8, k_per_split, GROUP: tl.constexpr,
                 SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 WIDE_LOADS: tl.constexpr, PDL: tl.constexpr, EVEN: tl.constexpr = False):
    """A program's first column, its split's rows [k_lo, k_hi), the packs a column, and the
    loads of its first two weight tiles: issued before the PDL wait, as the weight depends on
    no earlier kernel, while the kernel before still runs. WIDE_LOADS: pack offsets the
    compiler can prove 16-byte aligned (K8 = K / 8 passed in, whole steps per split), so each
    thread loads 4 packs an instruction, not 2; otherwise K / 8 is provably even only. EVEN:
    see ``row_tile_weights``."""
    n0 = tl.program_id(0) * BLOCK_N
    if WIDE_LOADS:
        k_lo = tl.multiple_of(tl.program_id(1) * k_per_split, 2 * BLOCK_K)
        k8 = K8
    else:
        k_lo = tl.program_id(1) * k_per_split
        k8 = K // 8
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_first = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k_lo, k_hi, n0, N, k8, GROUP, SUB, BLOCK_K,
                               BLOCK_N, EVEN)
    w_second = row_tile_weights(qw_ptr, qz_ptr, s_ptr, k_lo + BLOCK_K, k_hi, n0, N, k8, GROUP,
                                SUB, BLOCK_K, BLOCK_N, EVEN)
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    return n0, k_lo, k_hi, k8, w_first, w_second


@triton.jit
def store_row_totals(t0, t1, t2, t3, n0, N, bias_ptr, out_ptr, stride_o, part_ptr, counters_ptr,
                     pid_n, pid_k, ROWS: tl.constexpr, ROWS_P: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A GEMV program's end: the float32 sums [BLOCK_N] of rows 0..ROWS-1 (t0..t3; those past
    ROWS ignored) merged over the K splits (ember.kernels.split_k), the bias added, stored at
    columns n0.. of ``out``."""
    offs_m = tl.arange(0, ROWS_P)[:, None]  # ROWS_P: ROWS up to a power of two
    offs_n = n0 + tl.arange(0, BLOCK_N)
    total = t0[None, :]
    if ROWS > 1:
        total = tl.where(offs_m == 0, total, 0.0)
        total = tl.where(offs_m == 1, t1[None, :], total)
    if ROWS > 2:
        total = tl.where(offs_m == 2, t2[None, :], total)
    if ROWS > 3:
        total = tl.where(offs_m == 3, t3[None, :], total)
    mask = (offs_m < ROWS) & (offs_n < N)[None, :]
    total, last = split_k_total(total, part_ptr, counters_ptr, pid_n, pid_k,
                                offs_m * N + offs_n[None, :], mask, ROWS * N, SPLIT_K)
    if last:
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m * stride_o + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _bf16_pair(x_ptr, offs, mask):
    """int32 bits of the bfloat16 pair (x[offs], x[offs + 1]), the first in the low half."""
    lo = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.bfloat16)
    hi = tl.load(x_ptr + offs + 1, mask=mask, other=0.0).to(tl.bfloat16)
    lo = lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def row_tile_x(x_ptr, k0, k_hi, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
               PACKED_HALF: tl.constexpr, X_WORDS: tl.constexpr):
    """The x-side loads of the same tile, [BLOCK_K / SUB, SUB / 8] per pack: with PACKED_HALF
    the four bfloat16 pairs (x[8r + 2s], x[8r + 2s + 1]) as int32 bits (X_WORDS: x is bfloat16
    and ``x_ptr`` its int32 view, one load a pair; else x is converted); otherwise nothing is
    loaded ahead (the float path reads x as it multiplies) and four empty values stand in."""
    sub_start = k0 + tl.arange(0, BLOCK_K // SUB) * SUB
    rows = (sub_start // 8)[:, None] + tl.arange(0, SUB // 8)[None, :]
    mask = (sub_start < k_hi)[:, None]
    if PACKED_HALF:
        if X_WORDS:
            return (tl.load(x_ptr + 4 * rows, mask=mask, other=0),
                    tl.load(x_ptr + 4 * rows + 1, mask=mask, other=0),
                    tl.load(x_ptr + 4 * rows + 2, mask=mask, other=0),
                    tl.load(x_ptr + 4 * rows + 3, mask=mask, other=0))
        else:
            return (_bf16_pair(x_ptr, 8 * rows, mask), _bf16_pair(x_ptr, 8 * rows + 2, mask),
                    _bf16_pair(x_ptr, 8 * rows + 4, mask), _bf16_pair(x_ptr, 8 * rows + 6, mask))
    else:
        empty = tl.zeros([BLOCK_K // SUB, SUB // 8], dtype=tl.int32)
        return empty, empty, empty, empty


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
    return (t - xs * z.to(tl.float32)[:, :, None]) * scale[:, :, None]


@triton.jit
def rows_tile_x(x_ptr, stride_x, k0, k_hi, ROWS: tl.constexpr, SUB: tl.constexpr,
                BLOCK_K: tl.constexpr, PACKED_HALF: tl.constexpr, X_WORDS: tl.constexpr):
    """``row_tile_x`` of rows 0..3 of x (``stride_x`` apart, in x_ptr's elements); the rows
    past ROWS (1-4) stand in as row 0's tile and are never used."""
    x0 = row_tile_x(x_ptr, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    x1 = x0
    x2 = x0
    x3 = x0
    if ROWS > 1:
        x1 = row_tile_x(x_ptr + stride_x, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    if ROWS > 2:
        x2 = row_tile_x(x_ptr + 2 * stride_x, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    if ROWS > 3:
        x3 = row_tile_x(x_ptr + 3 * stride_x, k0, k_hi, SUB, BLOCK_K, PACKED_HALF, X_WORDS)
    return x0, x1, x2, x3


@triton.jit
def rows_tile_product(weights, xs, accs, x_ptr, stride_x, k0, k_hi, ROWS: tl.constexpr,
                      SUB: tl.constexpr, BLOCK_K: tl.constexpr, PACKED_HALF: tl.constexpr):
    """[BLOCK_N, BLOCK_K / SUB, SUB / 8] float32 per row: the dequantized product of ROWS (1-4)
    rows of x (``xs`` from ``rows_tile_x``) with the tile ``row_tile_weights`` loaded, added to
    their accumulators ``accs``: each pack is unpacked once and multiplied with every row; the
    accumulators past ROWS come back untouched."""
    packs, z, scale = weights
    x0, x1, x2, x3 = xs
    acc0, acc1, acc2, acc3 = accs
    if PACKED_HALF:
        q01, q23, q45, q67 = unpack_pairs_bf16x2(packs, ((z | 0x4300) * 0x10001)[:, :, None])
        acc0 += _pairs_row_product(q01, q23, q45, q67, x0) * scale[:, :, None]
        if ROWS > 1:
            acc1 += _pairs_row_product(q01, q23, q45, q67, x1) * scale[:, :, None]
        if ROWS > 2:
            acc2 += _pairs_row_product(q01, q23, q45, q67, x2) * scale[:, :, None]
        if ROWS > 3:
            acc3 += _pairs_row_product(q01, q23, q45, q67, x3) * scale[:, :, None]
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


@triton.jit
def _pairs_row_product(q01, q23, q45, q67, xpairs):
    x01, x23, x45, x67 = xpairs
    return pairs_dot_bf16x2(q01, q23, q45, q67, x01[None, :, :], x23[None, :, :],
                            x45[None, :, :], x67[None, :, :])
