"""int4_mma: a 4-bit (AWQ / GPTQ) linear layer for a few rows on the tensor cores.

Decoding, a 4-bit layer is a read of its weight, and the CUDA-core GEMV (ember.kernels.int4_gemv)
spends its issue slots on multiply-adds, one more row costing as much as the first. Here the
products run on the tensor cores (wgmma), the operands swapped as in ember.kernels.fp8_gemv:
the weight tile [BLOCK_N, 16] is the first operand, held in registers, the rows (padded to 16,
or in tiles of 32 past 16) the second. Triton pipelines the weight's packs into shared memory
(cp.async, NUM_STAGES deep) and loads them straight into the dot's register layout, so nothing
is unpacked through shared memory.

A K step is one 128-row tile of a group: 16 packs a column of ember's form (int4_common: pack
r holds rows 8r + 2s and 8r + 2s + 1 in bits 4s and 16 + 4s). Its product is eight dots of 16
rows each. A wgmma thread holds two neighbouring K values of a column in one 32-bit register
and two neighbouring packs (2u, 2u + 1) of the tile; one mask-and-or (lop3) of pack 2u + w
shifted by 4s gives the bfloat16 pair (rows 16u + 8w + 2s, + 1) as 128 + q, which is such a
register of dot j = 4w + s, and one packed subtract of (128 + z) makes it q - z exactly. So dot
j multiplies rows 16 (kk // 2) + 8w + 2s + kk % 2 (kk = 0..15) of the tile, which its x operand
gathers (x is small and cached). Products are exact and summed in float32; the group's scale
multiplies each tile's sum: the dequantized weight is never rounded.

Grid (output tiles, K splits, row tiles): K splits merge in the kernel (ember.kernels.split_k).
Under TRITON_INTERPRET the unpacking runs in plain integer ops (the same arithmetic). Which
layer sizes take this kernel: ember.quantization.int4_linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, compiled_for_gpu, num_sms, pdl_options
from ember.kernels.split_k import split_k_launch, split_k_total

SMALL_BATCH_ROWS = 16  # up to this many rows one program takes them all (Triton's narrowest wgmma)
TILE_K = 128  # rows of K a step: 16 packs a column


# One wgmma register of dot j = 4w + s from a thread's two packs (words 2u, 2u + 1 of the
# tile): the lop3 of word w shifted by 4s, the bfloat16 pair 128 + q, minus the pair 128 + z of
# the column's zero point ($3): q - z exactly.
_ASM = """{{
    .reg .b32 sh, t;
    {shift}
    lop3.b32 t, sh, 0x000f000f, 0x43004300, 0xea;
    sub.rn.bf16x2 $0, t, $3;
    }}"""


def _asm_for(j: int) -> str:
    word, s = ("$1", "$2")[j // 4], j % 4
    return _ASM.format(shift=f"shr.u32 sh, {word}, {4 * s};" if s else f"mov.b32 sh, {word};")


_ASM_ROWS = tuple(_asm_for(j) for j in range(8))


@triton.jit
def _dot_operand(packs, zeros2, qw_tile_ptr, offs_n, n_mask, K8, J: tl.constexpr, ASM: tl.constexpr,
                 ON_GPU: tl.constexpr):
    """Dot J's weight operand [BLOCK_N, 16], q - z of the tile's rows that dot J multiplies
    (``_x_slice``): on a GPU bfloat16 unpacked from the tile's packs in their register layout
    (pack=2: a thread's two neighbouring packs); otherwise gathered from the packs in memory,
    in float32."""
    if ON_GPU:
        return tl.inline_asm_elementwise(ASM, "=r,r,r,r,r", [packs, zeros2], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        c = tl.arange(0, 16)
        word = 2 * (c // 2) + J // 4
        shift = 4 * (J % 4) + 16 * (c % 2)
        p = tl.load(qw_tile_ptr + offs_n.to(tl.int64)[:, None] * K8 + word[None, :],
                    mask=n_mask[:, None], other=0)
        z = zeros2 & 0xF
        return (((p >> shift[None, :]) & 0xF) - z).to(tl.float32)


@triton.jit
def _x_slice(x_ptr, offs_m, m_mask, stride_x, k0, J: tl.constexpr, ON_GPU: tl.constexpr):
    """The rows of x that dot J of the tile at k0 multiplies, [16, BLOCK_M], in bfloat16 on a
    GPU (float16 rows rounded to it, as int4_gemv's products round them) and in float32 off a
    GPU (as the weight operand there): its kk-th is row 16 (kk // 2) + 8w + 2s + kk % 2 of the
    tile, J = 4w + s (module docstring)."""
    kk = tl.arange(0, 16)
    offs_k = k0 + 16 * (kk // 2) + 8 * (J // 4) + 2 * (J % 4) + kk % 2
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None],
                other=0.0)
    x = x.to(tl.bfloat16) if ON_GPU else x.to(tl.float32)
    return tl.trans(x)


@triton.jit
def _int4_mma_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
                     M, N, K, k_per_split, stride_x, stride_o, GROUP: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, HAS_BIAS: tl.constexpr, ON_GPU: tl.constexpr,
                     ASMS: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    K8 = K // 8
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    qw_cols = qw_ptr + offs_n.to(tl.int64)[:, None] * K8
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
    if PDL:  # x comes from the kernel before (ember.kernels.launch.pdl_options)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k0 in tl.range(k_lo, k_hi, 128, num_stages=NUM_STAGES):
        packs = tl.load(qw_cols + (k0 // 8 + tl.arange(0, 16))[None, :], mask=n_mask[:, None],
                        other=0)
        g = k0 // GROUP
        z = tl.load(qz_ptr + g * (N // 8) + offs_n // 8, mask=n_mask, other=0)
        z = (z >> ((offs_n % 8) * 4)) & 0xF
        scale = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        # (128 + z) twice, as the bfloat16 pair each unpacked register takes off
        zeros2 = tl.broadcast_to(((z | 0x4300) * 0x10001)[:, None], [BLOCK_N, 16])
        tile = qw_ptr + k0 // 8
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for j in tl.static_range(8):
            part = tl.dot(_dot_operand(packs, zeros2, tile, offs_n, n_mask, K8, j,
                                          tl.constexpr(ASMS[j]), ON_GPU),
                          _x_slice(x_ptr, offs_m, m_mask, stride_x, k0, j, ON_GPU), part)
        acc += part * scale[:, None]
    offsets = offs_m[None, :] * N + offs_n[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    total, last = split_k_total(acc, part_ptr, counters_ptr, pid_m * tl.num_programs(0) + pid_n,
                                pid_k, offsets, mask, M * N, SPLIT_K)
    if last:
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_o + offs_n[:, None],
                 total.to(out_ptr.dtype.element_ty), mask=mask)


def int4_mma_supported(k: int, group_size: int) -> bool:
    """Whether a [k, n] weight with this group size can take the kernel: whole 128-row tiles,
    each inside one group."""
    return k % TILE_K == 0 and group_size % TILE_K == 0


def default_block_n(k: int) -> int:
    """Output columns a program: 256 for a long K (Llama-8B's down projection: 23.5 against
    27.5 us at 4 rows on an H100), else 128 (qkv, o, gate_up: 3-15% faster than 256);
    docs/benchmarks.md."""
    return 256 if k >= 8192 else 128


def int4_mma(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             group_size: int, bias: torch.Tensor | None = None, block_n: int = 0,
             split_k: int = 0, num_warps: int = 4, num_stages: int = 3,
             block_m: int = 0) -> torch.Tensor:
    """x [M, K] (bfloat16 or float16) times the 4-bit weight in ember's form (qweight [N, K/8] column
    major, qzeros [G, N/8], scales [G, N]). ``block_n`` / ``block_m`` 0: up to 16 rows
    ``default_block_n`` columns and 16 rows a program, else 128 and 32; ``split_k`` 0: split K
    until the grid holds two programs per SM. Three pipeline stages measured faster than four
    or six at every Llama-8B shape (16 rows)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert m >= 1 and qweight.shape[1] * 8 == k and scales.shape[1] == n
    assert int4_mma_supported(k, group_size) and x.dtype in (torch.bfloat16, torch.float16)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    # Past 16 rows 32 rows a program in 128 columns won at Llama-8B's shapes (H100 sweep,
    # docs/benchmarks.md).
    block_n = block_n or (default_block_n(k) if m <= SMALL_BATCH_ROWS else 128)
    block_m = block_m or (SMALL_BATCH_ROWS if m <= SMALL_BATCH_ROWS else 32)
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    if split_k == 0:
        split_k = max(1, min(cdiv(2 * num_sms(x.device), tiles), k // (2 * TILE_K)))
    splits = split_k_launch(k, split_k, TILE_K, m, n, tiles, out)
    on_gpu = compiled_for_gpu(x)
    _int4_mma_kernel[(cdiv(n, block_n), splits.split_k, cdiv(m, block_m))](
        x, qweight, qzeros, scales, bias if bias is not None else scales, out, splits.partials,
        splits.counters, m, n, k, splits.k_per_split, x.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT_K=splits.split_k,
        NUM_STAGES=num_stages, HAS_BIAS=bias is not None, ON_GPU=on_gpu, ASMS=_ASM_ROWS,
        num_warps=num_warps, num_stages=num_stages, **pdl_options(x))
    return out
