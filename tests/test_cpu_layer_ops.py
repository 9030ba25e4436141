"""The native CPU layer ops (ember.kernels.cpu.layer_ops) against the torch ops they replace:
rotary bit for bit, the rest to float32 rounding; the layers take them on CPU float32 tensors
and keep the torch ops with KernelConfig(cpu_layers=False)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.attention_backends.base import AttentionMetadata
from ember.attention_backends.sdpa import SdpaBackend
from ember.kernels import KernelConfig, use_kernel_config
from ember.kernels.cpu import layer_ops
from ember.layers.activation import SiluAndMul
from ember.layers.norm import RMSNorm
from ember.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(layer_ops.library() is None, reason="no C compiler")


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-6) -> None:
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("shape", [(1, 64), (17, 576), (3, 5, 96)])
def test_rms_norm_matches_hf_ops_and_adds_the_residual_in_place(shape):
    weight = torch.randn(shape[-1])
    x = torch.randn(*shape) * 5
    hf = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    _close(layer_ops.rms_norm(x.clone(), weight, 1e-6), hf)
    branch, residual = torch.randn(*shape), torch.randn(*shape)
    h = branch + residual
    want = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = layer_ops.rms_norm(branch, weight, 1e-6, residual)
    _close(out, want)
    assert torch.equal(branch, h)  # the residual stream, written in place as add_ does


def test_rms_norm_layer_takes_the_native_op_unless_configured_off():
    x, residual = torch.randn(4, 64), torch.randn(4, 64)
    native = RMSNorm(64, 1e-5)
    with use_kernel_config(KernelConfig(cpu_layers=False)):
        plain = RMSNorm(64, 1e-5)
    assert native.use_cpu_ops and not plain.use_cpu_ops
    _close(native(x), plain(x))
    a, ra = native.forward_with_residual(x.clone(), residual)
    b, rb = plain.forward_with_residual(x.clone(), residual)
    _close(a, b)
    assert torch.equal(ra, rb)
    # The heads of q in a fused qkv output (Qwen3's per-head norm): tokens strided, heads not.
    qkv = torch.randn(5, (4 + 2 * 2) * 64)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    assert layer_ops.rows_of(q) is None and layer_ops.norm_rows(q) == (64, 4, qkv.stride(0))
    _close(native(q), plain(q))
    # Every other head (two strides) is rows too; every other element is not, and goes to the
    # torch ops, with the same result.
    every_other = torch.randn(4, 3, 64)[:, ::2]
    assert layer_ops.norm_rows(every_other) == (128, 2, 192)
    _close(native(every_other), plain(every_other))
    strided = torch.randn(4, 128)[:, ::2]
    assert layer_ops.norm_rows(strided) is None
    _close(native(strided), plain(strided))


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_in_place_is_bit_identical_to_the_torch_ops(rotary_dim):
    rope = RotaryEmbedding(64, 10000.0, rotary_dim=rotary_dim)
    t, hq, hk = 5, 9, 3
    qkv = torch.randn(t, (hq + 2 * hk) * 64)
    q, k, v = qkv.split([hq * 64, hk * 64, hk * 64], dim=-1)
    q, k = q.view(t, hq, 64), k.view(t, hk, 64)
    cos, sin = rope.cos_sin(torch.arange(100, 100 + t), torch.float32)
    want_q, want_k, v_before = rope.apply(q, cos, sin), rope.apply(k, cos, sin), v.clone()
    got_q, got_k = rope.apply_qk(q, k, cos, sin)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(v, v_before)


def test_cos_sin_matches_torch_to_rounding():
    for scaling in (1.0, 1.19):
        rope = RotaryEmbedding(64, 500000.0, attention_scaling=scaling)
        positions = torch.tensor([0, 1, 7, 4095, 131071])
        cos, sin = rope.cos_sin(positions, torch.float32)
        with use_kernel_config(KernelConfig(cpu_layers=False)):
            plain = RotaryEmbedding(64, 500000.0, attention_scaling=scaling)
        want_cos, want_sin = plain.cos_sin(positions, torch.float32)
        assert cos.shape == want_cos.shape == (5, 1, 32)
        _close(cos, want_cos, 1e-6)
        _close(sin, want_sin, 1e-6)


def test_silu_and_mul_matches_torch():
    x = torch.randn(7, 2 * 300) * 6
    want = F.silu(x[:, :300]) * x[:, 300:]
    _close(layer_ops.silu_and_mul(x), want)
    _close(SiluAndMul()(x), want)


def test_embedding_gathers_rows_and_zeroes_out_of_range_ids():
    weight = torch.randn(50, 24)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(layer_ops.embedding(ids, weight), F.embedding(ids, weight))
    out = layer_ops.embedding(torch.tensor([50, -1]), weight)
    assert torch.equal(out, torch.zeros(2, 24))


def _reference_decode(q, cache, table, seq_lens, scale, window, cap):
    kvh, d = cache.shape[3], cache.shape[4]
    group = q.shape[1] // kvh
    out = torch.zeros(q.shape[0], q.shape[1] * d)
    for r, seq in enumerate(seq_lens.tolist()):
        if seq == 0:
            continue
        ids = table[r].long()
        k = cache[0][ids].reshape(-1, kvh, d)[:seq]
        v = cache[1][ids].reshape(-1, kvh, d)[:seq]
        start = max(0, seq - window) if window else 0
        k = k[start:].repeat_interleave(group, 1).transpose(0, 1)
        v = v[start:].repeat_interleave(group, 1).transpose(0, 1)
        s = (q[r][:, None] @ k.transpose(1, 2))[:, 0] * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        out[r] = (s.softmax(-1)[:, None] @ v).reshape(-1)
    return out


@pytest.mark.parametrize("window,cap", [(None, None), (20, None), (None, 30.0)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("d", [64, 24])  # 16 keys reduced together (AVX-512), or one by one
def test_decode_attention_reads_the_paged_cache_directly(window, cap, threads, d):
    torch.manual_seed(0)
    bs, nb, kvh, hq = 16, 40, 3, 9
    cache = torch.randn(2, nb, bs, kvh, d)
    seq_lens = torch.tensor([37, 1, 100, 0, 64], dtype=torch.int32)
    table = torch.randperm(nb)[:40].view(5, 8).int()
    q = torch.randn(5, hq, d)
    out = torch.full((5, hq * d), float("nan"))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer_ops.decode_attention(q, cache, table, seq_lens, out, 0.125, window, cap)
    finally:
        torch.set_num_threads(previous)
    _close(out, _reference_decode(q, cache, table, seq_lens, 0.125, window, cap), 1e-5)


def test_store_kv_writes_the_slots_and_skips_padding():
    cache = torch.randn(2, 4, 8, 2, 16)
    before = cache.clone()
    kv = torch.randn(3, 6 * 16)  # a fused output: key and value are strided views
    key, value = kv[:, 2 * 16:4 * 16].view(3, 2, 16), kv[:, 4 * 16:].view(3, 2, 16)
    slots = torch.tensor([5, -1, 17])
    layer_ops.store_kv(key, value, cache, slots)
    flat, old = cache.view(2, -1, 2, 16), before.view(2, -1, 2, 16)
    assert torch.equal(flat[0, 5], key[0]) and torch.equal(flat[1, 17], value[2])
    changed = (flat != old).flatten(2).any(-1).any(0)
    assert changed.nonzero().flatten().tolist() == [5, 17]


def _metadata(seq_lens: list[int], query_lens: list[int], table: torch.Tensor,
              slots: list[int], num_decode: int) -> AttentionMetadata:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return SdpaBackend.build_metadata(AttentionMetadata(
        num_actual_tokens=qsl[-1], slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens, num_decode_tokens=num_decode))


def test_sdpa_backend_native_path_equals_its_torch_path():
    """A step with two decodes and a prefill chunk: output and cache as the torch path's."""
    torch.manual_seed(1)
    bs, kvh, hq, d = 16, 2, 4, 32
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    cache = torch.randn(2, 9, bs, kvh, d)
    seq_lens, query_lens = [20, 33, 40], [1, 1, 8]
    slots = [19, 3 * bs + 32, 6 * bs + 32, *(6 * bs + 33 + i for i in range(7))]
    n = len(slots)
    qkv = torch.randn(n, (hq + 2 * kvh) * d)
    q, k, v = qkv.split([hq * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, kvh, d), v.view(n, kvh, d)
    native = SdpaBackend.impl_cls()(hq, d, d**-0.5, kvh, sliding_window=24)
    with use_kernel_config(KernelConfig(cpu_layers=False)):
        plain = SdpaBackend.impl_cls()(hq, d, d**-0.5, kvh, sliding_window=24)
    assert native.use_cpu_ops and not plain.use_cpu_ops
    native_cache, plain_cache = cache.clone(), cache.clone()
    got = native.forward(q, k, v, native_cache, _metadata(seq_lens, query_lens, table, slots, 2))
    want = plain.forward(q, k, v, plain_cache, _metadata(seq_lens, query_lens, table, slots, 2))
    assert torch.equal(native_cache, plain_cache)
    _close(got, want, 1e-5)
