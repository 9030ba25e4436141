"""Fused Triton kernels for the decoder's small elementwise ops on CUDA in half precision.

At small batch a decode step is bound by kernel count, not arithmetic: the torch versions of
RMSNorm (~6 kernels), rotate_half rotary (~10 per tensor) and SiLU-and-mul (2) launch many tiny
kernels per layer. Each op here is one kernel, like vLLM's ``fused_add_rms_norm``,
``rotary_embedding`` (neox style) and ``silu_and_mul``:

- ``rms_norm`` / ``fused_add_rms_norm``: HF's RMSNorm (float32 statistics, cast back to the input
  dtype before the weight multiply), the latter also doing the residual add, so the add at the
  end of a decoder block and the next block's norm are one kernel.
- ``rotary_inplace``: rotate_half rotary of q and k together, in place (they may be strided
  views of the fused qkv output), from the per-step cos/sin that ``RotaryEmbedding.cos_sin``
  makes once for all layers.
- ``silu_and_mul``: ``silu(x[..., :d]) * x[..., d:]``.
- ``greedy_argmax``: the argmax of a few rows of logits over vocabulary chunks in one kernel.

Every intermediate is rounded to the storage dtype where the torch ops round it, so rotary and
the residual add are bit-identical to the torch path; RMSNorm (reduction order, rsqrt) and SiLU
(exp, division) can differ from torch by an ulp. ``fused_ops_enabled`` says when the layers use
these kernels: CUDA, float16/bfloat16, triton installed, EMBER_DISABLE_FUSED_OPS unset. On the
CPU and in float32 the torch paths (bit-identical to HF transformers) are used. The wrappers
themselves do not check it, so tests can run them on the CPU under TRITON_INTERPRET=1.

None of the wrappers synchronises or reads device values (CUDA-graph capture safe); outputs are
plain ``torch.empty`` allocations. On sm90+ GPUs the kernels launch with programmatic dependent
launch (``pdl_options``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from ember import envs

# triton.language, imported by _jit on the first launch: the kernels' bodies use it as `tl`.
tl: Any = None

_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_ops_enabled(x: torch.Tensor) -> bool:
    """Whether the layers should run ``x`` through the fused kernels (not under torch.compile:
    inductor fuses the torch ops itself)."""
    return (
        x.is_cuda
        and x.dtype in _HALF
        and not torch.compiler.is_compiling()
        and not envs.disable_fused_ops()
        and _triton_installed()
    )


@functools.cache
def _jit(fn: Callable[..., None]) -> Any:
    """``triton.jit(fn)``, done on first use. This module is imported with every model, often
    before a test has chosen TRITON_INTERPRET, which triton reads when it defines a jit function
    (its own tl.sum etc. at import, ours here); so neither triton nor our kernels are set up
    until a kernel is launched (and CPU-only runs never import triton). The kernel's module
    (this one, or another that keeps its kernels the same way) gets its ``tl`` then."""
    import triton
    import triton.language

    fn.__globals__["tl"] = triton.language
    return triton.jit(fn)


# Per device, int32 counts that are zero between launches. A kernel whose last program to finish
# merges the others' partial results (argmax over chunks, split-K linear) counts in it and
# resets what it used; launches on one stream run in turn, so they can share it. Fixed size:
# CUDA graphs keep its address, so it is never reallocated.
MERGE_COUNTERS = 1 << 16
_merge_counters: dict[str, torch.Tensor] = {}


@functools.cache
def _sm90_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def compiled_for_gpu(x: torch.Tensor) -> bool:
    """Whether kernels launched on x's device are compiled for it (not TRITON_INTERPRET=1)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def pdl_options(x: torch.Tensor) -> dict[str, bool]:
    """Launch options for a kernel with a ``PDL`` constexpr, given a tensor on its device.

    With programmatic dependent launch (sm90+, EMBER_PDL not 0) a kernel may start while the
    kernel before it in the stream is still running, once that one's programs have all called
    ``gdc_launch_dependents``: its launch latency and ramp then overlap the previous kernel's
    tail, which at batch 1 is a visible share of every one of a decode step's ~400 kernels. The
    contract every PDL kernel keeps (CUDA graphs capture it as is):
    - it calls ``gdc_wait()`` (which returns once the previous kernel has finished and its
      writes are visible) before touching any memory an earlier kernel may write or read, and
      always calls it, so that waiting is transitive down the stream;
    - it calls ``gdc_launch_dependents()`` only after that wait, so at most one kernel waits
      ahead.
    Only immutable inputs (weights) may be read before the wait.
    """
    on = (compiled_for_gpu(x) and envs.pdl()
          and _sm90_or_newer(x.device.index if x.device.index is not None
                             else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def merge_counters(n: int, device: torch.device) -> torch.Tensor:
    """The device's zeroed merge counters (at least ``n`` of them)."""
    assert n <= MERGE_COUNTERS, f"{n} merge counters asked, {MERGE_COUNTERS} exist"
    counters = _merge_counters.get(str(device))
    if counters is None:
        counters = torch.zeros(MERGE_COUNTERS, dtype=torch.int32, device=device)
        _merge_counters[str(device)] = counters
    return counters


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _num_warps(block: int) -> int:
    # About 256 elements per warp, 1 to 8 warps (8 from a block of 2048 on).
    return max(1, min(8, block // 256))


# ---- RMSNorm (+ residual add) ------------------------------------------------------------------


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
    if PDL:  # see pdl_options
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


def _launch_rms_norm(
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
        block = _next_power_of_2(n)
        _jit(_rms_norm_kernel)[(rows_a, rows_b)](
            xr, rr, weight, out, out if res_out is None else res_out,
            sxa, sxb, sra, srb, soa, sob, n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
            **pdl_options(x),
        )  # fmt: skip
    out = out.view(shape)
    return out, None if res_out is None else res_out.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)``, h = x in float32, over the last dim.

    x: [T, hidden] or [T, heads, head_size] (any strides; the result is contiguous).
    """
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype as HF's add is.

    Neither input is modified; both outputs are new contiguous tensors.
    """
    out, new_residual = _launch_rms_norm(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


# ---- rotary embedding (rotate_half / neox style) ------------------------------------------------


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
    # One program per token rotates all of its q and k heads: [heads, rotary_dim / 2] tiles of
    # x1 = x[..., :half] and x2 = x[..., half:rotary_dim]; dims past rotary_dim are untouched.
    # Torch computes x1 * cos - x2 * sin with every op rounded to the half dtype; each product
    # of two half values is exact in float32, so rounding after each op as torch does gives its
    # results bit for bit. (The q and k halves are written out twice: a helper @triton.jit
    # function would not survive the lazy jitting in _jit.)
    if PDL:  # see pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + tok * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos = cos[None, :]
    sin = sin[None, :]

    q_ty = q_ptr.dtype.element_ty
    offs_h = tl.arange(0, Q_HEADS_PAD)
    mask = (offs_h[:, None] < NUM_Q_HEADS) & d_mask[None, :]
    p1 = q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos).to(q_ty).to(tl.float32) - (x2 * sin).to(q_ty).to(tl.float32)
    o2 = (x2 * cos).to(q_ty).to(tl.float32) + (x1 * sin).to(q_ty).to(tl.float32)
    tl.store(p1, o1.to(q_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(q_ty), mask=mask)

    k_ty = k_ptr.dtype.element_ty
    offs_h = tl.arange(0, K_HEADS_PAD)
    mask = (offs_h[:, None] < NUM_K_HEADS) & d_mask[None, :]
    p1 = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * cos).to(k_ty).to(tl.float32) - (x2 * sin).to(k_ty).to(tl.float32)
    o2 = (x2 * cos).to(k_ty).to(tl.float32) + (x1 * sin).to(k_ty).to(tl.float32)
    tl.store(p1, o1.to(k_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(k_ty), mask=mask)


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
    heads_pad = _next_power_of_2(max(hq, hk))
    half_pad = _next_power_of_2(half)
    _jit(_rotary_kernel)[(t,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), sin.stride(0),
        NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HALF=half, Q_HEADS_PAD=_next_power_of_2(hq),
        K_HEADS_PAD=_next_power_of_2(hk), HALF_PAD=half_pad,
        num_warps=_num_warps(heads_pad * half_pad), **pdl_options(q),
    )  # fmt: skip


# ---- SiLU and mul --------------------------------------------------------------------------------


def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    # Grid (tokens, column blocks). Torch rounds silu(gate) to the half dtype before the
    # multiply; so does this, and the product is then exact in float32 before its one rounding.
    if PDL:  # see pdl_options
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
    block = min(_next_power_of_2(d), 1024)
    _jit(_silu_and_mul_kernel)[(rows, _cdiv(d, block))](
        x2, out, x2.stride(0), d, d, BLOCK=block, num_warps=_num_warps(block), **pdl_options(x2)
    )
    return out


# ---- greedy argmax over the vocabulary -----------------------------------------------------------

_ARGMAX_CHUNK = 4096
ARGMAX_MAX_ROWS = 16  # above this torch's one-block-per-row reduction has rows enough to fill SMs


def _argmax_kernel(x_ptr, part_val_ptr, part_idx_ptr, counters_ptr, out_ptr, n_cols, stride_x,
                   num_chunks, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    # Grid (rows, chunks): each program finds its chunk's max and first index of it; the last
    # program of a row to finish (an atomic count per row, no second kernel) picks the winner
    # (largest value, then smallest index: torch's first-occurrence rule) and resets the count.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < n_cols,
                other=float("-inf")).to(tl.float32)
    part = row * num_chunks + chunk
    tl.store(part_val_ptr + part, tl.max(x, 0))
    tl.store(part_idx_ptr + part, chunk * CHUNK + tl.argmax(x, 0, tie_break_left=True))
    if tl.atomic_add(counters_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
        offs_c = tl.arange(0, CHUNKS_PAD)
        valid = offs_c < num_chunks
        vals = tl.load(part_val_ptr + row * num_chunks + offs_c, mask=valid,
                       other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + row * num_chunks + offs_c, mask=valid, other=n_cols,
                       cache_modifier=".cg")
        best = tl.max(vals, 0)
        winner = tl.min(tl.where(valid & (vals == best), idxs, n_cols), 0)
        tl.store(out_ptr + row, winner.to(tl.int64))
        tl.atomic_xchg(counters_ptr + row, 0)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D float tensor of at most ARGMAX_MAX_ROWS rows, as one kernel
    over vocabulary chunks. torch reduces a row in one thread block: 27 us for one 128k-entry
    row on an H200, a visible share of a batch-1 decode step."""
    rows, n_cols = x.shape
    assert rows <= ARGMAX_MAX_ROWS and x.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = _cdiv(n_cols, _ARGMAX_CHUNK)
    part_val = torch.empty(rows * num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows * num_chunks, dtype=torch.int32, device=x.device)
    _jit(_argmax_kernel)[(rows, num_chunks)](
        x, part_val, part_idx, merge_counters(rows, x.device), out, n_cols, x.stride(0), num_chunks,
        CHUNK=_ARGMAX_CHUNK, CHUNKS_PAD=_next_power_of_2(num_chunks), num_warps=8,
    )
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token ids of [rows, vocab] logits: the chunked kernel for a few rows on CUDA,
    torch's argmax otherwise (CPU, many rows, EMBER_DISABLE_FUSED_OPS)."""
    if (logits.is_cuda and logits.dim() == 2 and logits.shape[0] <= ARGMAX_MAX_ROWS
            and logits.stride(-1) == 1 and not envs.disable_fused_ops()
            and not torch.compiler.is_compiling() and _triton_installed()):
        return argmax_rows(logits)
    return logits.argmax(dim=-1)
