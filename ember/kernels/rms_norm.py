"""RMSNorm as HF computes it (float32 statistics, cast back to the input dtype before the
weight multiply), optionally with the residual add before it, so a decoder block's closing add
and the next block's norm are one kernel.

The residual sum is rounded to the model dtype where torch rounds it (bit-identical); the norm
itself may differ from torch by an ulp (reduction order, rsqrt). Outputs are new contiguous
tensors; nothing synchronises (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import next_power_of_2, pdl_options, warps_for_block


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_xa,
    stride_xb,
    stride_ra,
    stride_rb,
    stride_oa,
    stride_ob,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
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
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / n_cols
    h = h * tl.rsqrt(var + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    # HF: weight * h.to(input_dtype). The cast comes first; the product of two half values is
    # exact in float32, so one rounding to the output dtype equals torch's half multiply.
    y = w.to(tl.float32) * h.to(in_ty).to(tl.float32)
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
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    n = shape[-1]
    assert weight.shape == (n,) and weight.stride(0) == 1, "weight must be [hidden], contiguous"
    xr = _as_rows(x)
    out = torch.empty(xr.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
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
            sxa, sxb, sra, srb, soa, sob, n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=warps_for_block(block),
            **pdl_options(x),
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
