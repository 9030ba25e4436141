"""The SDPA backend against a naive dense attention computed in float64: paged reads through
scattered blocks, batched decodes, chunked prefill with context, GQA/MQA, sliding windows,
soft-capping, padding slots, and the KV-store (every written slot right, nothing else touched)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ember.attention_backends.base import AttentionMetadata
from ember.attention_backends.sdpa import SdpaBackend

# (context already cached, new tokens this step); decodes (1 new token) lead, as the runner does.
MIXED = [(9, 1), (1, 1), (30, 1), (0, 7), (5, 6), (0, 1), (13, 20)]
DECODE_ONLY = [(3, 1), (17, 1), (40, 1), (1, 1), (8, 1)]
PREFILL_ONLY = [(0, 12), (0, 3), (4, 9)]


def _step(shape, num_heads, num_kv_heads, head_size, block_size, dtype=torch.float32,
          pad=3, seed=0):  # fmt: skip
    """Random paged cache (finite junk in unused slots), the step's q/k/v and its metadata,
    plus each request's full K/V in position order for the reference."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil((c + q) / block_size) for c, q in shape]
    num_blocks = sum(need) + 4
    cache = (torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen) * 5)
    cache = cache.to(dtype)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    table = torch.zeros(len(shape), max(need) + 2, dtype=torch.int32)
    slots, full_k, full_v, qsl, seq_lens = [], [], [], [0], []
    n = sum(q for _, q in shape)
    k_new = torch.randn(n + pad, num_kv_heads, head_size, generator=gen).to(dtype)
    v_new = torch.randn(n + pad, num_kv_heads, head_size, generator=gen).to(dtype)
    for r, (ctx, q_len) in enumerate(shape):
        blocks = [free.pop() for _ in range(need[r])]
        table[r, : need[r]] = torch.tensor(blocks)
        slot = [blocks[p // block_size] * block_size + p % block_size for p in range(ctx + q_len)]
        hist = torch.randn(2, ctx, num_kv_heads, head_size, generator=gen).to(dtype)
        flat = cache.view(2, -1, num_kv_heads, head_size)
        flat[:, slot[:ctx]] = hist
        lo, hi = qsl[-1], qsl[-1] + q_len
        full_k.append(torch.cat([hist[0], k_new[lo:hi]]))
        full_v.append(torch.cat([hist[1], v_new[lo:hi]]))
        slots += slot[ctx:]
        qsl.append(hi)
        seq_lens.append(ctx + q_len)
    q = torch.randn(n + pad, num_heads, head_size, generator=gen).to(dtype)
    md = AttentionMetadata(
        num_actual_tokens=n,
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        max_query_len=max(q for _, q in shape),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_tokens=next((i for i, (c, q) in enumerate(shape) if q != 1 or c == 0),
                               len(shape)),
    )  # fmt: skip
    return q, k_new, v_new, cache, md, full_k, full_v


def _dense_reference(q, full_k, full_v, md, scale, window=None, soft_cap=None):
    """Float64, one query at a time, straight from the definition."""
    num_heads = q.shape[1]
    out = torch.zeros(md.num_actual_tokens, num_heads, q.shape[2], dtype=torch.float64)
    qsl = md.query_start_loc_cpu
    for r, seq_len in enumerate(md.seq_lens_cpu):
        k, v = full_k[r].double(), full_v[r].double()
        group = num_heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q_len = qsl[r + 1] - qsl[r]
        for i in range(q_len):
            pos = seq_len - q_len + i
            lo = 0 if window is None else max(0, pos - window + 1)
            s = torch.einsum("hd,khd->hk", q[qsl[r] + i].double(), k[lo : pos + 1]) * scale
            if soft_cap is not None:
                s = soft_cap * torch.tanh(s / soft_cap)
            out[qsl[r] + i] = torch.einsum("hk,khd->hd", s.softmax(-1), v[lo : pos + 1])
    return out.flatten(1)


def _expected_cache(cache, k, v, md):
    ref = cache.clone()
    flat = ref.view(2, -1, *ref.shape[3:])
    slots = md.slot_mapping[: md.num_actual_tokens]
    flat[0, slots] = k[: md.num_actual_tokens]
    flat[1, slots] = v[: md.num_actual_tokens]
    return ref


@pytest.mark.parametrize(
    "shape", [MIXED, DECODE_ONLY, PREFILL_ONLY], ids=["mixed", "decode", "prefill"]
)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 4])
def test_matches_dense_float64(shape, heads, block_size, window):
    num_heads, num_kv_heads = heads
    head_size, scale = 16, 0.3
    q, k, v, cache, md, fk, fv = _step(shape, num_heads, num_kv_heads, head_size, block_size)
    expected_cache = _expected_cache(cache, k, v, md)
    impl = SdpaBackend.impl_cls()(num_heads, head_size, scale, num_kv_heads, window)
    out = impl.forward(q, k, v, cache, SdpaBackend.build_metadata(md))
    assert out.shape == (q.shape[0], num_heads * head_size)
    n = md.num_actual_tokens
    ref = _dense_reference(q, fk, fv, md, scale, window)
    torch.testing.assert_close(out[:n].double(), ref, atol=2e-5, rtol=1e-5)
    # New K/V landed at their slots; padding (slot -1) and every other slot are untouched.
    assert torch.equal(cache, expected_cache)


