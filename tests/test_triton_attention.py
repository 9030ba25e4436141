"""Triton attention kernels and the "triton" backend against a float64 dense reference.

Without CUDA the kernels run under TRITON_INTERPRET=1 on the CPU at small shapes; with CUDA the
same small cases run compiled, and the ``gpu``-marked section checks real shapes (bf16, long
contexts, large blocks) against torch SDPA in float32. Unused cache slots and block-table entries
hold NaN, so a kernel that reads past a request's context or outside its mask fails loudly.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must happen before triton is imported: @triton.jit reads it when the kernels are defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ember.attention_backends.base import AttentionMetadata  # noqa: E402
from ember.attention_backends.triton_backend import TritonBackend  # noqa: E402
from ember.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    choose_num_splits,
    default_config,
    paged_decode_attention,
)
from ember.kernels.prefill_attention import PrefillConfig, paged_prefill_attention  # noqa: E402
from ember.kernels.store_kv import store_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def make_paged(seq_lens, num_kv_heads, head_size, block_size, dtype=torch.float32, device=DEV,
               spare_blocks=3, seed=0):
    """Random paged cache holding each request's context; every other slot is NaN."""
    torch.manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks + 1
    max_blocks = max(need) + 2
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                       dtype=dtype, device=device)
    perm = torch.randperm(num_blocks - 1).to(device)
    poison = num_blocks - 1  # a NaN block that unused table entries point at
    block_table = torch.full((len(seq_lens), max_blocks), poison, dtype=torch.int32,
                             device=device)
    used = 0
    for r, n in enumerate(seq_lens):
        blocks = perm[used : used + need[r]]
        used += need[r]
        block_table[r, : need[r]] = blocks.to(torch.int32)
        pos = torch.arange(n, device=device)
        cache[:, blocks[pos // block_size], pos % block_size] = torch.randn(
            2, n, num_kv_heads, head_size, device=device, dtype=dtype
        )
    return cache, block_table


def ref_attention(q, cache, query_start_loc, seq_lens, block_table, scale, window=None,
                  softcap=None):
    """Dense float64 attention per request, keys gathered from the paged cache."""
    q = q.double().cpu()
    cache = cache.double().cpu()
    bt = block_table.cpu().long()
    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for r, n in enumerate(seq_lens):
        qs, qe = query_start_loc[r], query_start_loc[r + 1]
        pos = torch.arange(n)
        k = cache[0][bt[r, pos // block_size], pos % block_size].repeat_interleave(group, 1)
        v = cache[1][bt[r, pos // block_size], pos % block_size].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(n - (qe - qs), n)[:, None]
        visible = pos[None, :] <= qpos
        if window:
            visible &= qpos - pos[None, :] < window
        s = s.masked_fill(~visible, -math.inf)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def _i32(xs):
    return torch.tensor(xs, dtype=torch.int32, device=DEV)


def _close(out, ref, tol):
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_slots_and_skips_padding(dtype):
    num_kv_heads, head_size, block_size = 3, 24, 4  # non-powers of two exercise the masks
    cache = torch.zeros(2, 6, block_size, num_kv_heads, head_size, dtype=dtype, device=DEV)
    qkv = torch.randn(5, 2 + 2 * num_kv_heads, head_size, device=DEV)  # fp32, strided views
    key, value = qkv[:, 2 : 2 + num_kv_heads], qkv[:, 2 + num_kv_heads :]
    slots = torch.tensor([7, -1, 0, 23, 13], dtype=torch.int64, device=DEV)
    store_kv(key, value, cache, slots)
    expect = torch.zeros_like(cache)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[0, s // block_size, s % block_size] = key[t].to(dtype)
            expect[1, s // block_size, s % block_size] = value[t].to(dtype)
    assert torch.equal(cache, expect)


# ----------------------------------------------------------------------------- prefill

PREFILL_CASES = [  # (num_heads, num_kv_heads, head_size, block_size)
    (2, 2, 16, 4),
    (4, 2, 32, 16),
    (8, 2, 64, 4),
    (4, 1, 32, 4),
    (2, 1, 64, 16),
    (3, 3, 48, 16),  # head size padded to 64
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size", PREFILL_CASES)
def test_prefill_fresh_prefix_and_chunked(num_heads, num_kv_heads, head_size, block_size):
    # Request 0: fresh prompt; 1: prefix-cache hit (21 cached, 6 new); 2: chunk continuing
    # after 40 tokens; 3: one-token chunk. Small tiles so several key/query tiles are walked.
    seq_lens, q_lens = [11, 27, 45, 9], [11, 6, 5, 1]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    cache, bt = make_paged(seq_lens, num_kv_heads, head_size, block_size)
    q = torch.randn(qsl[-1], num_heads, head_size, device=DEV)
    scale = head_size**-0.5
    out = paged_prefill_attention(q, cache, _i32(qsl), _i32(seq_lens), bt, max(q_lens), scale,
                                  config=PrefillConfig(block_m=16, block_n=16))
    _close(out, ref_attention(q, cache, qsl, seq_lens, bt, scale), 1e-4)


@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (None, 3.0)])
def test_prefill_sliding_window_and_softcap(window, softcap):
    seq_lens, qsl = [30, 25], [0, 12, 37]  # a 12-token chunk after 18, a 25-token prompt
    cache, bt = make_paged(seq_lens, 2, 32, 4, seed=1)
    q = torch.randn(37, 4, 32, device=DEV)
    out = paged_prefill_attention(q, cache, _i32(qsl), _i32(seq_lens), bt, 25, 0.2, window,
                                  logits_soft_cap=softcap,
                                  config=PrefillConfig(block_m=16, block_n=16))
    _close(out, ref_attention(q, cache, qsl, seq_lens, bt, 0.2, window, softcap), 1e-4)


def test_prefill_half_precision_default_config():
    seq_lens, qsl = [40, 19], [0, 8, 27]
    cache, bt = make_paged(seq_lens, 2, 32, 16, dtype=torch.float16, seed=2)
    q = torch.randn(27, 8, 32, device=DEV, dtype=torch.float16)
    out = paged_prefill_attention(q, cache, _i32(qsl), _i32(seq_lens), bt, 19, 0.18)
    assert out.dtype == torch.float16
    _close(out, ref_attention(q, cache, qsl, seq_lens, bt, 0.18), 1e-2)


# ----------------------------------------------------------------------------- decode

DECODE_CASES = [  # (num_heads, num_kv_heads, head_size, block_size, num_splits)
    (2, 2, 16, 4, 1),
    (4, 2, 32, 16, 3),
    (8, 2, 64, 4, 2),
    (8, 1, 32, 16, None),
    (4, 4, 48, 4, 5),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,block_size,num_splits", DECODE_CASES)
def test_decode_split_and_direct(num_heads, num_kv_heads, head_size, block_size, num_splits):
    seq_lens = [1, 37, 70, 16]
    cache, bt = make_paged(seq_lens, num_kv_heads, head_size, block_size, seed=3)
    q = torch.randn(len(seq_lens), num_heads, head_size, device=DEV)
    out = paged_decode_attention(q, cache, _i32(seq_lens), bt, 0.25, num_splits=num_splits,
                                 config=DecodeConfig(block_n=16))
    _close(out, ref_attention(q, cache, list(range(5)), seq_lens, bt, 0.25), 1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_stores_new_kv(num_splits):
    """new_kv: the kernel writes each request's new K/V at its slot (none for slot -1, a padded
    row) and attends to them, from strided views of a fused qkv output as the model passes."""
    seq_lens = [37, 9, 0]
    num_kv_heads, head_size, block_size = 2, 32, 4
    cache, bt = make_paged([37, 9, 1], num_kv_heads, head_size, block_size, seed=7)
    slots = [int(bt[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
             for r, n in enumerate(seq_lens[:2])] + [-1]
    qkv = torch.randn(3, (4 + 2 * num_kv_heads) * head_size, device=DEV)
    q, k, v = qkv.split([4 * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
    q = q.view(3, 4, head_size)
    k, v = k.view(3, num_kv_heads, head_size), v.view(3, num_kv_heads, head_size)
    want_cache = cache.clone()
    for r in range(2):
        block, offset = divmod(slots[r], block_size)
        want_cache[0, block, offset], want_cache[1, block, offset] = k[r], v[r]
    before = cache.clone()
    out = paged_decode_attention(q, cache, _i32(seq_lens), bt, 0.25, num_splits=num_splits,
                                 config=DecodeConfig(block_n=16),
                                 new_kv=(k, v, torch.tensor(slots, device=DEV)))
    assert torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))
    assert not torch.equal(before.nan_to_num(7.0), cache.nan_to_num(7.0))
    ref = ref_attention(q, want_cache, [0, 1, 2, 3], seq_lens, bt, 0.25)
    _close(out[:2], ref[:2], 1e-4)
    assert torch.equal(out[2].cpu(), torch.zeros(4, head_size))


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rotates_q_and_the_new_key(num_splits, dtype):
    """rotary=(cos, sin): q and the new keys arrive unrotated and the kernel rotates them as
    it loads them: the same output and cache, bit for bit, as ember.kernels.rotary's rotation
    in place and then the kernel (a padded row, slot -1, included)."""
    from ember.kernels.rotary import rotary_inplace

    seq_lens = [37, 9, 0]
    num_kv_heads, head_size, block_size = 2, 32, 4
    cache, bt = make_paged([37, 9, 1], num_kv_heads, head_size, block_size, dtype, seed=3)
    slots = torch.tensor([int(bt[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for r, n in enumerate(seq_lens[:2])] + [-1], device=DEV)
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, (4 + 2 * num_kv_heads) * head_size, generator=gen).to(DEV, dtype)
    angles = torch.rand(3, head_size // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(DEV, dtype), angles.sin().to(DEV, dtype)

    def run(fused: bool):
        cache_now, x = cache.clone(), qkv.clone()
        q, k, v = x.split([4 * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
        q = q.view(3, 4, head_size)
        k, v = k.view(3, num_kv_heads, head_size), v.view(3, num_kv_heads, head_size)
        if not fused:
            rotary_inplace(q, k, cos, sin, head_size)
        out = paged_decode_attention(q, cache_now, _i32(seq_lens), bt, 0.25,
                                     num_splits=num_splits, config=DecodeConfig(block_n=16),
                                     new_kv=(k, v, slots),
                                     rotary=(cos, sin) if fused else None)
        return out, cache_now

    (fused, fused_cache), (plain, plain_cache) = run(True), run(False)
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache.nan_to_num(7.0), plain_cache.nan_to_num(7.0))
    assert not torch.equal(plain_cache.nan_to_num(7.0), cache.nan_to_num(7.0))
    with pytest.raises(ValueError, match="new_kv"):
        paged_decode_attention(qkv[:, :4 * head_size].view(3, 4, head_size), cache,
                               _i32(seq_lens), bt, 0.25, rotary=(cos, sin))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_window_softcap_and_padding_rows(num_splits):
    # seq_len 0 marks a padded graph slot: its output must be finite (zeros), not NaN.
    seq_lens = [50, 0, 9]
    cache, bt = make_paged([50, 1, 9], 2, 32, 4, seed=4)
    q = torch.randn(3, 4, 32, device=DEV)
    out = paged_decode_attention(q, cache, _i32(seq_lens), bt, 0.3, 7, num_splits=num_splits,
                                 logits_soft_cap=2.0, config=DecodeConfig(block_n=16))
    assert torch.equal(out[1].cpu(), torch.zeros(4, 32))
    ref = ref_attention(q, cache, [0, 1, 2, 3], seq_lens, bt, 0.3, 7, 2.0)
    _close(out[[0, 2]], ref[[0, 2]], 1e-4)


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_default_configs_latency_and_split(batch):
    """Without a config the kernel picks its tiles: a split launch of at most one program per SM
    (4 under the interpreter) takes the latency tiles, a larger one the split tiles."""
    seq_lens = [150, 97][:batch]
    cache, bt = make_paged(seq_lens, 2, 64, 16, seed=6)
    q = torch.randn(batch, 8, 64, device=DEV)
    assert default_config(64, split=True, latency=True) != default_config(64, split=True)
    out = paged_decode_attention(q, cache, _i32(seq_lens), bt, 0.2, num_splits=2)
    _close(out, ref_attention(q, cache, list(range(batch + 1)), seq_lens, bt, 0.2), 1e-4)


def test_split_choice_follows_batch_and_lengths():
    """H200-sized choices: unknown lengths (graph capture) split a lone request, but no more
    than graph_max_splits; a known short context is split at most into one-tile pieces; a
    batch that fills the GPU is not split."""
    policy = default_config(128)
    alone = choose_num_splits(1, 8, None, policy, sms=132)
    assert 1 < alone <= policy.graph_max_splits
    short = choose_num_splits(1, 8, 600, policy, sms=132)
    assert 1 < short <= -(-600 // policy.min_split_tokens)
    assert choose_num_splits(1, 8, 32768, policy, sms=132) > policy.graph_max_splits
    assert choose_num_splits(256, 8, None, policy, sms=132) == 1


# ----------------------------------------------------------------------------- backend


MIXED = ([23, 6, 13, 30, 26], [1, 1, 13, 7, 4], 2)  # 2 decodes, fresh prompt, prefix hit, chunk
DECODE_ONLY = ([23, 6, 40], [1, 1, 1], 3)


def _batch(num_heads, num_kv_heads, head_size, block_size, dtype, shape=MIXED, device=DEV):
    """Metadata + inputs for a step (decodes first); the new K/V are not yet in the cache."""
    seq_lens, q_lens, num_decodes = shape
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    cache, bt = make_paged(seq_lens, num_kv_heads, head_size, block_size, dtype, device, seed=5)
    tokens = qsl[-1] + 3  # three padding tokens at the end, as in a graph-padded batch
    slots = torch.full((tokens,), -1, dtype=torch.int64)
    for r, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pos = torch.arange(n - ql, n)
        slots[qsl[r] : qsl[r + 1]] = bt[r, pos // block_size].long().cpu() * block_size + (
            pos % block_size
        )
    q = torch.randn(tokens, num_heads, head_size, device=device, dtype=dtype)
    k = torch.randn(tokens, num_kv_heads, head_size, device=device, dtype=dtype)
    v = torch.randn(tokens, num_kv_heads, head_size, device=device, dtype=dtype)
    meta = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=bt,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        num_decode_tokens=num_decodes,
    )
    return q, k, v, cache, meta


def _expected(q, k, v, cache, meta, num_heads, head_size, scale, window=None):
    """Store the new K/V with plain indexing, then run the dense reference."""
    cache = cache.clone()
    n = meta.num_actual_tokens
    slots = meta.slot_mapping[:n].long()
    bs = cache.shape[2]
    cache[0, slots // bs, slots % bs] = k[:n].to(cache.dtype)
    cache[1, slots // bs, slots % bs] = v[:n].to(cache.dtype)
    ref = ref_attention(q[:n], cache, meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_table,
                        scale, window)
    return ref.view(n, num_heads * head_size), cache


@pytest.mark.parametrize("graph_batch,shape", [(0, MIXED), (8, MIXED), (8, DECODE_ONLY)])
def test_backend_forward(graph_batch, shape, monkeypatch):
    # The decode kernel writes the decode rows' K/V, the store kernel the rest: same cache after.
    monkeypatch.setattr(TritonBackend, "graph_max_batch_size", 0)
    TritonBackend.prepare_graph_capture(graph_batch, 16, DEV)
    assert TritonBackend.name == "triton" and TritonBackend.supports_cuda_graphs
    num_heads, num_kv_heads, head_size = 4, 2, 32
    q, k, v, cache, meta = _batch(num_heads, num_kv_heads, head_size, 4, torch.float32, shape)
    ref, ref_cache = _expected(q, k, v, cache, meta, num_heads, head_size, 0.2)
    impl = TritonBackend.impl_cls()(num_heads, head_size, 0.2, num_kv_heads)
    out = impl.forward(q, k, v, cache, meta)
    assert out.shape == (q.shape[0], num_heads * head_size)
    n = meta.num_actual_tokens
    assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))
    _close(out[:n], ref, 1e-4)


@pytest.mark.parametrize("shape", [MIXED, DECODE_ONLY])
def test_backend_rotates_what_it_is_handed_unrotated(shape, monkeypatch):
    """fuses_rotary: handed rotary=(cos, sin), the backend rotates the decodes in their kernel
    and the rest with the rotary kernel: the same output and cache, bit for bit, as rotating
    q and k first. Partial rotations and non-power-of-two heads are the layer's to do."""
    from ember.kernels.rotary import rotary_inplace

    monkeypatch.setattr(TritonBackend, "graph_max_batch_size", 0)
    num_heads, num_kv_heads, head_size = 4, 2, 32
    q, k, v, cache, meta = _batch(num_heads, num_kv_heads, head_size, 4, torch.float32, shape)
    angles = torch.rand(q.shape[0], head_size // 2, generator=torch.Generator().manual_seed(1))
    cos, sin = (angles * 5).cos().to(DEV), (angles * 5).sin().to(DEV)
    impl = TritonBackend.impl_cls()(num_heads, head_size, 0.2, num_kv_heads)
    assert impl.fuses_rotary(head_size) and not impl.fuses_rotary(head_size // 2)
    assert not TritonBackend.impl_cls()(num_heads, 48, 0.2, num_kv_heads).fuses_rotary(48)
    fused_cache = cache.clone()
    fused = impl.forward(q.clone(), k.clone(), v, fused_cache, meta, rotary=(cos, sin))
    q2, k2 = q.clone(), k.clone()
    rotary_inplace(q2, k2, cos, sin, head_size)
    plain = impl.forward(q2, k2, v, cache, meta)
    n = meta.num_actual_tokens
    assert torch.equal(fused[:n], plain[:n])
    assert torch.equal(fused_cache.nan_to_num(7.0), cache.nan_to_num(7.0))


def test_attention_layer_hands_the_rotation_over(monkeypatch):
    """With KernelConfig(rotary_in_attention=True) the attention layer hands a
    PendingRotation's tables to a backend that fuses it where the rotary kernel would run (here
    the interpreter stands in for CUDA): the same output and cache, bit for bit, as the layer
    rotating first. With a per-head norm first, or the layer kernels off, the layer rotates."""
    import dataclasses

    from ember.kernels import dispatch
    from ember.kernels.config import kernel_config, use_kernel_config
    from ember.kernels.rotary import rotary_inplace
    from ember.layers.attention import Attention, ForwardContext
    from ember.layers.norm import RMSNorm
    from ember.layers.rotary import PendingRotation, RotaryEmbedding

    monkeypatch.setattr(TritonBackend, "graph_max_batch_size", 0)
    monkeypatch.setattr(dispatch, "takes_kernel", lambda x: True)
    num_heads, num_kv_heads, head_size = 4, 2, 32
    q, k, v, cache, meta = _batch(num_heads, num_kv_heads, head_size, 4, torch.float32, MIXED)
    t = q.shape[0]
    rope = RotaryEmbedding(head_size, 10000.0)
    rope.use_kernel = True
    cos, sin = rope.cos_sin(torch.arange(t, device=DEV) + 11, q.dtype)
    with use_kernel_config(dataclasses.replace(kernel_config(), rotary_in_attention=True)):
        layer = Attention(num_heads, head_size, 0.2, num_kv_heads, 0, TritonBackend)
    handed = []
    real = layer.impl.forward
    monkeypatch.setattr(layer.impl, "forward",
                        lambda *a, **kw: (handed.append("rotary" in kw), real(*a, **kw))[1])

    def run(rotation):
        c = cache.clone()
        out = layer(q.reshape(t, -1).clone(), k.reshape(t, -1).clone(), v.reshape(t, -1),
                    ForwardContext(meta, [c]), rotation=rotation)
        return out, c

    fused, fused_cache = run(PendingRotation(rope, cos, sin))
    q_rot, k_rot = q.clone(), k.clone()
    rotary_inplace(q_rot, k_rot, cos, sin, head_size)
    plain_cache = cache.clone()
    plain = layer(q_rot.reshape(t, -1), k_rot.reshape(t, -1), v.reshape(t, -1),
                  ForwardContext(meta, [plain_cache]))
    n = meta.num_actual_tokens
    assert handed == [True, False]
    assert torch.equal(fused[:n], plain[:n])
    assert torch.equal(fused_cache.nan_to_num(7.0), plain_cache.nan_to_num(7.0))
    norms = (RMSNorm(head_size, 1e-6), RMSNorm(head_size, 1e-6))
    run(PendingRotation(rope, cos, sin, norms))
    rope.use_kernel = False
    unfused, _ = run(PendingRotation(rope, cos, sin))
    assert handed == [True, False, False, False]
    torch.testing.assert_close(unfused[:n], plain[:n], rtol=1e-5, atol=1e-5)
    rope.use_kernel = True  # the switch off (the default until measured): the layer rotates
    off = Attention(num_heads, head_size, 0.2, num_kv_heads, 0, TritonBackend)
    assert not off.hands_rotation_over


@pytest.mark.parametrize("shape,want", [(DECODE_ONLY, [None, None]), (MIXED, "lengths")])
def test_decode_splits_do_not_depend_on_graph_capture(shape, want, monkeypatch):
    """Eager decode steps (enforce_eager, or before any capture) pick their splits as graph
    replays do, from the batch alone, so they round alike and give the same tokens; only mixed
    batches, which always run eagerly, use their known lengths."""
    impl_cls = TritonBackend.impl_cls()
    seen = []
    real = impl_cls._decode_splits

    def record(self, batch, max_seq_len, device, cache_itemsize):
        seen.append(max_seq_len)
        return real(self, batch, max_seq_len, device, cache_itemsize)

    monkeypatch.setattr(impl_cls, "_decode_splits", record)
    num_heads, num_kv_heads, head_size = 4, 2, 32
    q, k, v, cache, meta = _batch(num_heads, num_kv_heads, head_size, 4, torch.float32, shape)
    impl = impl_cls(num_heads, head_size, 0.2, num_kv_heads)
    outs = []
    for graph_batch in (0, 8):
        monkeypatch.setattr(TritonBackend, "graph_max_batch_size", graph_batch)
        outs.append(impl.forward(q, k, v, cache.clone(), meta))
    if want == "lengths":
        assert seen == [meta.max_seq_len] * 2
    else:
        assert seen == want
    n = meta.num_actual_tokens
    assert torch.equal(outs[0][:n], outs[1][:n])


@pytest.mark.parametrize("window", [None, 5])
def test_backend_matches_sdpa_reference(window):
    sdpa = pytest.importorskip("ember.attention_backends.sdpa")
    num_heads, num_kv_heads, head_size = 4, 2, 32
    q, k, v, cache, meta = _batch(num_heads, num_kv_heads, head_size, 4, torch.float32)
    cache = cache.nan_to_num(0.0)  # the reference may read whole blocks
    ref_impl = sdpa.SdpaBackend.impl_cls()(num_heads, head_size, 0.2, num_kv_heads, window)
    impl = TritonBackend.impl_cls()(num_heads, head_size, 0.2, num_kv_heads, window)
    n = meta.num_actual_tokens
    exact, _ = _expected(q, k, v, cache, meta, num_heads, head_size, 0.2, window)
    ref = ref_impl.forward(q, k, v, cache.clone(), meta)[:n]
    out = impl.forward(q, k, v, cache, meta)[:n]
    _close(out, exact, 1e-4)  # first against float64, so a failure below points at SDPA
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- GPU, real shapes

gpu = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET,
                         reason="needs a CUDA GPU (compiled Triton)")


def sdpa_reference(q, cache, qsl, seq_lens, bt, scale, window=None):
    """float32 torch SDPA per request on the GPU (fast enough for 32k contexts)."""
    import torch.nn.functional as F

    block_size, num_kv_heads = cache.shape[2], cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r, n in enumerate(seq_lens):
        qs, qe = qsl[r], qsl[r + 1]
        pos = torch.arange(n, device=q.device)
        blocks = bt[r, pos // block_size].long()
        k = cache[0][blocks, pos % block_size].float().repeat_interleave(group, 1)
        v = cache[1][blocks, pos % block_size].float().repeat_interleave(group, 1)
        qpos = torch.arange(n - (qe - qs), n, device=q.device)[:, None]
        mask = pos[None, :] <= qpos
        if window:
            mask &= qpos - pos[None, :] < window
        o = F.scaled_dot_product_attention(q[qs:qe].float().transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[qs:qe] = o.transpose(0, 1)
    return out


def _gpu_close(out, ref):
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 8, 128), (32, 8, 128),
                                                              (64, 8, 128), (16, 4, 64)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_decode_long_context(num_heads, num_kv_heads, head_size, block_size):
    seq_lens = [32768, 4096, 1, 777, 16384, 100, 9000, 2048]
    cache, bt = make_paged(seq_lens, num_kv_heads, head_size, block_size, torch.bfloat16, seed=6)
    q = torch.randn(len(seq_lens), num_heads, head_size, device=DEV, dtype=torch.bfloat16)
    ref = sdpa_reference(q, cache, list(range(9)), seq_lens, bt, head_size**-0.5)
    for splits in (None, 1, 16):
        out = paged_decode_attention(q, cache, _i32(seq_lens), bt, head_size**-0.5,
                                     num_splits=splits, max_seq_len=max(seq_lens))
        _gpu_close(out, ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 8, 128), (32, 8, 128),
                                                              (16, 2, 64)])
@pytest.mark.parametrize("block_size,window", [(16, None), (128, None), (16, 1000)])
def test_gpu_prefill_prefix_and_chunks(num_heads, num_kv_heads, head_size, block_size, window):
    # Fresh 3000-token prompt, prefix hit (8000 cached + 1500 new), 256-token chunk after 20k,
    # and a 1-token chunk.
    seq_lens, q_lens = [3000, 9500, 20256, 513], [3000, 1500, 256, 1]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    cache, bt = make_paged(seq_lens, num_kv_heads, head_size, block_size, torch.bfloat16, seed=7)
    q = torch.randn(qsl[-1], num_heads, head_size, device=DEV, dtype=torch.bfloat16)
    scale = head_size**-0.5
    out = paged_prefill_attention(q, cache, _i32(qsl), _i32(seq_lens), bt, max(q_lens), scale,
                                  window)
    _gpu_close(out, sdpa_reference(q, cache, qsl, seq_lens, bt, scale, window))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_backend_mixed_batch_bf16(block_size):
    num_heads, num_kv_heads, head_size = 32, 8, 128
    q, k, v, cache, meta = _batch(num_heads, num_kv_heads, head_size, block_size,
                                        torch.bfloat16)
    _, ref_cache = _expected(q, k, v, cache, meta, num_heads, head_size, 0.09)
    impl = TritonBackend.impl_cls()(num_heads, head_size, 0.09, num_kv_heads)
    out = impl.forward(q, k, v, cache, meta)
    n = meta.num_actual_tokens
    ref = sdpa_reference(q[:n], ref_cache.nan_to_num(0.0),
                         meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.block_table, 0.09)
    _gpu_close(out[:n].view(n, num_heads, head_size), ref)
