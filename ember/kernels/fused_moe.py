"""Fused mixture-of-experts: routing, tokens sorted by expert, and two grouped GEMMs over the
experts that tokens were routed to, all on the device without a host sync (CUDA graphs capture
it; every grid is sized from the token count alone).

    route      softmax + top-k (+ renormalisation) per token; counts each expert's tokens with
               atomics, the count before a token's add being its rank within its expert
    align      one program: per-expert counts padded to BLOCK_M, their prefix sums, the expert
               of every BLOCK_M-row block, and the (token, slot) pairs scattered into expert
               order (vLLM's moe_align_block_size; pad rows hold the sentinel N)
    gemm1      per block: x rows of its pairs @ w13[e]^T, gate and up tiles side by side, SiLU *
               up in the epilogue -> intermediate [N, I], one row per (token, slot) pair
    gemm2      per block: intermediate rows @ w2[e]^T, times the routing weight -> [N, H]
    sum_k      each token's k rows summed (float32, one rounding).

Blocks past the padded total exit at once, so a grid sized for the worst case costs little.
A few pairs (decode; ember.kernels.moe_decode.takes_decode_path) skip all of this: two
launches, no sort, routing inside the first (ember.kernels.moe_decode).
The rounding follows the torch path (each matmul's output rounded to the activation dtype, the
SiLU rounded before the multiply, the weight rounded first when the model casts it), so bf16
results stay within a few ulps of ember.layers.moe.moe_torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ember.kernels import moe_decode
from ember.kernels.buffers import scratch_buffer
from ember.kernels.launch import (
    cdiv,
    compiled_for_gpu,
    dot_precision,
    next_power_of_2,
    pdl_options,
)

MAX_EXPERTS = 1024  # the per-expert scratch is this size always (graphs keep its address)


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeConfig:
    """BLOCK_M (the padding unit of the expert-sorted rows) and each GEMM's tile."""

    block_m: int
    gemm1: GemmTile
    gemm2: GemmTile


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype,
               on_gpu: bool) -> MoeConfig:  # fmt: skip
    """Tiles for an H200-class GPU, chosen by rows per expert (num_pairs / num_experts), as
    ``python -m ember.bench.moe --kernel`` found them fastest on Qwen3-30B-A3B's layer (1x H200,
    `benchmarks/results/h200-moe.json`; 9-16% faster than the first hand-picked tiles).

    A few tokens (batch 1: 8 of 128 experts hit): BLOCK_M 16 (tl.dot's least) and 64-wide N
    tiles with long K tiles and four stages, so that each hit expert's weights stream once,
    spread over every SM with many bytes in flight. Decode batches (up to ~4 rows per expert):
    narrower gemm1 tiles, K 256. Prefill-sized batches: BLOCK_M 64, then 128 with 8 warps.
    Under TRITON_INTERPRET small tiles keep CPU tests fast."""
    if not on_gpu:
        return MoeConfig(16, GemmTile(32, 32, 1, 1), GemmTile(32, 32, 1, 1))
    per_expert = num_pairs / num_experts
    wide = dtype == torch.float32  # double the bytes per tile: halve K so shared memory fits
    if per_expert <= 0.25:
        cfg = MoeConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))
    elif per_expert <= 4:
        cfg = MoeConfig(16, GemmTile(32, 256, 4, 3), GemmTile(64, 128, 4, 3))
    elif per_expert <= 32:
        cfg = MoeConfig(64, GemmTile(64, 64, 4, 4), GemmTile(128, 64, 4, 4))
    else:
        cfg = MoeConfig(128, GemmTile(128, 64, 8, 3), GemmTile(128, 64, 8, 3))
    if wide:
        cfg = MoeConfig(cfg.block_m, *(GemmTile(t.block_n, t.block_k // 2, t.num_warps, 2)
                                       for t in (cfg.gemm1, cfg.gemm2)))
    return cfg


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    # At most min(N, E) experts are hit, each padded by fewer than BLOCK_M rows.
    return num_pairs + min(num_pairs, num_experts) * (block_m - 1)


@triton.jit
def _route_kernel(logits_ptr, stride_l, ids_ptr, weights_ptr, ranks_ptr, counts_ptr, E,
                  K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, PDL: tl.constexpr):
    # One program per token: float32 softmax, k rounds of argmax (lowest index on ties).
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=0)
    p = tl.where(valid, p, -1.0)  # never chosen
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        ids = tl.where(slots == k, idx, ids)
        weights = tl.where(slots == k, best, weights)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # unused slots hold 0
    in_k = slots < K
    tl.store(ids_ptr + t * K + slots, ids, mask=in_k)
    tl.store(weights_ptr + t * K + slots, weights, mask=in_k)
    if COUNT:  # for align (the decode path has none: nothing would clear the counts)
        # A token's k experts are distinct, so one vector of atomics has no duplicate address.
        ranks = tl.atomic_add(counts_ptr + ids, 1, mask=in_k)
        tl.store(ranks_ptr + t * K + slots, ranks, mask=in_k)


