"""small_batch_linear: ``F.linear`` for up to 16 rows as a weight-streaming Triton kernel.

At decode batch sizes a linear layer reads each weight once and does almost no arithmetic, so
it should run at the copy bandwidth; for the smaller projections cuBLAS's launch and ramp (and,
over long K, its separate split-K reduce) keep it well below. This kernel streams W in
[BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N output features (times K splits), with the
input rows padded to one tl.dot tile. Tiles per weight shape come from the device's rules in
ember.kernels.tuning; which layers take the kernel is ember.layers.linear's choice.

fp8 weights take ember.kernels.fp8_gemv (widening their tiles here cost ~11 instructions a
weight on sm_90, 40-64% of the bandwidth).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember.kernels.launch import (
    cdiv,
    compiled_for_gpu,
    dot_precision,
    next_power_of_2,
    pdl_options,
)
from ember.kernels.split_k import split_k_launch, split_k_total
from ember.kernels.tuning import SMALL_BATCH_LINEAR_MAX_ROWS as MAX_ROWS
from ember.kernels.tuning import DeviceTuning, SmallBatchLinearConfig, tuning_for

__all__ = ["MAX_ROWS", "SmallBatchLinearConfig", "small_batch_linear", "small_batch_linear_config"]


@triton.jit
def _small_batch_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr,
                               M, N, K, stride_xm, stride_wn, stride_om, k_per_split,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                               L2_PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr,
                               DOT_PREC: tl.constexpr,
                               PDL: tl.constexpr):
    # Grid (output tiles, K splits); K splits merge in the kernel (ember.kernels.split_k).
    # Triton multi-buffers the W (and x) tile loads of the loop: num_stages - 1 tiles in flight.
    # L2_PREFETCH: the first L2_PREFETCH K elements of the program's W rows are requested into
    # L2 first, one prefetch per 128-byte line. W depends on no earlier kernel, so with PDL this
    # happens while the kernel before (RMSNorm, attention) still runs: the weight stream starts
    # before x exists. Everything else waits for it (ember.kernels.launch.pdl_options).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if L2_PREFETCH > 0:
        offs_line = k_lo + tl.arange(0, L2_PREFETCH // 64) * 64  # 64 half elements: a line
        line_mask = n_mask[:, None] & (offs_line < k_hi)[None, :]
        lines = tl.where(line_mask, w_rows + offs_line[None, :], w_ptr)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [lines], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PREC)
    out_mask = m_mask[:, None] & n_mask[None, :]
    acc, last = split_k_total(acc, part_ptr, counters_ptr, pid_n, pid_k,
                              offs_m[:, None] * N + offs_n[None, :], out_mask, M * N, SPLIT_K)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def small_batch_linear_config(n: int, k: int,
                              device: torch.device | None = None) -> SmallBatchLinearConfig:
    """The tuned tiles for an [n, k] weight on ``device`` (ember.kernels.tuning)."""
    return _tuned_config(tuning_for(device), n, k)


# Cached: eager steps ask for every projection of every layer, and the rules are pure.
@functools.lru_cache(maxsize=1024)
def _tuned_config(tuning: DeviceTuning, n: int, k: int) -> SmallBatchLinearConfig:
    return tuning.linear_config(n, k)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: tuple | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D x of at most MAX_ROWS rows. ``config`` (a
    SmallBatchLinearConfig, or its leading fields as a tuple) overrides the tuned tiles."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k, split_k, l2_prefetch, num_warps, num_stages = SmallBatchLinearConfig(
        *(config or small_batch_linear_config(n, k, x.device)))
    if not compiled_for_gpu(x):
        l2_prefetch = 0  # an inline PTX instruction: not in the interpreter
    # At least one line, at most K, in whole powers of two of lines (the kernel masks per split).
    l2_prefetch = next_power_of_2(max(min(l2_prefetch, k), 64)) if l2_prefetch else 0
    n_tiles = cdiv(n, block_n)
    splits = split_k_launch(k, split_k, block_k, m, n, n_tiles, out)
    _small_batch_linear_kernel[(n_tiles, splits.split_k)](
        x, weight, bias if bias is not None else weight, out, splits.partials, splits.counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), splits.k_per_split,
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=splits.split_k,
        L2_PREFETCH=l2_prefetch, HAS_BIAS=bias is not None,
        DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
        **pdl_options(x),
    )
    return out
