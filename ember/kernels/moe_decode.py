"""The fused MoE layer's decode path: a few (token, slot) pairs, no expert sort, two launches.

At decode batch sizes a MoE layer is a weight stream: batch 1 of Qwen3-30B-A3B reads 8 of 128
experts (75 MB per layer) and does almost no arithmetic. The sorted path (ember.kernels.
fused_moe) spends two of its five launches on sorting pairs by expert (align) and on summing
the k slots (sum_k), and pads every expert to a 16-row tl.dot block. Here each pair reads its
expert id straight from topk_ids:

    up      grid (pair, intermediate tile): x[token] . w13[e] gate and up rows as CUDA-core
            FMAs (a GEMV: one row, nothing padded), SiLU * up in the epilogue -> [N, I].
            Optionally routes first (``fuse_route``): each program finds its slot's expert
            from the router logits, so the route kernel disappears too.
    down    grid (token, hidden tile): every slot of the token at once, a [k, BLOCK_H,
            BLOCK_I] tile gathered from its k experts' w2 per step, times the routing weights,
            summed over the slots in float32 in-register -> [T, H]: no sum_k, no atomics, one
            fixed order, so results are deterministic.

Pairs sharing an expert each read it, but at once: the pair (token) axis is the grid's fastest,
so the same weight tile is asked for by neighbouring programs and L2 serves the repeats. The
rounding is the sorted path's (each matmul output rounded to the activation dtype, the SiLU
rounded before the multiply, the routing weight rounded first when the model casts it). Grids
depend on the token count alone and nothing syncs with the host: CUDA graphs capture it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, compiled_for_gpu, next_power_of_2, pdl_options

# Pairs (tokens * top_k) up to which ember.bench.moe times this path beside the sorted one.
DECODE_MAX_PAIRS = 32
# The down kernel holds all k slots of a token in one tile: beyond this, registers run out.
DECODE_MAX_TOP_K = 16
# Routing inside the up kernel ranks every expert against every other (E^2 / threads
# compares per program): cheap at 128 experts, not at 1024.
FUSE_ROUTE_MAX_EXPERTS = 256


@dataclass(frozen=True)
class DecodeConfig:
    """Tiles of the two decode kernels, and whether the up kernel routes."""

    block_n: int  # up: intermediate features per program (as many gate and up rows each)
    block_k: int  # up: hidden elements per step
    block_h: int  # down: output features per program
    block_i: int  # down: intermediate elements per step, for each of the k slots
    num_warps: int = 4
    fuse_route: bool = True
    # Steps of each kernel's weight loop in flight (Triton copies them asynchronously into
    # shared memory); 1: each step's loads issue only once the step before is summed.
    up_stages: int = 1
    down_stages: int = 1


def takes_decode_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether this path should run a layer call: one token only (its k experts are distinct,
    nothing is read twice). On an H200 at the Qwen3-30B-A3B shape one layer took 28.1 us here
    against the sorted path's 31.0 at 1 token, but 57.0 against 51.3 at 2 tokens and 94.9
    against 80.7 at 4 (``python -m ember.bench.moe --kernel``, 2026-12-02): past one token the
    sorted path's single read of a shared expert wins."""
    return num_tokens == 1 and top_k <= DECODE_MAX_TOP_K


