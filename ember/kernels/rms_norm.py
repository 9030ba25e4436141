"""RMSNorm as HF computes it (float32 statistics, cast back to the input dtype before the
weight multiply), optionally with the residual add before it, so a decoder block's closing add
and the next block's norm are one kernel. ``fused_add_rms_norm_router`` also multiplies the
normalised rows by a mixture-of-experts router's weight: at decode batch sizes the router is a
GEMV too small to fill the GPU, so it rides in the norm's kernel instead of a launch of its own.

``rms_norm_fp8`` writes the normalised rows quantized for an fp8 layer instead
(float8_e4m3fn and one scale per row, what ember.kernels.fp8_quant.per_token_fp8 would make of
the half-precision output): the layer after then reads 1-byte activations with nothing left to
quantize (ember.quantization.fp8). ``rms_norm_int8`` writes them in int8 for a 4-bit layer's
integer GEMV (ember.kernels.int8_act's form), a row spread over programs of 1,024 columns that
each take the whole row's statistics.

The residual sum is rounded to the model dtype where torch rounds it (bit-identical); the norm
itself may differ from torch by an ulp (reduction order, rsqrt). Outputs are new contiguous
tensors; nothing synchronises (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels import fp8_quant, int8_act
from ember.kernels.fp8_quant import per_token_scale
from ember.kernels.int8_act import GROUP as INT8_GROUP_SIZE
from ember.kernels.int8_act import empty_int8_rows, group_tile, store_groups
from ember.kernels.launch import cdiv, next_power_of_2, pdl_options, warps_for_block
from ember.kernels.store_kv import quantize_fp8, soft_fp8

FP8_MAX = tl.constexpr(fp8_quant.FP8_MAX)  # jit globals must be constexpr
MIN_SCALE = tl.constexpr(fp8_quant.MIN_SCALE)
INT8_GROUP = tl.constexpr(INT8_GROUP_SIZE)


@triton.jit
def _normalized(x, w, n_cols, eps):
    """HF's RMSNorm of the row ``x`` (in its half dtype) with weight ``w``, in float32 for the
    caller to round once (``_scaled`` by the row's ``_inv_rms``)."""
    return _scaled(x, w, _inv_rms(x, n_cols, eps))


@triton.jit
def _inv_rms(x, n_cols, eps):
    """1 / rms of the row ``x`` (its tile, of any shape, zero past the row), in float32."""
    h = x.to(tl.float32)
    return tl.rsqrt(tl.sum(h * h) / n_cols + eps)  # over every axis of the row's tile


@triton.jit
def _scaled(x, w, inv_rms):
    """weight * (x * inv_rms).to(input dtype), in float32: HF's statistics in float32, the
    cast first; the product of two half values is exact in float32, so one rounding to the
    output dtype equals torch's half multiply."""
    h = x.to(tl.float32) * inv_rms
    return w.to(tl.float32) * h.to(x.dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    stride_oa,
    stride_ob,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANT: tl.constexpr,
    SOFT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per row; rows are indexed by (a, b) so that [T, heads, head_size] views of
    # the qkv output (Qwen3's per-head norm) need no copy. The residual output is contiguous
    # with the same row layout as ``out``.
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + offs, mask=mask, other=0.0)
    in_ty = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + a * stride_ra + b * stride_rb + offs, mask=mask, other=0.0)
        # Added in float32 and rounded once to the model dtype: what torch's half add does.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(in_ty)
        tl.store(res_out_ptr + a * stride_oa + b * stride_ob + offs, x, mask=mask)
    y = _normalized(x, tl.load(w_ptr + offs, mask=mask, other=0.0), n_cols, eps)
    if QUANT:  # float8_e4m3fn rows (2-D only) and their scales, from the half-precision output
        y = y.to(in_ty).to(tl.float32)
        scale, inv = per_token_scale(tl.max(tl.abs(y), 0), FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + a, scale)
        y = quantize_fp8(y, inv, FP8_MAX, SOFT)
    tl.store(out_ptr + a * stride_oa + b * stride_ob + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D or 3-D tensor with unit stride along the last dim (copying only if needed)."""
    if x.dim() > 3 or x.dim() == 1:
        x = x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def _row_strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows_a, rows_b, stride_a, stride_b) of a 2-D ([a, n]) or 3-D ([a, b, n]) tensor."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """With ``scales`` ([rows] float32) the output is float8_e4m3fn, x 2-D."""
    shape = x.shape
    n = shape[-1]
    assert weight.shape == (n,) and weight.stride(0) == 1, "weight must be [hidden], contiguous"
    xr = _as_rows(x)
    quant = scales is not None
    assert not quant or xr.dim() == 2
    out = torch.empty(xr.shape, dtype=torch.float8_e4m3fn if quant else
                      torch.promote_types(weight.dtype, x.dtype), device=x.device)
    res_out = None
    rr = xr
    if residual is not None:
        assert residual.shape == shape, f"residual {tuple(residual.shape)} != x {tuple(shape)}"
        assert residual.dtype == x.dtype, "residual and x must share a dtype"
        rr = _as_rows(residual)
        if rr.dim() != xr.dim():
            rr = rr.reshape(xr.shape)
        res_out = torch.empty(xr.shape, dtype=x.dtype, device=x.device)
    rows_a, rows_b, sxa, sxb = _row_strides(xr)
    _, _, sra, srb = _row_strides(rr)
    _, _, soa, sob = _row_strides(out)
    if out.numel() > 0:
        block = next_power_of_2(n)
        _rms_norm_kernel[(rows_a, rows_b)](
            xr, rr, weight, out, out if res_out is None else res_out,
            scales if quant else weight, sxa, sxb, sra, srb, soa, sob, n, eps,
            HAS_RESIDUAL=residual is not None, QUANT=quant, SOFT=soft_fp8(x), BLOCK=block,
            num_warps=warps_for_block(block), **pdl_options(x),
        )  # fmt: skip
    out = out.view(shape)
    return out, None if res_out is None else res_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)``, h = x in float32, over the last dim.

    x: [T, hidden] or [T, heads, head_size] (any strides; the result is contiguous).
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype as HF's add is.

    Neither input is modified; both outputs are new contiguous tensors.
    """
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scales, x + residual or None): ``rms_norm(x + residual)`` for an fp8 layer, as
    float8_e4m3fn [T, hidden] and float32 scales [T, 1] with q * scales ~= the half-precision
    norm (``per_token_fp8`` of it, bit for bit). x: [T, hidden]."""
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    q, new_residual = _launch(x, residual, weight, eps, scales)
    return q, scales, new_residual


@triton.jit
def _rms_norm_int8_kernel(x_ptr, res_ptr, w_ptr, words_ptr, res_out_ptr, scale_ptr, sums_ptr,
                          n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                          GROUPS: tl.constexpr, PDL: tl.constexpr):
    # Grid (rows, blocks of GROUPS groups), contiguous rows. Every program takes the statistics
    # of its whole row (a few KB, from L2; the same tile and order in each, so the same
    # value) and normalises, stores and quantizes its own groups: spread over programs, the
    # quantizing takes a fraction of one program's time. The weight depends on no kernel, so
    # it loads before the PDL wait.
    row = tl.program_id(0).to(tl.int64)
    cols, groups = group_tile(tl.program_id(1) * GROUPS, GROUPS, INT8_GROUP)
    inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    in_ty = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    whole = _residual_sum(x_ptr, res_ptr, row * n_cols + offs, offs < n_cols, HAS_RESIDUAL)
    x = _residual_sum(x_ptr, res_ptr, row * n_cols + cols, inside, HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=inside)
    y = _scaled(x, w, _inv_rms(whole, n_cols, eps)).to(in_ty).to(tl.float32)
    n_groups = n_cols // INT8_GROUP
    store_groups(y, groups, n_groups, words_ptr + row * (n_cols // 8),
                 scale_ptr + row * n_groups, sums_ptr + row * n_groups, INT8_GROUP)


@triton.jit
def _residual_sum(x_ptr, res_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual) at ``offs``, the sum added in float32 and rounded once to the model
    dtype: what torch's half add does."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


def rms_norm_int8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scales, sums, x + residual or None): ``rms_norm(x + residual)`` for a 4-bit layer's
    integer GEMV, in ember.kernels.int8_act's form (what ``quantize_int8`` makes of the
    half-precision norm, up to the norm's reduction order). x: [T, hidden], hidden a multiple
    of the int8 group; the sum is rounded as ``fused_add_rms_norm`` rounds it."""
    t, n = x.shape
    assert weight.shape == (n,) and weight.stride(0) == 1, "weight must be [hidden], contiguous"
    x = x.contiguous()
    q, scales, sums = empty_int8_rows(t, n, x.device)
    res_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
    if t:
        block = next_power_of_2(n)
        groups = int8_act.GROUPS_PER_PROGRAM
        _rms_norm_int8_kernel[(t, cdiv(n // INT8_GROUP_SIZE, groups))](
            x, x if residual is None else residual, weight, q.view(torch.int64),
            x if res_out is None else res_out, scales, sums, n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, GROUPS=groups,
            num_warps=warps_for_block(block), **pdl_options(x))
    return q, scales, sums, res_out


@triton.jit
def _add_rms_norm_router_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    router_w_ptr,
    out_ptr,
    res_out_ptr,
    logits_ptr,
    n_cols,
    num_experts,
    eps,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
):
    # Grid (expert tiles, rows). Every program normalises its row (a few KB, from L2) and
    # multiplies it by BLOCK_E router rows; the first expert tile's program also stores the
    # row's residual sum and normalised row. The router rows are weights (written by no
    # kernel), so they load before the PDL wait, while the kernel before still runs.
    pid_e = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    w = tl.load(router_w_ptr + offs_e.to(tl.int64)[:, None] * n_cols + offs[None, :],
                mask=e_mask[:, None] & mask[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = _residual_sum(x_ptr, res_ptr, row * n_cols + offs, mask, True)
    y = _normalized(x, tl.load(norm_w_ptr + offs, mask=mask, other=0.0), n_cols, eps)
    y = y.to(x_ptr.dtype.element_ty)
    if pid_e == 0:
        tl.store(res_out_ptr + row * n_cols + offs, x, mask=mask)
        tl.store(out_ptr + row * n_cols + offs, y, mask=mask)
    logits = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], axis=1)
    tl.store(logits_ptr + row * num_experts + offs_e,
             logits.to(logits_ptr.dtype.element_ty), mask=e_mask)


# Router rows per program: 8 x 2048 bf16 is 32 KB, held in registers (eight warps at 2048).
ROUTER_ROWS_PER_PROGRAM = 8


def fused_add_rms_norm_router(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    router_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual, rms_norm(x + residual) @ router_weight.T) in one
    kernel, the first two as ``fused_add_rms_norm`` gives them; the logits are summed in
    float32 and rounded to x's dtype, as ``F.linear`` gives them.

    x, residual: [T, hidden], contiguous, one dtype; weight: [hidden]; router_weight:
    [experts, hidden], contiguous. Neither input is modified; the outputs are new tensors.
    """
    t, n = x.shape
    num_experts = router_weight.shape[0]
    assert residual.shape == x.shape and residual.dtype == x.dtype
    assert x.is_contiguous() and residual.is_contiguous() and router_weight.is_contiguous()
    assert weight.shape == (n,) and weight.stride(0) == 1 and weight.dtype == x.dtype
    assert router_weight.shape[1] == n
    out = torch.empty_like(x)
    res_out = torch.empty_like(x)
    logits = torch.empty(t, num_experts, dtype=x.dtype, device=x.device)
    if t > 0:
        block = next_power_of_2(n)
        grid = (triton.cdiv(num_experts, ROUTER_ROWS_PER_PROGRAM), t)
        _add_rms_norm_router_kernel[grid](
            x, residual, weight, router_weight, out, res_out, logits, n, num_experts, eps,
            BLOCK=block, BLOCK_E=ROUTER_ROWS_PER_PROGRAM,
            num_warps=warps_for_block(block * ROUTER_ROWS_PER_PROGRAM // 4), **pdl_options(x),
        )  # fmt: skip
    return out, res_out, logits
