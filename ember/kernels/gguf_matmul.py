"""GGUF dequantize-matmul: ``y = x @ W^T`` with W read from its quantized affine codes
(ember.quantization.gguf_blocks) and dequantized tile by tile in registers, never whole.

W[n, k] = scale[n, k // GROUP] * (code[n, k] - OFFSET) (+ min[n, k // GROUP]). Codes are one
uint8 per weight, or two per byte for 4-bit types (``BITS == 4``: byte j of a row holds code 2j
in its low nibble and code 2j + 1 in its high one). Scales and mins are float32. The product
accumulates in float32; tiles are multiplied in the activation dtype (tensor cores for half
precision), so a half-precision result is x @ round(W)^T to the dtype's rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv


@triton.jit
def _gguf_matmul_kernel(x_ptr, codes_ptr, scale_ptr, min_ptr, out_ptr, M, N, K,
                        stride_xm, stride_cn, stride_sn, stride_om,
                        OFFSET: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                        HAS_MIN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask, n_mask = rm < M, rn < N
    ty = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        k_mask = k < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wmask = n_mask[:, None] & k_mask[None, :]
        row = rn[:, None].to(tl.int64)
        if BITS == 4:
            byte = tl.load(codes_ptr + row * stride_cn + k[None, :] // 2, mask=wmask, other=0)
            code = ((byte >> ((k[None, :] % 2) * 4).to(tl.uint8)) & 0x0F).to(tl.float32)
        else:
            code = tl.load(codes_ptr + row * stride_cn + k[None, :], mask=wmask, other=0)
            code = code.to(tl.float32)
        g = k[None, :] // GROUP
        scale = tl.load(scale_ptr + row * stride_sn + g, mask=wmask, other=0.0)
        w = scale * (code - OFFSET)
        if HAS_MIN:
            w += tl.load(min_ptr + row * stride_sn + g, mask=wmask, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(ty)), out_dtype=tl.float32)
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(ty), mask=m_mask[:, None] & n_mask[None, :])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes < 16 -> uint8 [N, K / 2] in the kernel's 4-bit layout."""
    from ember.quantization.gguf_blocks import pack_nibbles as pack

    return pack(codes)


def gguf_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                min_: torch.Tensor | None, *, offset: int, group: int, bits: int,
                n: int, k: int) -> torch.Tensor:  # fmt: skip
    """x [M, K] (float32/float16/bfloat16) -> [M, N] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm = 16 if m <= 16 else 64
    bn, bk = 64, 64 if group % 64 == 0 or 64 % group == 0 else group
    grid = (cdiv(m, bm), cdiv(n, bn))
    _gguf_matmul_kernel[grid](
        x, codes, scale, scale if min_ is None else min_, out, m, n, k,
        x.stride(0), codes.stride(0), scale.stride(0), out.stride(0),
        OFFSET=offset, GROUP=group, BITS=bits, HAS_MIN=min_ is not None,
        BM=bm, BN=bn, BK=bk, num_warps=4,
    )
    return out
