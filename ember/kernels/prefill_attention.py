"""Paged attention for query chunks of any length (prefill, chunked prefill, prefix-cache hits).

Request ``r`` owns query tokens ``query_start_loc[r]:query_start_loc[r+1]`` at absolute positions
``seq_len - q_len + i``; token i sees keys ``0..pos`` (the cached prefix plus the causal part of its
own chunk), or only the last ``sliding_window`` of them. Keys and values are read only through
``block_table``, so a prefix-cache hit and a continued chunk look the same as a fresh prompt.

One program per (request, kv head, tile of BLOCK_Q query tokens) treats the BLOCK_Q tokens times
the query heads of the kv group as the rows of one [BLOCK_M, D] tile (GQA: each K/V tile is loaded
once for the whole group), and runs a flash-attention online softmax in fp32. Key tiles strictly
below the chunk's first token need no causal mask; only the diagonal tiles pay for it.
An fp8 cache is read as ember.kernels.decode_attention reads it: tiles widened (to float16 for
16-bit queries, ember.kernels.store_kv.widen_fp8_to_f16), k_scale folded into the softmax
scale, v_scale applied to the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.attention_common import NEG_BIG, scaled_scores
from ember.kernels.launch import cdiv, dot_precision, head_pad, next_power_of_2
from ember.kernels.store_kv import FP8_DTYPES, widen_fp8_to_f16
from ember.kernels.tuning import PrefillConfig, tuning_for

__all__ = ["PrefillConfig", "default_config", "paged_prefill_attention"]


def default_config(head_size: int, device: torch.device | None = None) -> PrefillConfig:
    """The tuned tiles for this head size on ``device`` (ember.kernels.tuning)."""
    return tuning_for(device).prefill.get(head_pad(head_size), PrefillConfig())


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_base, stride_ckv, stride_cb, stride_ct, bt_row, tile, qpos, hi,
    scale, softcap, window,
    offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pos = tile + offs_n
    in_range = pos < hi
    blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    kv_ptrs = k_base + (blk * stride_cb + (pos % BLOCK_SIZE) * stride_ct)[:, None]
    kv_ptrs = kv_ptrs + offs_d[None, :]
    if HEAD_PAD == HEAD_SIZE:
        kv_mask = in_range[:, None]
    else:
        kv_mask = in_range[:, None] & d_mask[None, :]
    k = tl.load(kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # widens an fp8 cache
    v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0).to(q.dtype)
    s = scaled_scores(tl.dot(q, tl.trans(k), input_precision=DOT_PREC), scale, softcap, SOFTCAP)
    if CAUSAL:
        visible = (pos[None, :] <= qpos[:, None]) & in_range[None, :]
        if SLIDING:
            visible = visible & (qpos[:, None] - pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
    elif SLIDING:
        s = tl.where(qpos[:, None] - pos[None, :] < window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


# stride_bt (the step's widest block table, in blocks) changes from step to step; specializing
# it (1, multiples of 16) would compile up to three variants of each tile shape for nothing:
# it only offsets the row of a gathered block-id load. Likewise the per-request metadata
# arrives sliced past a mixed step's decodes (query_start_loc[num_decodes:], ...), so its
# 16-byte alignment changes with the decode count: specializing on it compiled new variants
# inside a fresh machine's first run; these are scalar and gathered loads that gain nothing.
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["query_start_loc_ptr", "seq_lens_ptr",
                                            "block_table_ptr"])
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    out_ptr,
    scale,
    softcap,
    window,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ckv,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_FP8: tl.constexpr,
    WIDEN_F16: tl.constexpr,
):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_Q  # first query token of this tile, relative to the chunk
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # keys already in the cache before this chunk

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_PAD)
    tok = first + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    heads = kvh * GROUP + g
    row_mask = (tok < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_SIZE
    io_mask = row_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    if not KV_FP8:  # dots in the cache's dtype; an fp8 cache is widened to q's instead
        q = q.to(cache_ptr.dtype.element_ty)
    elif WIDEN_F16:  # ember.kernels.store_kv.widen_fp8_to_f16
        q = q.to(tl.float16)
    qpos = ctx + tok

    # Keys this tile needs: [lo, hi). Tiles wholly below the chunk's first token are unmasked.
    diag = ctx + first
    hi = tl.minimum(seq_len, diag + BLOCK_Q)
    hi = tl.where(first < q_len, hi, 0)  # tiles past the chunk's end do nothing
    lo = 0
    if SLIDING:
        lo = (tl.maximum(diag - window + 1, 0) // BLOCK_N) * BLOCK_N
    full_end = lo + tl.maximum((tl.minimum(diag, hi) - lo) // BLOCK_N, 0) * BLOCK_N

    k_base = cache_ptr + kvh * stride_ch
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for tile in range(lo, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, stride_ckv, stride_cb, stride_ct, bt_row, tile, qpos, hi,
            scale, softcap, window, offs_n, offs_d, d_mask,
            BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, False, SLIDING, SOFTCAP, DOT_PREC,
        )
    for tile in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_base, stride_ckv, stride_cb, stride_ct, bt_row, tile, qpos, hi,
            scale, softcap, window, offs_n, offs_d, d_mask,
            BLOCK_SIZE, HEAD_SIZE, HEAD_PAD, True, SLIDING, SOFTCAP, DOT_PREC,
        )

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * v_scale
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    *,
    logits_soft_cap: float | None = None,
    config: PrefillConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal paged attention for the requests described by ``seq_lens`` ([num_reqs]).

    q/out: [num_tokens, num_heads, head_size]; ``query_start_loc`` ([num_reqs + 1] int32) holds
    absolute token indices into q, so a slice of a larger batch's metadata works unchanged.
    ``max_query_len`` (a host int, no device sync) sizes the grid; ``config`` overrides the
    tuned tiles. An fp8 ``kv_cache`` holds K / ``k_scale`` and V / ``v_scale``.
    """
    num_tokens, num_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0:
        return out
    hpad = head_pad(head_size)
    cfg = config or default_config(head_size, q.device)
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    # Rows per program stay ~block_m (and >= 16 for tl.dot) whatever the group size.
    block_q = max(cfg.block_m // group_pad, cdiv(16, group_pad), 1)
    block_q = min(block_q, max(next_power_of_2(max_query_len), cdiv(16, group_pad)))
    sliding = sliding_window is not None and sliding_window > 0
    grid = (num_reqs, num_kv_heads, cdiv(max_query_len, block_q))
    fp8 = kv_cache.dtype in FP8_DTYPES
    _prefill_kernel[grid](
        q,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_table,
        out,
        scale * k_scale if fp8 else scale,
        logits_soft_cap or 0.0,
        sliding_window if sliding else 0,
        v_scale,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size,
        HEAD_PAD=hpad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=cfg.block_n,
        SLIDING=sliding,
        SOFTCAP=bool(logits_soft_cap),
        DOT_PREC=dot_precision(q.dtype if fp8 else kv_cache.dtype),
        KV_FP8=fp8,
        WIDEN_F16=widen_fp8_to_f16(kv_cache.dtype, q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
