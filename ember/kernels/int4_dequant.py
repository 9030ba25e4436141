"""int4_dequantize: a 4-bit (AWQ / GPTQ) weight in ember's form written out as a dense [N, K]
weight in a float dtype, for the 4-bit layers above the rows of int4_gemv and int4_mma
(ember.quantization.int4_linear): written once and read by one cuBLAS GEMM (as vLLM's AWQ layer
does from 256 rows), which beats int4_mma's per-tile unpacking from about 128 rows on an H100
(docs/benchmarks.md).

One program per [BLOCK_N, SUB] tile, SUB rows inside one group (ember.kernels.int4_gemv's
row_sub_tile): it reads the columns' packs (contiguous along K), expands them in pair order,
and writes (q - z) * s rounded once from float32, as ember.quantization.int4_common's
reference dequantization rounds it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.int4_tile import pair_shift
from ember.kernels.launch import cdiv

BLOCK_N = 64


@triton.jit
def _int4_dequantize_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, GROUP: tl.constexpr,
                            SUB: tl.constexpr, BLOCK_N: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    k0 = tl.program_id(1) * SUB
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    packs = tl.load(qw_ptr + offs_n.to(tl.int64)[:, None] * (K // 8) + k0 // 8
                    + tl.arange(0, SUB // 8)[None, :], mask=n_mask[:, None], other=0)
    q = (packs[:, :, None] >> pair_shift(tl.arange(0, 8))[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, SUB))
    g = k0 // GROUP
    z = tl.load(qz_ptr + g * (N // 8) + offs_n // 8, mask=n_mask, other=0)
    z = (z >> ((offs_n % 8) * 4)) & 0xF
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    w = (q - z[:, None]).to(tl.float32) * s[:, None]
    offs_k = k0 + tl.arange(0, SUB)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None])


def int4_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight W [N, K] (``F.linear``'s layout) in ``dtype`` of a 4-bit weight in
    ember's form (qweight [N, K/8], qzeros [G, N/8], scales [G, N]; rows in group order)."""
    from ember.kernels.int4_gemv import row_sub_tile

    n, k = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    if out.numel() == 0:
        return out
    sub = row_sub_tile(group_size, 128)
    _int4_dequantize_kernel[(cdiv(n, BLOCK_N), k // sub)](
        qweight, qzeros, scales, out, n, k, GROUP=group_size, SUB=sub, BLOCK_N=BLOCK_N,
        num_warps=4,
    )
    return out