def test_soft_cap():
    q, k, v, cache, md, fk, fv = _step(MIXED, 8, 2, 16, 4)
    impl = SdpaBackend.impl_cls()(8, 16, 0.5, 2, None, logits_soft_cap=3.0)
    out = impl.forward(q, k, v, cache, md)[: md.num_actual_tokens]
    ref = _dense_reference(q, fk, fv, md, 0.5, soft_cap=3.0)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_bfloat16():
    q, k, v, cache, md, fk, fv = _step(MIXED, 8, 2, 32, 4, dtype=torch.bfloat16)
    impl = SdpaBackend.impl_cls()(8, 32, 32**-0.5, 2)
    out = impl.forward(q, k, v, cache, md)[: md.num_actual_tokens]
    assert out.dtype == torch.bfloat16
    ref = _dense_reference(q, fk, fv, md, 32**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=3e-2)


def test_lazy_plan_is_rebuilt_for_a_reused_metadata_object():
    """Without build_metadata, layers share one lazily built plan; reusing the metadata object
    for another step (same layer again) must not reuse the stale plan."""
    q, k, v, cache, md, fk, fv = _step(MIXED, 4, 2, 16, 4)
    layers = [SdpaBackend.impl_cls()(4, 16, 0.25, 2) for _ in range(2)]
    first = [impl.forward(q, k, v, cache, md) for impl in layers]
    plan = md.backend_data
    assert torch.equal(first[0], first[1])
    q2, k2, v2, cache2, md2, fk2, fv2 = _step(DECODE_ONLY, 4, 2, 16, 4, seed=5)
    for name in ("num_actual_tokens", "slot_mapping", "query_start_loc", "seq_lens",
                 "block_table", "query_start_loc_cpu", "seq_lens_cpu", "num_decode_tokens"):
        setattr(md, name, getattr(md2, name))  # fmt: skip
    out = layers[0].forward(q2, k2, v2, cache2, md)
    assert md.backend_data is not plan
    ref = _dense_reference(q2, fk2, fv2, md2, 0.25)
    torch.testing.assert_close(out[: md2.num_actual_tokens].double(), ref, atol=2e-5, rtol=1e-5)


def test_backend_surface():
    assert SdpaBackend.name == "sdpa"
    assert SdpaBackend.kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    md = _step(MIXED, 4, 2, 16, 4)[4]
    assert SdpaBackend.build_metadata(md) is md and md.backend_data is not None