def decode_config(top_k: int, num_experts: int, dtype: torch.dtype,
                  on_gpu: bool) -> DecodeConfig:  # fmt: skip
    """Tiles for an H200-class GPU, the fastest at 1 token of ``python -m ember.bench.moe
    --kernel``'s candidates. Enough programs at batch 1 to fill every SM several times over
    (Qwen3-30B-A3B: 384 up, 1024 down), each step's weights loaded before any is used, in
    16-byte copies: 32 KB a step of an up program (3 programs an SM), 8 KB of a down one (k
    slots x 2 rows x 256). Small tiles under TRITON_INTERPRET (CPU tests)."""
    k_pad = _k_pad(top_k)
    fuse = num_experts <= FUSE_ROUTE_MAX_EXPERTS
    if not on_gpu:
        return DecodeConfig(16, 32, 16, 16, 1, fuse)
    wide = dtype == torch.float32  # twice the bytes per element: half the step
    # Down tiles of 2 output rows: the fastest of the H200 sweep at 1 token (28.1 us a layer
    # against 34.0 with 4 rows), twice the programs for the same step bytes per row.
    block_h = 2
    block_i = max(16, min(1024, 4096 // (k_pad * block_h)))
    # One step of each loop in flight behind the one being summed (stages 2): Qwen3-30B-A3B
    # decoded 352.7 tok/s at batch 1 on an H200 against 334.0 without (stages 1) and 345.5
    # with two steps ahead (stages 3, which needs 66 KB of shared memory an up program).
    return DecodeConfig(16, 256 if wide else 512, block_h, block_i // 2 if wide else block_i,
                        4, fuse, up_stages=2, down_stages=2)


def chosen_config(config: object, x: torch.Tensor, top_k: int,
                  num_experts: int) -> DecodeConfig | None:  # fmt: skip
    """fused_moe's choice: the decode tiles when a call takes this path (``config`` is a
    DecodeConfig, or None and takes_decode_path says so), else None (the sorted path)."""
    if isinstance(config, DecodeConfig):
        return config
    if config is None and takes_decode_path(x.shape[0], top_k, num_experts):
        return decode_config(top_k, num_experts, x.dtype, compiled_for_gpu(x))
    return None


def _k_pad(top_k: int) -> int:
    return max(2, next_power_of_2(top_k))


@triton.jit
def _route_slot(logits_ptr, E, slot, K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    # (expert, weight) of top-k slot `slot` of one token: float32 softmax; the slot-th expert
    # by logit, lowest index first on ties (the order of _route_kernel's k rounds of argmax).
    # The rank of each expert is the count of experts ahead of it, compared in CHUNK-wide
    # strips: a handful of reductions, where k rounds of argmax are 2k in a row. Ranked by the
    # logits (as loaded: the same bits in every strip, so ranks are consistent), which softmax
    # orders the same way, unless two logits round to one probability (either is then right).
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + offs, mask=valid, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=0)
    rank = tl.zeros([BLOCK_E], dtype=tl.int32)
    for j0 in range(0, E, CHUNK):
        offs_j = j0 + tl.arange(0, CHUNK)
        xj = tl.load(logits_ptr + offs_j, mask=offs_j < E, other=-float("inf")).to(tl.float32)
        ahead = (xj[None, :] > x[:, None]) | ((xj[None, :] == x[:, None])
                                              & (offs_j[None, :] < offs[:, None]))
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    mine = valid & (rank == slot)
    expert = tl.sum(tl.where(mine, offs, 0), axis=0)
    weight = tl.sum(tl.where(mine, p, 0.0), axis=0)
    if RENORMALIZE:
        weight = weight / tl.sum(tl.where(valid & (rank < K), p, 0.0), axis=0)
    return expert, weight


@triton.jit
def _up_kernel(x_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, logits_ptr, H, INTER, E,
               stride_x, stride_we, stride_wn, stride_o, stride_l,
               K_TOP: tl.constexpr, FUSE_ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr,
               BLOCK_E: tl.constexpr, CHUNK_E: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    # No weight can be read before the wait: which expert a pair takes is routing's output.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    tok = (pair // K_TOP).to(tl.int64)
    if FUSE_ROUTE:
        e, w = _route_slot(logits_ptr + tok * stride_l, E, pair % K_TOP, K_TOP, RENORMALIZE,
                           BLOCK_E, CHUNK_E)
        if pid_n == 0:  # the down kernel's routing (one writer per pair)
            tl.store(ids_ptr + pair, e)
            tl.store(weights_ptr + pair, w)
    else:
        e = tl.load(ids_ptr + pair)
    ty = out_ptr.dtype.element_ty
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + INTER * stride_wn
    x_ptrs = x_ptr + tok * stride_x + offs_k
    # Each step's products reduced at once; with STAGES > 1 the next steps' tiles are already
    # on their way into shared memory meanwhile, so the weight stream does not pause per step.
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k + k0 < H
        xk = tl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = col_ok[:, None] & k_ok[None, :]
        g = tl.load(g_ptrs + k0, mask=mask, other=0.0)
        u = tl.load(u_ptrs + k0, mask=mask, other=0.0)
        acc_g += tl.sum(g.to(tl.float32) * xk, axis=1)
        acc_u += tl.sum(u.to(tl.float32) * xk, axis=1)
    # As the torch path rounds: gate_up output, then silu(gate), then the product.
    g = acc_g.to(ty).to(tl.float32)
    u = acc_u.to(ty).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_o + offs_n, (act * u).to(ty), mask=col_ok)


@triton.jit
def _down_kernel(a_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr, stats_ptr, N, H, INTER, E,
                 stride_a, stride_we, stride_wn, stride_o,
                 K_TOP: tl.constexpr, K_PAD: tl.constexpr, ROUND_WEIGHT: tl.constexpr,
                 STATS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_I: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    # No weight can be read before the wait: the experts may be the up kernel's routing.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    ty = out_ptr.dtype.element_ty
    slots = tl.arange(0, K_PAD)
    in_k = slots < K_TOP
    pair = t * K_TOP + slots
    e = tl.load(ids_ptr + pair, mask=in_k, other=0).to(tl.int64)
    w = tl.load(weights_ptr + pair, mask=in_k, other=0.0)
    if ROUND_WEIGHT:  # the model casts routing weights to the activation dtype
        w = w.to(ty).to(tl.float32)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    offs_i = tl.arange(0, BLOCK_I)
    w_ptrs = (w_ptr + e[:, None, None] * stride_we + offs_h[None, :, None] * stride_wn
              + offs_i[None, None, :])
    a_ptrs = a_ptr + pair[:, None] * stride_a + offs_i[None, :]
    row_ok = in_k[:, None, None] & h_ok[None, :, None]
    acc = tl.zeros([K_PAD, BLOCK_H], dtype=tl.float32)
    for i0 in tl.range(0, INTER, BLOCK_I, num_stages=STAGES):  # as in the up kernel
        i_ok = offs_i + i0 < INTER
        a = tl.load(a_ptrs + i0, mask=in_k[:, None] & i_ok[None, :], other=0.0)
        b = tl.load(w_ptrs + i0, mask=row_ok & i_ok[None, None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
    # Each slot's down output rounded, times its weight, rounded (as the sorted path stores
    # them), then the slots summed in float32 and rounded once (as its sum_k).
    y = acc.to(ty).to(tl.float32)
    y = (y * w[:, None]).to(ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs_h, tl.sum(y, axis=0).to(ty), mask=h_ok)
    if STATS:  # benchmarks: distinct experts over all pairs, and calls (one program writes)
        if (t == 0) & (pid_h == 0):
            offs_e = tl.arange(0, BLOCK_E)
            hit = tl.zeros([BLOCK_E], dtype=tl.int32)
            for p0 in range(0, N, 8):
                offs_p = p0 + tl.arange(0, 8)
                ids = tl.load(ids_ptr + offs_p, mask=offs_p < N, other=-1)
                hit |= tl.max((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
            tl.store(stats_ptr, tl.load(stats_ptr) + tl.sum(hit, axis=0).to(tl.int64))
            tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + 1)


def decode_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               config: DecodeConfig, round_weights: bool = True, *,
               topk_weights: torch.Tensor | None = None, topk_ids: torch.Tensor | None = None,
               router_logits: torch.Tensor | None = None, top_k: int = 0,
               renormalize: bool = False, stats: torch.Tensor | None = None
               ) -> torch.Tensor:  # fmt: skip
    """sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for a few tokens, either
    for routing done elsewhere (``topk_weights``, ``topk_ids`` [T, k]) or routing the
    ``router_logits`` [T, E] inside the up kernel (``top_k``, ``renormalize``; the config's
    ``fuse_route`` is then taken as set). ``stats``: fused_moe's expert-hit counters, or None."""
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    fuse = router_logits is not None
    if not fuse:
        assert topk_ids is not None and topk_weights is not None
        top_k = topk_ids.shape[1]
    n = t * top_k
    dev = x.device
    if x.stride(-1) != 1:
        x = x.contiguous()
    if fuse:
        ids = torch.empty(n, dtype=torch.int32, device=dev)
        weights = torch.empty(n, dtype=torch.float32, device=dev)
        logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    else:
        ids = topk_ids.reshape(-1).to(torch.int32)
        weights = topk_weights.reshape(-1).float()
        logits = x  # unused
    block_e = max(2, next_power_of_2(num_experts))
    inter_out = torch.empty(n, inter, dtype=x.dtype, device=dev)
    pdl = pdl_options(x)
    _up_kernel[(n, cdiv(inter, config.block_n))](
        x, w13, inter_out, ids, weights, logits, h, inter, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), inter_out.stride(0), logits.stride(0),
        K_TOP=top_k, FUSE_ROUTE=fuse, RENORMALIZE=renormalize, BLOCK_E=block_e,
        CHUNK_E=max(1, min(block_e, 4096 // block_e)), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, STAGES=config.up_stages, num_warps=config.num_warps, **pdl,
    )
    out = torch.empty_like(x)
    _down_kernel[(t, cdiv(h, config.block_h))](
        inter_out, w2, out, ids, weights, stats if stats is not None else weights, n, h, inter,
        num_experts, inter_out.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        K_TOP=top_k, K_PAD=_k_pad(top_k), ROUND_WEIGHT=round_weights, STATS=stats is not None,
        BLOCK_E=block_e, BLOCK_H=config.block_h, BLOCK_I=config.block_i,
        STAGES=config.down_stages, num_warps=config.num_warps, **pdl,
    )
    return out
