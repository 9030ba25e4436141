"""Triton kernel that writes new keys and values into the paged KV cache at ``slot_mapping``.

One program per token copies that token's ``[num_kv_heads, head_size]`` key and value rows to
``slot = block * block_size + offset``. Slots < 0 mark padding (CUDA-graph batches) and are
skipped, so the grid depends only on the number of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import next_power_of_2


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ckv,  # distance between the key cache and the value cache
    stride_cb,
    stride_ct,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # Padding tokens (slot < 0) write nothing; a mask keeps the program branch-free.
    valid = slot >= 0
    safe_slot = tl.where(valid, slot, 0)
    block = safe_slot // BLOCK_SIZE
    offset = safe_slot % BLOCK_SIZE

    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    mask = valid & (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_SIZE)

    src_k = key_ptr + tok.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + tok.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = cache_ptr + block * stride_cb + offset * stride_ct + offs_h[:, None] * stride_ch
    dst = dst + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    elt = cache_ptr.dtype.element_ty
    tl.store(dst, k.to(elt), mask=mask)
    tl.store(dst + stride_ckv, v.to(elt), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ([num_tokens, num_kv_heads, head_size]) into ``kv_cache``.

    ``kv_cache`` is ``[2, num_blocks, block_size, num_kv_heads, head_size]``; ``slot_mapping`` is
    ``[>= num_tokens]`` (entries < 0 skipped). Values are cast to the cache dtype.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    # The kernel addresses head_size with unit stride (vectorised rows); copy only if needed.
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert kv_cache.stride(-1) == 1, "kv_cache must be contiguous along head_size"
    _, _, block_size, cache_heads, cache_head_size = kv_cache.shape
    assert (cache_heads, cache_head_size) == (num_kv_heads, head_size)
    assert slot_mapping.shape[0] >= num_tokens
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size),
        num_warps=1 if num_kv_heads * head_size <= 512 else 4,
    )
