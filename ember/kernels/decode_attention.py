"""Paged decode attention (one query token per request) with split-KV (flash-decoding).

Kernel 1 runs one program per (request, kv head, split): it loads the query rows of every query
head in the kv group at once (GQA: each K/V tile is read from HBM once for the whole group),
walks its share of the context in BLOCK_N-token tiles gathered through ``block_table``, and keeps
an online softmax in fp32. With one split it writes the output directly (the fast path when the
batch alone fills the GPU); otherwise it writes a normalised partial output and its log-sum-exp,
and kernel 2 (ember.kernels.decode_merge) merges the splits of each (request, head).

The grid depends only on the batch size and the split count, and empty splits or requests with
``seq_len == 0`` (padding in CUDA-graph batches) are handled in the kernels, so launches are
graph-safe. Tiles and the split policy come from ember.kernels.tuning (per device; the
ember.bench.attention_kernels and decode_latency benchmarks sweep them), read by
ember.kernels.decode_splits (host-side: the config, the split count, the workspace size).

An fp8 cache holds K / k_scale and V / v_scale (ember.kernels.store_kv): tiles are widened as
they are loaded (exact; to float16 for 16-bit queries, ember.kernels.store_kv.widen_fp8_to_f16),
k_scale is folded into the softmax scale and v_scale multiplies the output, so the inner loop
does no extra arithmetic. Without splits its tiles are the tables' entry for the same bytes a
key (an fp8 head of 128 takes a bfloat16 head of 64's tiles: twice the keys a tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels import int8_act
from ember.kernels.attention_common import NEG_BIG, scaled_scores
from ember.kernels.decode_merge import merge_splits, split_plan
from ember.kernels.decode_splits import (
    choose_num_splits,
    decode_workspace_numel,
    default_config,
)
from ember.kernels.launch import (
    compiled_for_gpu,
    dot_precision,
    head_pad,
    next_power_of_2,
    num_sms,
    pdl_options,
)
from ember.kernels.rotary import load_rotated
from ember.kernels.store_kv import fp8_max, quantize_fp8, soft_fp8, widen_fp8_to_f16
from ember.kernels.tuning import DecodeConfig, tuning_for

__all__ = [
    "DecodeConfig",
    "choose_num_splits",
    "decode_workspace_numel",
    "default_config",
    "paged_decode_attention",
]


# Not specialized: num_splits changes with the batch and (in mixed steps) the longest sequence,
# stride_bt with the widest block table of an eager step. Triton would compile a variant for a
# value of 1 and for multiples of 16 of each; neither is on a hot path (a per-program divide,
# the base of a gathered block-id load), and DIRECT already separates the one-split kernel.
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr,
    cache_ptr,
    seq_lens_ptr,
    block_table_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    k_new_ptr,
    v_new_ptr,
    slot_ptr,
    cos_ptr,
    sin_ptr,
    scale,
    softcap,
    window,
    num_splits,
    inv_k_scale,
    inv_v_scale,
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
    stride_knt,
    stride_vnt,
    stride_cos,
    stride_sin,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    STORE_NEW: tl.constexpr,
    ROTARY: tl.constexpr,  # q and the new key arrive unrotated (see paged_decode_attention)
    UNFUSED: tl.constexpr,  # ember.kernels.rotary's rounding of its products
    FP8_MAX: tl.constexpr,  # > 0: an fp8 cache (see the module docstring)
    SOFT_FP8: tl.constexpr,  # round to fp8 in float arithmetic (ember.kernels.store_kv)
    WIDEN_F16: tl.constexpr,  # an fp8 cache is widened to float16 (see the module docstring)
    PDL: tl.constexpr,
):
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    start, per_split = split_plan(seq_len, window, num_splits, BLOCK_N, SLIDING)
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)  # hi <= lo: empty split, the loop does nothing

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_SIZE
    q_ptrs = q_ptr + req.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    # Rows >= GROUP only pad M up to 16 for tl.dot; they are zero and never stored.
    cos_row = cos_ptr + req.to(tl.int64) * stride_cos
    sin_row = sin_ptr + req.to(tl.int64) * stride_sin
    if ROTARY:  # HEAD_PAD == HEAD_SIZE here
        q = load_rotated(q_ptrs - offs_d[None, :], offs_d[None, :], g_mask[:, None], cos_row,
                          sin_row, HEAD_SIZE // 2, UNFUSED)
    else:
        q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if FP8_MAX == 0:  # dots in the cache's dtype; an fp8 cache is widened to q's instead
        q = q.to(cache_ptr.dtype.element_ty)
    elif WIDEN_F16:
        q = q.to(tl.float16)

    k_base = cache_ptr + kvh * stride_ch
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    last = seq_len - 1  # the new token's position
    # With STORE_NEW the new token's K/V are not in the cache yet: the tiles stop before it and
    # an epilogue adds it from registers (the tile loop stays the same kernel as without).
    end = tl.minimum(hi, last) if STORE_NEW else hi
    m_i = tl.full([GROUP_PAD], NEG_BIG, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for tile in range(lo, end, BLOCK_N):
        pos = tile + offs_n
        n_mask = pos < end
        if SLIDING:
            n_mask = n_mask & (pos >= seq_len - window)
        # Block ids per key: several cache blocks per tile, gathered through the block table.
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos < end, other=0).to(tl.int64)
        kv_off = blk * stride_cb + (pos % BLOCK_SIZE) * stride_ct
        kv_ptrs = k_base + kv_off[:, None] + offs_d[None, :]
        if HEAD_PAD == HEAD_SIZE:
            kv_mask = (pos < end)[:, None]
        else:
            kv_mask = (pos < end)[:, None] & d_mask[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        s = scaled_scores(qk, scale, softcap, SOFTCAP)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    if STORE_NEW:
        # The split holding the new position (instead of a separate store kernel) writes the
        # step's K/V to the cache and attends to them as one more key, rounding like the tiles.
        slot = tl.load(slot_ptr + req)
        if (lo <= last) & (last < hi):
            k_row = k_new_ptr + req.to(tl.int64) * stride_knt + kvh * HEAD_SIZE
            if ROTARY:  # loaded again here: nothing of q's rotation stays live over the loop
                k_new = load_rotated(k_row, offs_d, d_mask, cos_row, sin_row, HEAD_SIZE // 2,
                                      UNFUSED)
            else:
                k_new = tl.load(k_row + offs_d, mask=d_mask, other=0.0)
            v_new = tl.load(v_new_ptr + req.to(tl.int64) * stride_vnt + kvh * HEAD_SIZE + offs_d,
                            mask=d_mask, other=0.0)
            if FP8_MAX > 0:  # stored as ember.kernels.store_kv stores them
                k_new = quantize_fp8(k_new, inv_k_scale, FP8_MAX, SOFT_FP8)
                v_new = quantize_fp8(v_new, inv_v_scale, FP8_MAX, SOFT_FP8)
            k_new = k_new.to(cache_ptr.dtype.element_ty)
            v_new = v_new.to(cache_ptr.dtype.element_ty)
            if slot >= 0:
                new_ptrs = (k_base + (slot // BLOCK_SIZE) * stride_cb
                            + (slot % BLOCK_SIZE) * stride_ct + offs_d)
                tl.store(new_ptrs, k_new, mask=d_mask)
                tl.store(new_ptrs + stride_ckv, v_new, mask=d_mask)
            qk_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1)
            s_new = scaled_scores(qk_new, scale, softcap, SOFTCAP)
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            p_new = p_new.to(q.dtype).to(tl.float32)
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / safe_l[:, None]
    if FP8_MAX > 0:
        o = o * v_scale
    if DIRECT:
        o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
        o_ptrs = o_ptrs + offs_d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (req.to(tl.int64) * NUM_HEADS + heads) * num_splits + split  # [GROUP_PAD]
        p_ptrs = part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :]
        keep = g_mask & (lo < hi)
        tl.store(p_ptrs, o, mask=keep[:, None])
        tl.store(part_lse_ptr + row, m_i + tl.log2(safe_l), mask=keep)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    *,
    logits_soft_cap: float | None = None,
    max_seq_len: int | None = None,
    workspace: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    int8_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged context.

    q: [batch, num_heads, head_size]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_size]; seq_lens: [batch] int32 (context length including the query token);
    block_table: [batch, max_blocks] int32. Returns out [batch, num_heads, head_size].
    ``num_splits=None`` picks from the batch (and ``max_seq_len`` when given); ``workspace``
    (fp32, >= decode_workspace_numel(...)) avoids an allocation per call; ``config`` overrides
    the device's tuned tables (ember.kernels.tuning). ``new_kv = (k, v,
    slot_mapping)`` ([batch, num_kv_heads, head_size] x 2, [batch]) are the step's new keys and
    values, not yet in the cache: the kernel stores them (slot -1: nothing) and attends to them.
    An fp8 ``kv_cache`` holds K / ``k_scale`` and V / ``v_scale`` (per-tensor scales).
    ``int8_out`` (ember.kernels.int8_act.empty_int8_rows(batch, num_heads * head_size)): the
    output is written there instead, in int8_act's form (what ``quantize_int8`` makes of the
    half-precision rows), for a 4-bit o_proj's integer GEMV; it needs split launches
    (``num_splits`` > 1, the merge writes it) and heads of int8_act.GROUP. ``rotary = (cos,
    sin)`` ([batch, head_size / 2] each, as ``RotaryEmbedding.cos_sin`` makes them): q and the
    new keys (``new_kv``, needed then) arrive unrotated, and each program rotates them
    (rotate_half over the whole head, bit for bit ember.kernels.rotary's result) as it loads
    them: one kernel fewer a layer. Needs a power-of-two head size.
    """
    batch, num_heads, head_size = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.stride(-1) == 1
    if batch == 0:
        return out
    sms = num_sms(q.device)
    tuning = tuning_for(q.device)
    itemsize = kv_cache.element_size()
    if num_splits is None:
        policy = config or default_config(head_size, tuning=tuning, cache_itemsize=itemsize)
        num_splits = choose_num_splits(batch, num_kv_heads, max_seq_len, policy, sms)
    cfg = config or default_config(head_size, split=num_splits > 1,
                                   latency=batch * num_kv_heads * num_splits <= sms,
                                   tuning=tuning, cache_itemsize=itemsize)
    group = num_heads // num_kv_heads
    hpad = head_pad(head_size)
    sliding = sliding_window is not None and sliding_window > 0
    direct = num_splits == 1
    if int8_out is not None and (direct or head_size != int8_act.GROUP):
        raise ValueError(f"int8 output needs split launches and heads of {int8_act.GROUP} "
                         f"(num_splits={num_splits}, head_size={head_size})")
    if direct:
        part_out = part_lse = out  # unused by the kernel
    else:
        n_part = batch * num_heads * num_splits
        need = n_part * (hpad + 1)
        if workspace is None or workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        part_out = workspace[: n_part * hpad]
        part_lse = workspace[n_part * hpad : need]
    common = dict(
        window=sliding_window if sliding else 0,
        num_splits=num_splits,
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=hpad,
        BLOCK_N=cfg.block_n,
        SLIDING=sliding,
        **pdl_options(q),
    )
    fp8 = fp8_max(kv_cache.dtype)
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        assert k_new.stride(-1) == 1 and k_new.stride(-2) == head_size
        assert v_new.stride(-1) == 1 and v_new.stride(-2) == head_size
    else:
        k_new = v_new = slots = q  # unused by the kernel
    if rotary is not None:
        if new_kv is None or head_pad(head_size) != head_size:
            raise ValueError("rotary needs the new keys (new_kv) and a power-of-two head size "
                             f"(head_size={head_size})")
        cos, sin = (t.reshape(t.shape[0], t.shape[-1]) for t in rotary)
        assert cos.shape == sin.shape == (batch, head_size // 2), (cos.shape, sin.shape)
        assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    else:
        cos = sin = q  # unused by the kernel
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        kv_cache,
        seq_lens,
        block_table,
        out,
        part_out,
        part_lse,
        k_new,
        v_new,
        slots,
        cos,
        sin,
        scale=scale * k_scale if fp8 else scale,
        softcap=logits_soft_cap or 0.0,
        inv_k_scale=1.0 / k_scale,
        inv_v_scale=1.0 / v_scale,
        v_scale=v_scale,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ckv=kv_cache.stride(0),
        stride_cb=kv_cache.stride(1),
        stride_ct=kv_cache.stride(2),
        stride_ch=kv_cache.stride(3),
        stride_bt=block_table.stride(0),
        stride_knt=k_new.stride(0),
        stride_vnt=v_new.stride(0),
        stride_cos=cos.stride(0),
        stride_sin=sin.stride(0),
        STORE_NEW=new_kv is not None,
        ROTARY=rotary is not None,
        UNFUSED=compiled_for_gpu(q),
        GROUP=group,
        GROUP_PAD=max(16, next_power_of_2(group)),
        BLOCK_SIZE=block_size,
        SOFTCAP=bool(logits_soft_cap),
        DIRECT=direct,
        DOT_PREC=dot_precision(q.dtype if fp8 else kv_cache.dtype),
        FP8_MAX=fp8,
        SOFT_FP8=soft_fp8(kv_cache),
        WIDEN_F16=widen_fp8_to_f16(kv_cache.dtype, q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **common,
    )
    if not direct:
        merge_splits(part_out, part_lse, seq_lens, out, int8_out, **common)
    return out
