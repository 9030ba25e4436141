"""The fp8 KV cache of the Triton attention kernels (kv_cache_dtype="fp8", per-tensor scales).

Kernel level: store_kv writes K / k_scale and V / v_scale as float8_e4m3fn, saturating; the
decode and prefill kernels reading an fp8 cache equal attention over the cache's dequantized
values (the float64 reference of test_triton_attention). The Triton interpreter converts float8
(checked by these tests running at all on the CPU). Engine level (``gpu``): a bf16 model with an
fp8 cache against the same model with a bf16 cache, printing the logit error; other attention
backends refuse it by name.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from test_triton_attention import _i32, make_paged, ref_attention  # noqa: E402

from ember.kernels.decode_attention import DecodeConfig, paged_decode_attention  # noqa: E402
from ember.kernels.prefill_attention import PrefillConfig, paged_prefill_attention  # noqa: E402
from ember.kernels.store_kv import store_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def _quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(FP8)


def _fp8_paged(seq_lens, num_kv_heads, head_size, block_size, k_scale, v_scale, seed=0):
    """A paged fp8 cache (unused slots NaN) and its dequantized float32 copy."""
    cache, bt = make_paged(seq_lens, num_kv_heads, head_size, block_size, seed=seed)
    cache = cache * 3.0  # values past the fp8 grid's fine steps
    fp8 = torch.stack([_quantize(cache[0], k_scale), _quantize(cache[1], v_scale)])
    deq = torch.stack([fp8[0].float() * k_scale, fp8[1].float() * v_scale])
    return fp8, deq, bt


def test_store_kv_fp8_scales_and_saturates():
    cache = torch.zeros(2, 3, 4, 2, 16, dtype=FP8, device=DEV)
    key = torch.randn(3, 2, 16, device=DEV) * 4
    value = torch.randn(3, 2, 16, device=DEV)
    key[1, 0, 3] = 5000.0  # 5000 / 2 is past e4m3's largest finite value (448)
    slots = torch.tensor([5, -1, 11], dtype=torch.int64, device=DEV)
    store_kv(key, value, cache, slots, k_scale=2.0, v_scale=0.05)
    assert torch.isfinite(cache.float()).all()
    for t, s in ((0, 5), (2, 11)):
        b, o = divmod(s, 4)
        assert torch.equal(cache[0, b, o].float(), _quantize(key[t], 2.0).float())
        assert torch.equal(cache[1, b, o].float(), _quantize(value[t], 0.05).float())
    store_kv(key[1:2], value[1:2], cache, torch.tensor([0], device=DEV), k_scale=2.0)
    assert cache[0, 0, 0, 0, 3].float().item() == 448.0


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_fp8_cache(num_splits):
    seq_lens = [1, 37, 20]
    fp8, deq, bt = _fp8_paged(seq_lens, 2, 32, 4, k_scale=0.5, v_scale=0.25, seed=3)
    q = torch.randn(3, 4, 32, device=DEV)
    out = paged_decode_attention(q, fp8, _i32(seq_lens), bt, 0.2, num_splits=num_splits,
                                 config=DecodeConfig(block_n=16), k_scale=0.5, v_scale=0.25)
    torch.testing.assert_close(out.double().cpu(), ref_attention(q, deq, list(range(4)),
                                                                 seq_lens, bt, 0.2),
                               atol=1e-4, rtol=1e-4)


def test_decode_stores_new_kv_in_fp8():
    seq_lens, block_size = [9, 22], 4
    fp8, deq, bt = _fp8_paged(seq_lens, 2, 32, block_size, k_scale=0.5, v_scale=0.25, seed=4)
    k_new = torch.randn(2, 2, 32, device=DEV) * 2
    v_new = torch.randn(2, 2, 32, device=DEV)
    slots = torch.tensor([int(bt[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for r, n in enumerate(seq_lens)], device=DEV)
    q = torch.randn(2, 4, 32, device=DEV)
    out = paged_decode_attention(q, fp8, _i32(seq_lens), bt, 0.2, num_splits=2,
                                 config=DecodeConfig(block_n=16), new_kv=(k_new, v_new, slots),
                                 k_scale=0.5, v_scale=0.25)
    for r in range(2):
        b, o = divmod(int(slots[r]), block_size)
        assert torch.equal(fp8[0, b, o].float(), _quantize(k_new[r], 0.5).float())
        assert torch.equal(fp8[1, b, o].float(), _quantize(v_new[r], 0.25).float())
        deq[0, b, o] = fp8[0, b, o].float() * 0.5
        deq[1, b, o] = fp8[1, b, o].float() * 0.25
    torch.testing.assert_close(out.double().cpu(), ref_attention(q, deq, [0, 1, 2], seq_lens,
                                                                 bt, 0.2), atol=1e-4, rtol=1e-4)


def test_prefill_reads_fp8_cache():
    seq_lens, qsl = [27, 9], [0, 6, 15]  # a prefix hit (21 cached) and a fresh prompt
    fp8, deq, bt = _fp8_paged(seq_lens, 2, 32, 4, k_scale=0.5, v_scale=2.0, seed=5)
    q = torch.randn(15, 4, 32, device=DEV)
    out = paged_prefill_attention(q, fp8, _i32(qsl), _i32(seq_lens), bt, 9, 0.2,
                                  config=PrefillConfig(block_m=16, block_n=16), k_scale=0.5,
                                  v_scale=2.0)
    torch.testing.assert_close(out.double().cpu(), ref_attention(q, deq, qsl, seq_lens, bt, 0.2),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_16bit_queries_widen_fp8_tiles_to_float16(kernel):
    """bf16 queries over an fp8 cache: the tiles are widened to float16 and the dots run in
    float16 (widen_fp8_to_f16), within bf16's error of attention over the dequantized cache."""
    from ember.kernels.store_kv import widen_fp8_to_f16

    assert widen_fp8_to_f16(FP8, torch.bfloat16) and widen_fp8_to_f16(FP8, torch.float16)
    assert not widen_fp8_to_f16(FP8, torch.float32)
    assert not widen_fp8_to_f16(torch.bfloat16, torch.bfloat16)
    seq_lens = [40, 7]
    fp8, deq, bt = _fp8_paged(seq_lens, 2, 32, 4, k_scale=0.5, v_scale=0.25, seed=7)
    if kernel == "decode":
        q = torch.randn(2, 4, 32, device=DEV).to(torch.bfloat16)
        qsl = [0, 1, 2]
        out = paged_decode_attention(q, fp8, _i32(seq_lens), bt, 0.2, num_splits=2,
                                     config=DecodeConfig(block_n=16), k_scale=0.5, v_scale=0.25)
    else:
        q = torch.randn(47, 4, 32, device=DEV).to(torch.bfloat16)
        qsl = [0, 40, 47]
        out = paged_prefill_attention(q, fp8, _i32(qsl), _i32(seq_lens), bt, 40, 0.2,
                                      config=PrefillConfig(block_m=16, block_n=16), k_scale=0.5,
                                      v_scale=0.25)
    assert out.dtype == torch.bfloat16
    ref = ref_attention(q, deq, qsl if kernel == "prefill" else [0, 1, 2], seq_lens, bt, 0.2)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_fp8_decode_tiles_are_the_same_bytes_a_key():
    """Without splits an fp8 cache's decode tiles are the tables' entry for a 16-bit head of
    half the size (the same bytes a key), falling back to the head's own entry where there is
    none; split launches keep the head's own."""
    from ember.kernels.decode_attention import default_config
    from ember.kernels.tuning import DeviceTuning

    tables = {64: DecodeConfig(block_n=128), 128: DecodeConfig(block_n=64)}
    tuning = DeviceTuning(decode=tables, decode_split=tables, decode_latency=tables, prefill={},
                          small_batch_linear=())
    assert default_config(128, tuning=tuning).block_n == 64
    assert default_config(128, tuning=tuning, cache_itemsize=1).block_n == 128
    assert default_config(64, tuning=tuning, cache_itemsize=1).block_n == 128  # no 32 entry
    assert default_config(128, split=True, tuning=tuning, cache_itemsize=1).block_n == 64


@pytest.mark.gpu
def test_fp8_kernels_bf16_long_context():
    """bf16 queries over an fp8 cache at a real shape (GQA 32/8, head 128, 4k context)."""
    seq_lens = [4096, 1000, 17]
    fp8, deq, bt = _fp8_paged(seq_lens, 8, 128, 16, k_scale=0.25, v_scale=0.25, seed=6)
    q = torch.randn(3, 32, 128, device=DEV, dtype=torch.bfloat16)
    out = paged_decode_attention(q, fp8, _i32(seq_lens), bt, 128**-0.5, k_scale=0.25,
                                 v_scale=0.25)
    ref = ref_attention(q, deq, [0, 1, 2, 3], seq_lens, bt, 128**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    qp = torch.randn(sum(seq_lens), 32, 128, device=DEV, dtype=torch.bfloat16)
    qsl = [0, 4096, 5096, 5113]
    out = paged_prefill_attention(qp, fp8, _i32(qsl), _i32(seq_lens), bt, 4096, 128**-0.5,
                                  k_scale=0.25, v_scale=0.25)
    ref = ref_attention(qp, deq, qsl, seq_lens, bt, 128**-0.5)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
