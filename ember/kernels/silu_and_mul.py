"""SiLU-and-mul: ``silu(x[..., :d]) * x[..., d:]``, the gate of a fused gate_up projection.

Torch rounds silu(gate) to the half dtype before the multiply; so does this kernel (SiLU's exp
and division may still differ from torch by an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, next_power_of_2, pdl_options, warps_for_block


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    # Grid (tokens, column blocks). The product of the rounded activation and `up` is exact in
    # float32 before its one rounding.
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    ty = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)  # torch's silu expression
    tl.store(out_ptr + tok * stride_out + offs, (act * up).to(ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2d] -> silu(x[..., :d]) * x[..., d:], a new contiguous [..., d] tensor."""
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if out.numel() == 0:
        return out
    rows = x2.shape[0]
    block = min(next_power_of_2(d), 1024)
    _silu_and_mul_kernel[(rows, cdiv(d, block))](
        x2, out, x2.stride(0), d, d, BLOCK=block, num_warps=warps_for_block(block),
        **pdl_options(x2),
    )
    return out
