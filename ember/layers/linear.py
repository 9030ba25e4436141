"""Linear: ``nn.Linear`` whose small-batch calls on CUDA can go to a Triton weight-streaming kernel.

A decode step at batch <= 16 reads each weight once and does almost no arithmetic, so a linear
layer should run at the copy bandwidth. On an H200 cuBLAS does not get there for the smaller
projections: SmolLM2's 1-3.5 MB ones take 3.4-4.8 us each (launch and ramp latency, 120 of them
per step), Qwen3-0.6B's o_proj takes 12.8 us at batch 1, and Llama-8B's o_proj adds a split-K
reduce kernel. ``small_batch_linear`` streams W in [BLOCK_N, BLOCK_K] tiles, one program per
BLOCK_N output features, with the <= 16 input rows padded to one tl.dot tile.

Measured per shape against cuBLAS (benchmarks/small_gemm.py, docs/benchmarks.md) it wins up to
tens of MB of weights at every batch up to 16. On Llama-8B's 117-235 MB gate_up and down, where
cuBLAS streams near the copy bandwidth, it wins or ties at batch 1 only (with PDL its start
overlaps the kernel before): layers of up to SMALL_BATCH_MAX_WEIGHT_ELEMENTS take it at
up to 16 rows, layers of up to LARGE_WEIGHT_MAX_ELEMENTS at one row. On by default
on CUDA in fp16/bf16 outside torch.compile; EMBER_SMALL_BATCH_GEMV=0 turns it off. Tested under
TRITON_INTERPRET=1 on the CPU (tests/test_small_gemm.py). Subclassing nn.Linear keeps parameter
names, weight loading and quantization (which replaces nn.Linear modules) unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ember import envs
from ember.layers import fused_ops

SMALL_BATCH_MAX_ROWS = 16  # one tl.dot tile of rows
# 64 MB in bf16: Llama-8B's qkv (50 MB) and o_proj (34 MB) gain at every batch up to 16.
SMALL_BATCH_MAX_WEIGHT_ELEMENTS = 32 * 2**20
# 256 MB: Llama-8B's down (117 MB) and gate_up (235 MB), at batch 1. An lm_head is nn.Linear.
LARGE_WEIGHT_MAX_ELEMENTS = 128 * 2**20
# triton.language, set by fused_ops._jit on the first launch (the kernel body uses it as `tl`).
tl: Any = None


def _small_gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, counters_ptr, M, N, K,
                       stride_xm, stride_wn, stride_om, k_per_split,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, L2_PREFETCH: tl.constexpr, HAS_BIAS: tl.constexpr,
                       DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    # Grid (output tiles, K splits). With SPLIT_K > 1 each program stores its fp32 partial sum;
    # the last split of a tile to finish (an atomic count per tile, no second kernel) adds them
    # in split order, so the result does not depend on which finished first, and resets the count.
    # Triton multi-buffers the W (and x) tile loads of the loop: num_stages - 1 tiles in flight.
    # L2_PREFETCH: the first L2_PREFETCH K elements of the program's W rows are requested into
    # L2 first, one prefetch per 128-byte line. W depends on no earlier kernel, so with PDL this
    # happens while the kernel before (RMSNorm, attention) still runs: the weight stream starts
    # before x exists. Everything else waits for it (fused_ops.pdl_options).
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
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + tile, acc, mask=out_mask)
        if tl.atomic_add(counters_ptr + pid_n, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + split * M * N + tile, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counters_ptr + pid_n, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)


class GemmConfig(NamedTuple):
    """Tiles of ``small_batch_linear``: output features and K per step, K splits, K elements per
    W row prefetched into L2 up front (CUDA only), warps, and pipeline stages (Triton keeps
    num_stages - 1 tiles of W in flight)."""

    block_n: int
    block_k: int
    split_k: int = 1
    l2_prefetch: int = 0
    num_warps: int = 4
    num_stages: int = 4


def small_gemm_config(n: int, k: int) -> GemmConfig:
    """Tiles for an [n, k] weight: the best of benchmarks/small_gemm.py's sweep on an H200 (with
    PDL) for the shipped models' shapes, as a rule. Weights past SMALL_BATCH_MAX_WEIGHT_ELEMENTS
    (Llama-8B's gate_up and down, batch 1 only) stream in 3-stage pipelines: 32 x 256 tiles
    for many outputs (gate_up 56.7-57.0 us, 97% of copy bandwidth), 32 x 512 over a long K
    (down 29.8 us against cuBLAS's 30.9). A few thousand outputs want 64 x 128 tiles in 6
    stages (Llama's qkv 14.5 us against 16.1), K >= 4096 32 x 256 tiles in 5 (o_proj 10.9
    against 12.5). The small models' layers gain from prefetching the first 1024 K of each W
    row into L2 while the kernel before ends; few outputs over a long K (down, o_proj) split K
    in four."""
    if n * k > SMALL_BATCH_MAX_WEIGHT_ELEMENTS:
        return GemmConfig(32, 256, num_stages=3) if n > k else GemmConfig(32, 512, num_stages=3)
    if n > 4096:
        return GemmConfig(64, 128, num_stages=6)
    if k >= 4096:
        return GemmConfig(32, 256, num_stages=5)
    if n <= 1024 and k >= 1536:
        return GemmConfig(32, 256, 4, l2_prefetch=1024)
    if n * k < 2**20:
        return GemmConfig(32, 128, l2_prefetch=1024)
    return GemmConfig(32, 256, l2_prefetch=1024)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: tuple | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D x of at most SMALL_BATCH_MAX_ROWS rows.
    ``config`` (a GemmConfig, or its fields as a tuple) overrides the tuned tiles."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= SMALL_BATCH_MAX_ROWS and weight.shape[1] == k
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n, block_k, split_k, l2_prefetch, num_warps, num_stages = GemmConfig(
        *(config or small_gemm_config(n, k)))
    l2_override = envs.gemv_l2_prefetch() if config is None else None
    if l2_override is not None:
        l2_prefetch = l2_override
    if not fused_ops.compiled_for_gpu(x):
        l2_prefetch = 0  # an inline PTX instruction: not in the interpreter
    # At least one line, at most K, in whole powers of two of lines (the kernel masks per split).
    l2_prefetch = fused_ops._next_power_of_2(max(min(l2_prefetch, k), 64)) if l2_prefetch else 0
    # Whole BLOCK_K steps per split, and no split left empty.
    k_per_split = fused_ops._cdiv(fused_ops._cdiv(k, split_k), block_k) * block_k
    split_k = fused_ops._cdiv(k, k_per_split)
    n_tiles = fused_ops._cdiv(n, block_n)
    if split_k > 1:
        partials = torch.empty(split_k * m * n, dtype=torch.float32, device=x.device)
        counters = fused_ops.merge_counters(n_tiles, x.device)
    else:
        partials = counters = out  # unused by the kernel
    from ember.attention_backends.triton_ops.common import dot_precision

    fused_ops._jit(_small_gemm_kernel)[(n_tiles, split_k)](
        x, weight, bias if bias is not None else weight, out, partials, counters, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=SMALL_BATCH_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        L2_PREFETCH=l2_prefetch, HAS_BIAS=bias is not None,
        DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
        **fused_ops.pdl_options(x),
    )
    return out


def small_batch_gemv_enabled(x: torch.Tensor) -> bool:
    """Whether this input may take the kernel (the layer also needs EMBER_SMALL_BATCH_GEMV)."""
    return x.dim() == 2 and x.shape[0] <= SMALL_BATCH_MAX_ROWS and fused_ops.fused_ops_enabled(x)


def small_batch_max_rows(in_features: int, out_features: int) -> int:
    """Up to how many rows a layer of this size takes the kernel (0: never), as set by
    EMBER_SMALL_BATCH_GEMV and the weight-size limits above."""
    elements = in_features * out_features
    if not envs.small_batch_gemv() or elements > LARGE_WEIGHT_MAX_ELEMENTS:
        return 0
    return SMALL_BATCH_MAX_ROWS if elements <= SMALL_BATCH_MAX_WEIGHT_ELEMENTS else 1


class Linear(nn.Linear):
    """nn.Linear that sends small-batch CUDA half-precision calls to ``small_batch_linear`` at
    up to ``small_batch_max_rows`` rows (fixed as the layer is built); otherwise exactly
    nn.Linear (one attribute test per call: eager steps call every projection of every layer)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.small_batch_max_rows = small_batch_max_rows(self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_batch_max_rows and small_batch_gemv_enabled(x):
            return small_batch_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)
