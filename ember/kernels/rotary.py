"""Rotary position embedding (rotate_half / neox style) of q and k together, in place.

q and k may be strided views of the fused qkv output; cos/sin are the per-step tables that
``RotaryEmbedding.cos_sin`` makes once for all layers. Every intermediate is rounded to the
half dtype where torch rounds it, so the result is bit-identical to the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import next_power_of_2, pdl_options, warps_for_block


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos, sin, offs_d, d_mask, NUM_HEADS: tl.constexpr,
                  HEADS_PAD: tl.constexpr, HALF: tl.constexpr):
    # [heads, rotary_dim / 2] tiles of x1 = x[..., :half] and x2 = x[..., half:rotary_dim].
    # Torch computes x1 * cos - x2 * sin with every op rounded to the half dtype; each product
    # of two half values is exact in float32, so rounding after each op as torch does gives its
    # results bit for bit.
    ty = x_ptr.dtype.element_ty
    offs_h = tl.arange(0, HEADS_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & d_mask[None, :]
    p1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos).to(ty).to(tl.float32) - (x2 * sin).to(ty).to(tl.float32)
    o2 = (x2 * cos).to(ty).to(tl.float32) + (x1 * sin).to(ty).to(tl.float32)
    tl.store(p1, o1.to(ty), mask=mask)
    tl.store(p1 + HALF, o2.to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per token rotates all of its q and k heads; dims past rotary_dim are untouched.
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + tok * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, cos, sin, offs_d, d_mask,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF)
    _rotate_heads(k_ptr + tok * stride_kt, stride_kh, cos, sin, offs_d, d_mask,
                  NUM_K_HEADS, K_HEADS_PAD, HALF)


def rotary_inplace(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> None:
    """Rotate the first ``rotary_dim`` dims of every head of q and k in place (rotate_half).

    q: [T, Hq, D], k: [T, Hk, D], any token/head strides but unit stride along D (e.g. views of
    the fused qkv output). cos/sin: [T, rotary_dim // 2] or [T, 1, rotary_dim // 2] as made by
    ``RotaryEmbedding.cos_sin`` (expected in q's dtype, which is where torch rounds them).
    """
    t, hq, d = q.shape
    tk, hk, dk = k.shape
    half = rotary_dim // 2
    assert tk == t and dk == d and rotary_dim % 2 == 0 and rotary_dim <= d
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q/k need unit stride along head_size"
    cos = cos.reshape(cos.shape[0], cos.shape[-1])
    sin = sin.reshape(sin.shape[0], sin.shape[-1])
    assert cos.shape == (t, half) and sin.shape == (t, half), "cos/sin must be [T, rotary_dim/2]"
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    if t == 0:
        return
    heads_pad = next_power_of_2(max(hq, hk))
    half_pad = next_power_of_2(half)
    _rotary_kernel[(t,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=half, Q_HEADS_PAD=next_power_of_2(hq),
        K_HEADS_PAD=next_power_of_2(hk), HALF_PAD=half_pad,
        num_warps=warps_for_block(heads_pad * half_pad), **pdl_options(q),
    )  # fmt: skip
