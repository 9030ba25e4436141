"""Rotary position embedding (rotate_half / neox style) of q and k together, in place,
optionally after a per-head RMSNorm of each (Qwen3's q_norm / k_norm).

q and k may be strided views of the fused qkv output; cos/sin are the per-step tables that
``RotaryEmbedding.cos_sin`` makes once for all layers. Every intermediate is rounded to the
half dtype where torch rounds it, so the rotation is bit-identical to the torch ops; the norm
rounds as ember.kernels.rms_norm does (its statistics may differ from torch's by an ulp). With
the norm, one kernel does what took three (two norms, then the rotation): a decode step of a
Qwen3 model launches two kernels fewer per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import (
    cdiv,
    compiled_for_gpu,
    next_power_of_2,
    num_sms,
    pdl_options,
    warps_for_block,
)


@triton.jit
def _product(a, b, UNFUSED: tl.constexpr):
    """a * b in float32, rounded on its own (``mul.rn``): the compiler may otherwise fuse it
    with the add or subtract that follows into one FMA (LLVM narrows the half-dtype round
    trips to f16 ops and contracts them), which rounds once where torch rounds twice. The
    interpreter runs no PTX and fuses nothing."""
    if UNFUSED:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return a * b


@triton.jit
def rotated(x, partner, cos, sin, first_half, ty: tl.constexpr, UNFUSED: tl.constexpr):
    """float32 elements of a rotate_half rotation, each rounded to ``ty`` as torch rounds it:
    x * cos - partner * sin where ``first_half`` (x in the first half of the rotated dims,
    ``partner`` its element half a rotation on), else x * cos + partner * sin. Each product
    of two ``ty`` values is exact in float32, so rounding after each op as torch does gives
    its results bit for bit."""
    a = _product(x, cos, UNFUSED).to(ty).to(tl.float32)
    b = _product(partner, sin, UNFUSED).to(ty).to(tl.float32)
    return tl.where(first_half, a - b, a + b)


@triton.jit
def load_rotated(rows, offs_d, mask, cos_row, sin_row, HALF: tl.constexpr,
                  UNFUSED: tl.constexpr):
    """Heads ``rows + offs_d`` (of 2 * HALF elements, where ``mask``) loaded and rotated with
    one token's tables (``cos_row``, ``sin_row``; rotate_half over the whole head), in their
    dtype: for a kernel that rotates what it loads (ember.kernels.decode_attention)."""
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    cos = tl.load(cos_row + offs_d % HALF).to(tl.float32)
    sin = tl.load(sin_row + offs_d % HALF).to(tl.float32)
    x = tl.load(rows + offs_d, mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(rows + partner, mask=mask, other=0.0).to(tl.float32)
    ty = rows.dtype.element_ty
    return rotated(x, x_partner, cos, sin, first, ty, UNFUSED).to(ty)


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
    q_w_ptr,
    k_w_ptr,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    UNFUSED: tl.constexpr,
    PDL: tl.constexpr,
):
    # Grid (token, groups of HEADS heads of q's then k's): a decode step's few tokens take one
    # head a program, so they spread over many SMs, each program one short chain (load, norm,
    # rotate, store); many tokens take many heads a program. Dims past rotary_dim are untouched.
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    is_q = head < NUM_Q_HEADS
    rows = tl.where(is_q, q_ptr + tok * stride_qt + head * stride_qh,
                    k_ptr + tok * stride_kt + (head - NUM_Q_HEADS) * stride_kh)[:, None]
    ty = q_ptr.dtype.element_ty
    offs = tl.arange(0, HALF_PAD)
    d_mask = offs < HALF
    mask = (head < NUM_HEADS)[:, None] & d_mask[None, :]
    cos = tl.load(cos_ptr + tok * stride_cos + offs, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + offs, mask=d_mask, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]
    # [HEADS, half] tiles of x1 = x[:half] and x2 = x[half:rotary_dim]; torch computes
    # x1 * cos - x2 * sin and x2 * cos + x1 * sin with every op rounded to the half dtype.
    x1 = tl.load(rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # RMSNorm over each head (rotary_dim == head_size here), rounded as the rms_norm
        # kernel rounds: cast to the half dtype, then one rounding of weight * that.
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w_rows = tl.where(is_q, q_w_ptr, k_w_ptr)[:, None]
        w1 = tl.load(w_rows + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_rows + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd[:, None]).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        x2 = (w2 * (x2 * rstd[:, None]).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    o1 = rotated(x1, x2, cos, sin, True, ty, UNFUSED)
    o2 = rotated(x2, x1, cos, sin, False, ty, UNFUSED)
    tl.store(rows + offs[None, :], o1.to(ty), mask=mask)
    tl.store(rows + HALF + offs[None, :], o2.to(ty), mask=mask)


# Programs per SM a launch aims for before it gives a program more than one head.
_PROGRAMS_PER_SM = 8


def heads_per_program(tokens: int, num_heads: int, sms: int) -> int:
    """One head a program while tokens x heads programs would not fill the GPU about
    _PROGRAMS_PER_SM deep; beyond that, powers of two up to every head (one program a token)."""
    heads = 1
    while heads < num_heads and tokens * cdiv(num_heads, heads) > _PROGRAMS_PER_SM * sms:
        heads *= 2
    return heads


def rotary_inplace(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
    heads: int | None = None,
) -> None:
    """Rotate the first ``rotary_dim`` dims of every head of q and k in place (rotate_half).

    q: [T, Hq, D], k: [T, Hk, D], any token/head strides but unit stride along D (e.g. views of
    the fused qkv output). cos/sin: [T, rotary_dim // 2] or [T, 1, rotary_dim // 2] as made by
    ``RotaryEmbedding.cos_sin`` (expected in q's dtype, which is where torch rounds them).
    ``norm_weights`` = (q_weight, k_weight), each [D]: RMSNorm each head of q and k with them
    (``eps``) first, as ``rms_norm`` would; it needs ``rotary_dim == D``. ``heads``: heads per
    program, a power of two (default: ``heads_per_program`` for the device).
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
    if norm_weights is not None:
        assert rotary_dim == d, "the fused per-head norm needs rotary_dim == head_size"
        q_w, k_w = norm_weights
        for w in (q_w, k_w):
            assert w.shape == (d,) and w.stride(0) == 1 and w.dtype == q.dtype
    else:
        q_w = k_w = cos  # never read
    if t == 0:
        return
    half_pad = next_power_of_2(half)
    if heads is None:
        heads = heads_per_program(t, hq + hk, num_sms(q.device))
    _rotary_kernel[(t, cdiv(hq + hk, heads))](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0), q_w, k_w, eps,
        NUM_Q_HEADS=hq, NUM_HEADS=hq + hk, HEADS=heads, HALF=half, HALF_PAD=half_pad,
        NORM=norm_weights is not None, UNFUSED=compiled_for_gpu(q),
        num_warps=warps_for_block(heads * half_pad), **pdl_options(q),
    )  # fmt: skip
