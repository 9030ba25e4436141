"""Triton kernel that writes new keys and values into the paged KV cache at ``slot_mapping``.

One program per token copies that token's ``[num_kv_heads, head_size]`` key and value rows to
``slot = block * block_size + offset``. Slots < 0 mark padding (CUDA-graph batches) and are
skipped, so the grid depends only on the number of tokens. An fp8 cache (float8_e4m3fn) stores
key / k_scale and value / v_scale, saturated at the format's largest finite value (a plain cast
would turn an outlier into NaN); the attention kernels multiply the scales back.

Triton's interpreter (3.6) rounds float32 -> float8 wrongly when the mantissa carries into the
exponent (127.98 becomes 64, not 128), so under TRITON_INTERPRET the kernels round to the e4m3
grid in float arithmetic first (``rne_e4m3``) and only cast exact values; compiled kernels use
the hardware conversion. Both give torch's round-to-nearest-even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import compiled_for_gpu, next_power_of_2


@triton.jit
def rne_e4m3(x):
    """float32 x (|x| <= 448) rounded to nearest-even on the float8_e4m3fn grid, as float32:
    3 mantissa bits in every binade from 2^-6 up, steps of 2^-9 below (subnormals)."""
    a = tl.abs(x)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / quantum + 8388608.0) - 8388608.0) * quantum  # 2^23: float32 rounds to an integer
    return tl.where(x < 0, -r, r)


@triton.jit
def quantize_fp8(x, inv_scale, FP8_MAX: tl.constexpr, SOFT: tl.constexpr):
    """x / scale saturated to the fp8 range (float32; the caller casts), exactly on the e4m3
    grid when SOFT (the interpreter, see the module docstring)."""
    y = tl.clamp(x.to(tl.float32) * inv_scale, -FP8_MAX, FP8_MAX)
    if SOFT:
        y = rne_e4m3(y)
    return y


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
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,  # 0: a float cache, a plain cast
    SOFT_FP8: tl.constexpr,
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
    if FP8_MAX > 0:
        k = quantize_fp8(k, inv_k_scale, FP8_MAX, SOFT_FP8)
        v = quantize_fp8(v, inv_v_scale, FP8_MAX, SOFT_FP8)
    tl.store(dst, k.to(elt), mask=mask)
    tl.store(dst + stride_ckv, v.to(elt), mask=mask)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 cache dtype; 0.0 for every other dtype."""
    return float(torch.finfo(dtype).max) if dtype in FP8_DTYPES else 0.0


FP8_DTYPES = (torch.float8_e4m3fn,)


def widen_fp8_to_f16(cache_dtype: torch.dtype, q_dtype: torch.dtype) -> bool:
    """Whether attention over an fp8 cache widens its tiles to float16 (and computes its dots
    in float16) for 16-bit queries. Widening e4m3 to float16 is exact, and it is what the
    hardware's conversion produces (sm_89+: `cvt.rn.f16x2.e4m3x2`, two values at a time): with
    it the fp8 decode kernel ran 1.05-1.12x faster on an H200 than widening to bfloat16
    (docs/benchmarks.md). A float16 query keeps 3 more mantissa bits than bfloat16; it would
    overflow only past 65,504, far above what queries reach. float32 queries widen to float32."""
    return cache_dtype in FP8_DTYPES and q_dtype in (torch.bfloat16, torch.float16)


def soft_fp8(x: torch.Tensor) -> bool:
    """Whether kernels launched on x's device round to fp8 themselves (the interpreter)."""
    return not compiled_for_gpu(x)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ([num_tokens, num_kv_heads, head_size]) into ``kv_cache``.

    ``kv_cache`` is ``[2, num_blocks, block_size, num_kv_heads, head_size]``; ``slot_mapping`` is
    ``[>= num_tokens]`` (entries < 0 skipped). Values are cast to the cache dtype; an fp8 cache
    stores them divided by the per-tensor ``k_scale`` / ``v_scale``.
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
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=block_size,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_PAD=next_power_of_2(head_size),
        FP8_MAX=fp8_max(kv_cache.dtype),
        SOFT_FP8=soft_fp8(kv_cache),
        num_warps=1 if num_kv_heads * head_size <= 512 else 4,
    )