@triton.jit
def _count_kernel(ids_ptr, ranks_ptr, counts_ptr, N, BLOCK: tl.constexpr):
    # For routing computed elsewhere: each pair's rank within its expert, by atomics.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    ranks = tl.atomic_add(counts_ptr + ids, 1, mask=mask)
    tl.store(ranks_ptr + offs, ranks, mask=mask)


@triton.jit
def _align_kernel(ids_ptr, ranks_ptr, counts_ptr, starts_ptr, sorted_ptr, expert_ids_ptr,
                  num_post_ptr, stats_ptr, N, E, max_padded, max_blocks, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr,
                  STATS: tl.constexpr, PDL: tl.constexpr):
    # One program. The counts are zeroed again here for the next layer (a zeroed scratch).
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_e = tl.arange(0, BLOCK_E)
    in_e = offs_e < E
    counts = tl.load(counts_ptr + offs_e, mask=in_e, other=0)
    if STATS:  # benchmarks: experts hit, and calls (one program: no atomics needed)
        hit = tl.sum((counts > 0).to(tl.int64), axis=0)
        tl.store(stats_ptr, tl.load(stats_ptr) + hit)
        tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + 1)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(starts_ptr + offs_e, starts, mask=in_e)
    tl.store(counts_ptr + offs_e, tl.zeros([BLOCK_E], dtype=tl.int32), mask=in_e)
    tl.store(num_post_ptr, tl.sum(padded, axis=0))
    # Block b's expert: how many experts end at or before its first row (clamped: blocks past
    # the total are skipped by the GEMMs, which read num_post).
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        done = (ends[None, :] <= (b * BLOCK_M)[:, None]) & in_e[None, :]
        expert = tl.minimum(tl.sum(done.to(tl.int32), axis=1), E - 1)
        tl.store(expert_ids_ptr + b, expert, mask=b < max_blocks)
    for p0 in range(0, max_padded, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + p, tl.full([BLOCK], 0, tl.int32) + N, mask=p < max_padded)
    tl.debug_barrier()  # starts and sentinels are written before any thread scatters
    for i0 in range(0, N, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        mask = i < N
        e = tl.load(ids_ptr + i, mask=mask, other=0)
        r = tl.load(ranks_ptr + i, mask=mask, other=0)
        dst = tl.load(starts_ptr + e, mask=mask, other=0) + r
        tl.store(sorted_ptr + dst, i, mask=mask)


@triton.jit
def _gemm1_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr, N, H, INTER,
                  stride_x, stride_we, stride_wn, stride_o,
                  K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    # No weight can be read before the wait: which expert a block takes is the align's output.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    pid_n = tl.program_id(1)
    ty = out_ptr.dtype.element_ty
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < N
    tok = tl.where(row_ok, pair // K_TOP, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
    # B tiles [BLOCK_K, BLOCK_N] of w13[e]^T: gate rows n, up rows INTER + n.
    g_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + INTER * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k + k0 < H
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        u = tl.load(u_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
    # As the torch path rounds: gate_up output, then silu(gate), then the product.
    g = acc_g.to(ty).to(tl.float32)
    u = acc_u.to(ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    o_ptrs = out_ptr + tl.where(row_ok, pair, 0).to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(o_ptrs, (act * u).to(ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemm2_kernel(a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, expert_ids_ptr, num_post_ptr,
                  N, H, INTER, stride_a, stride_we, stride_wn, stride_o,
                  ROUND_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    # No weight can be read before the wait: which expert a block takes is the align's output.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    pid_n = tl.program_id(1)
    ty = out_ptr.dtype.element_ty
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < N
    row = tl.where(row_ok, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * stride_a + offs_k[None, :]
    b_ptrs = w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        k_ok = offs_k + k0 < INTER
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    w = tl.load(weights_ptr + row, mask=row_ok, other=0.0)
    if ROUND_WEIGHT:  # the model casts routing weights to the activation dtype
        w = w.to(ty).to(tl.float32)
    y = acc.to(ty).to(tl.float32) * w[:, None]
    tl.store(out_ptr + row[:, None] * stride_o + offs_n[None, :], y.to(ty),
             mask=row_ok[:, None] & col_ok[None, :])


# Benchmarks count the experts each call hits (on the device, so graphs count too); read once
# at the end. Off by default: launches read the flag, graphs keep what it was at capture.
_COUNT_HITS = False


def count_expert_hits(on: bool) -> None:
    """Count experts hit per call from now on (set before an engine captures its graphs)."""
    global _COUNT_HITS
    _COUNT_HITS = on


def _stats(device: torch.device) -> torch.Tensor:
    return scratch_buffer("moe_hit_stats", 2, torch.int64, device, zeroed=True)


def _stats_if_counting(device: torch.device) -> torch.Tensor | None:
    return _stats(device) if _COUNT_HITS else None


def expert_hit_stats(device: torch.device | str, reset: bool = False) -> tuple[int, int]:
    """(experts hit summed over calls, calls) since the last reset; a host sync."""
    buf = _stats(torch.device(device))
    hits, calls = buf.tolist()
    if reset:
        with torch.inference_mode():  # the buffer was made under the engine's inference mode
            buf.zero_()
    return hits, calls


@triton.jit
def _sum_k_kernel(src_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    # out[t] = sum of src rows t*K .. t*K+K-1, in float32, rounded once (as torch's sum).
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(src_ptr + (t * K + k) * H + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _counts(device: torch.device) -> torch.Tensor:
    return scratch_buffer("moe_expert_counts", MAX_EXPERTS, torch.int32, device, zeroed=True)


def _check_experts(e: int) -> None:
    if e > MAX_EXPERTS:
        raise ValueError(f"{e} experts: the fused MoE kernel takes at most {MAX_EXPERTS}")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, count: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(topk_weights [T, k] float32, topk_ids [T, k] int32, ranks [T*k] int32) on the device;
    also counts each expert's pairs into the zeroed scratch that ``align`` reads and clears.
    ``count=False``: no counts, no ranks (None), for the decode path, which has no align."""
    t, e = router_logits.shape
    _check_experts(e)
    dev = router_logits.device
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
    ranks = torch.empty(t * top_k, dtype=torch.int32, device=dev) if count else None
    if t:
        _route_kernel[(t,)](router_logits, router_logits.stride(0), ids, weights,
                            ids if ranks is None else ranks, _counts(dev) if count else ids, e,
                            K=top_k, BLOCK_K=max(2, next_power_of_2(top_k)),
                            BLOCK_E=next_power_of_2(e), RENORMALIZE=renormalize, COUNT=count,
                            **pdl_options(router_logits))
    return weights, ids, ranks


def count(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Ranks of routing computed elsewhere (counts go to the scratch, as ``route`` does)."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    ranks = torch.empty_like(ids)
    block = 1024
    _count_kernel[(cdiv(ids.numel(), block),)](ids, ranks, _counts(ids.device), ids.numel(),
                                                BLOCK=block)
    return ranks


def align(topk_ids: torch.Tensor, ranks: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(sorted pair ids [max_padded], expert of each block [max_blocks], padded total [1]);
    consumes (and clears) the counts ``route`` or ``count`` left in the scratch."""
    n = topk_ids.numel()
    dev = topk_ids.device
    max_padded = max_padded_rows(n, num_experts, block_m)
    max_blocks = cdiv(max_padded, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    starts = scratch_buffer("moe_expert_starts", MAX_EXPERTS, torch.int32, dev)
    _align_kernel[(1,)](topk_ids, ranks, _counts(dev), starts, sorted_ids, expert_ids, num_post,
                        _stats(dev), n, num_experts, max_padded, max_blocks, BLOCK_M=block_m,
                        BLOCK_E=next_power_of_2(num_experts), BLOCK_B=32, BLOCK=1024,
                        STATS=_COUNT_HITS, num_warps=8, **pdl_options(topk_ids))
    return sorted_ids, expert_ids, num_post


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  ranks: torch.Tensor | None = None, round_weights: bool = True,
                  config: MoeConfig | moe_decode.DecodeConfig | None = None
                  ) -> torch.Tensor:  # fmt: skip
    """sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k].

    ``ranks`` from ``route`` (its counts in the scratch, which only the sorted path clears);
    None counts here, or takes the decode path (few pairs, or a DecodeConfig given)."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    if t == 0:
        return torch.empty_like(x)
    decode = moe_decode.chosen_config(config, x, top_k, num_experts) if ranks is None else None
    if decode is not None:
        return moe_decode.decode_moe(x, w13, w2, decode, round_weights, topk_weights=topk_weights,
                                     topk_ids=topk_ids, stats=_stats_if_counting(x.device))
    if isinstance(config, moe_decode.DecodeConfig):
        raise ValueError("ranks given (counts in the scratch): only the sorted path clears them")
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32)
    if ranks is None:
        ranks = count(ids, num_experts)
    cfg = config or moe_config(n, num_experts, x.dtype, compiled_for_gpu(x))
    assert isinstance(cfg, MoeConfig)
    sorted_ids, expert_ids, num_post = align(ids, ranks, num_experts, cfg.block_m)
    max_blocks = expert_ids.numel()
    precision = dot_precision(x.dtype)
    inter_out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    g1 = cfg.gemm1
    _gemm1_kernel[(max_blocks, cdiv(inter, g1.block_n))](
        x, w13, inter_out, sorted_ids, expert_ids, num_post, n, h, inter,
        x.stride(0), w13.stride(0), w13.stride(1), inter_out.stride(0),
        K_TOP=top_k, BLOCK_M=cfg.block_m, BLOCK_N=g1.block_n, BLOCK_K=g1.block_k,
        PRECISION=precision, num_warps=g1.num_warps, num_stages=g1.num_stages,
        **pdl_options(x),
    )
    pair_out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    g2 = cfg.gemm2
    _gemm2_kernel[(max_blocks, cdiv(h, g2.block_n))](
        inter_out, w2, pair_out, topk_weights.reshape(-1).float(), sorted_ids, expert_ids, num_post,
        n, h, inter, inter_out.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        ROUND_WEIGHT=round_weights, BLOCK_M=cfg.block_m, BLOCK_N=g2.block_n,
        BLOCK_K=g2.block_k, PRECISION=precision, num_warps=g2.num_warps,
        num_stages=g2.num_stages, **pdl_options(x),
    )
    out = torch.empty_like(x)
    block = min(next_power_of_2(h), 1024)
    _sum_k_kernel[(t, cdiv(h, block))](pair_out, out, h, K=top_k, BLOCK=block,
                                       num_warps=max(1, min(8, block // 256)), **pdl_options(x))
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor,
              top_k: int, renormalize: bool, round_weights: bool = True,
              config: MoeConfig | moe_decode.DecodeConfig | None = None
              ) -> torch.Tensor:  # fmt: skip
    """Route on the device, then ``fused_experts``: the MoE layer's whole forward. Few pairs
    (or a DecodeConfig given) take the decode path, routing inside its first kernel when the
    config says so."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    decode = moe_decode.chosen_config(config, x, top_k, router_logits.shape[1])
    if decode is not None and decode.fuse_route:
        _check_experts(router_logits.shape[1])
        return moe_decode.decode_moe(x, w13, w2, decode, round_weights,
                                     router_logits=router_logits, top_k=top_k,
                                     renormalize=renormalize, stats=_stats_if_counting(x.device))
    weights, ids, ranks = route(router_logits, top_k, renormalize, count=decode is None)
    return fused_experts(x, w13, w2, weights, ids, ranks, round_weights, decode or config)
