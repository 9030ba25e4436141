"""ember's Triton kernels compiled for sm90 (Hopper) with the arguments their own launch
wrappers pass, on a machine without a GPU.

Interpreter tests run the kernels' arithmetic but not the compiler, and a compile test that
writes a kernel's signature by hand can differ from what the launch passes: a one-split launch
hands its output tensor in as the K-split merge's counters, and atomics compiled on it (bf16)
broke every small-batch linear launch on the GPU while every CPU test passed. Here each wrapper
runs on CPU tensors with its kernel replaced by a recorder, with the launch choices a GPU would
make, and triton compiles the recorded launch for sm90 (``sm90_launch.compile_as_launched``).
Run in a fresh interpreter: this process may have TRITON_INTERPRET set.
"""

from __future__ import annotations

import pytest
from conftest import run_sm90_script

_SCRIPT = r'''
import torch
from sm90_launch import compile_as_launched

from ember.kernels import (argmax, decode_attention, decode_merge, fp8_gemv, fp8_quant,
                           gguf_matmul, int4_dequant, int4_gemv, int8_act, l2_prefetch, rms_norm,
                           rotary, silu_and_mul, small_batch_linear, store_kv)

torch.manual_seed(0)
bf = torch.bfloat16
k, n, group = 1024, 512, 128
x = torch.randn(1, k).to(bf)
w = torch.randn(n, k).to(bf)
qweight = torch.randint(0, 2**31 - 1, (n, k // 8), dtype=torch.int32)
qzeros = torch.randint(0, 2**31 - 1, (k // group, n // 8), dtype=torch.int32)
scales = torch.rand(k // group, n).to(bf)
w8 = torch.randn(n, k).to(torch.float8_e4m3fn)
w_scale = torch.rand(n)
x8, x_scale = x.to(torch.float8_e4m3fn), torch.rand(1, 1)
rows = torch.randn(4, 4096).to(bf)
norm_w = torch.rand(4096).to(bf)
gate_up = torch.randn(4, 2 * 14336).to(bf)
q, kk = torch.randn(4, 32, 128).to(bf), torch.randn(4, 8, 128).to(bf)
cos, sin = torch.rand(4, 64).to(bf), torch.rand(4, 64).to(bf)
head_w = torch.rand(128).to(bf)
cache = torch.zeros(2, 8, 16, 8, 128, dtype=bf)
slots = torch.tensor([0, 5, 17, -1])
logits = torch.randn(4, 49152)
bitmask = torch.randint(-2**31, 2**31 - 1, (2, 49152 // 32), dtype=torch.int32)


class Skipped:  # a kernel not compiled here: its launches do nothing
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def merge_int8():
    """paged_decode_attention with int8 output, its first kernel skipped (its own case
    elsewhere): the launch of the split merge."""
    saved, decode_attention._decode_kernel = decode_attention._decode_kernel, Skipped()
    try:
        decode_attention.paged_decode_attention(
            q, cache, torch.tensor([20, 9, 0, 32], dtype=torch.int32),
            torch.arange(8, dtype=torch.int32).view(4, 2), 0.1, num_splits=2,
            int8_out=int8_act.empty_int8_rows(4, 32 * 128, q.device))
    finally:
        decode_attention._decode_kernel = saved


cases = []
for split in (1, 4):  # unsplit launches pass their output as the merge's buffers
    cases += [
        (small_batch_linear, "_small_batch_linear_kernel",
         lambda split=split: small_batch_linear.small_batch_linear(x, w, config=(32, 256, split))),
        (int4_gemv, "_int4_gemv_kernel",
         lambda split=split: int4_gemv.int4_gemv(x, qweight, qzeros, scales, group,
                                                 config=(16, 128, split, 4, 1))),
        (int4_gemv, "_int4_gemv_kernel",  # float16 x: pairs converted, not loaded
         lambda split=split: int4_gemv.int4_gemv(x.half(), qweight, qzeros, scales.half(), group,
                                                 config=(16, 128, split, 4, 1))),
        (fp8_gemv, "_fp8_gemv_kernel",
         lambda split=split: fp8_gemv.fp8_gemv(x, w8, w_scale, config=(64, 256, split, 4, 4))),
        (fp8_gemv, "_fp8_gemv_kernel",
         lambda split=split: fp8_gemv.fp8_gemv(x8, w8, w_scale, config=(64, 256, split, 4, 4),
                                               x_scale=x_scale)),
    ]
codes4 = gguf_matmul.pack_nibbles(torch.randint(0, 16, (n, k), dtype=torch.uint8))
codes8 = torch.randint(0, 256, (n, k), dtype=torch.uint8)
gscale, gmin = torch.rand(n, k // 32), torch.rand(n, k // 32)
cases += [
    (int4_gemv, "_int4_gemv_kernel",  # the tuned tiles (16 x 1,024)
     lambda: int4_gemv.int4_gemv(x, qweight, qzeros, scales, group)),
    (int4_dequant, "_int4_dequantize_kernel",
     lambda: int4_dequant.int4_dequantize(qweight, qzeros, scales, group, bf)),
    (gguf_matmul, "_gguf_matmul_kernel",  # Q4_1's codes: 4-bit with a minimum
     lambda: gguf_matmul.gguf_matmul(x, codes4, gscale, gmin, offset=0, group=32, bits=4, n=n,
                                     k=k)),
    (gguf_matmul, "_gguf_matmul_kernel",  # Q8_0's: 8-bit, offset 128
     lambda: gguf_matmul.gguf_matmul(torch.randn(64, k).to(bf), codes8, gscale, None,
                                     offset=128, group=32, bits=8, n=n, k=k)),
    (rms_norm, "_rms_norm_kernel", lambda: rms_norm.rms_norm(rows, norm_w, 1e-6)),
    (rms_norm, "_rms_norm_kernel", lambda: rms_norm.fused_add_rms_norm(rows, rows, norm_w, 1e-6)),
    (rms_norm, "_rms_norm_kernel", lambda: rms_norm.rms_norm_fp8(rows, norm_w, 1e-6, rows)),
    (rms_norm, "_rms_norm_kernel", lambda: rms_norm.rms_norm(q, head_w, 1e-6)),
    (silu_and_mul, "_silu_and_mul_kernel", lambda: silu_and_mul.silu_and_mul(gate_up)),
    (silu_and_mul, "_silu_and_mul_fp8_kernel", lambda: silu_and_mul.silu_and_mul_fp8(gate_up)),
    (silu_and_mul, "_silu_and_mul_fp8_kernel",
     lambda: silu_and_mul.silu_and_mul_fp8(torch.randn(2, 40000).to(bf))),  # two passes
    (silu_and_mul, "_silu_and_mul_fp8_kernel",  # a scale per 1024 columns
     lambda: silu_and_mul.silu_and_mul_fp8(gate_up, 1024)),
    (fp8_gemv, "_fp8_gemv_kernel",  # x scaled per 1024 columns
     lambda: fp8_gemv.fp8_gemv(x8, w8, w_scale, config=(64, 512, 2, 4, 4),
                               x_scale=torch.rand(1, k // 1024))),
    (fp8_quant, "_per_token_fp8_kernel", lambda: fp8_quant.per_token_fp8(rows)),
    (rms_norm, "_rms_norm_int8_kernel",
     lambda: rms_norm.rms_norm_int8(rows, norm_w, 1e-6, rows)),
    (silu_and_mul, "_silu_and_mul_int8_kernel", lambda: silu_and_mul.silu_and_mul_int8(gate_up)),
    (int8_act, "_quantize_int8_kernel", lambda: int8_act.quantize_int8(rows)),
    (decode_merge, "_reduce_kernel", merge_int8),  # the split merge writing int8 rows
    (decode_attention, "_decode_kernel",  # rotating q and the new key as it loads them
     lambda: decode_attention.paged_decode_attention(
         q, cache, torch.tensor([20, 9, 0, 32], dtype=torch.int32),
         torch.arange(8, dtype=torch.int32).view(4, 2), 0.1, num_splits=1,
         new_kv=(kk, kk, slots), rotary=(cos, sin))),
    (l2_prefetch, "_l2_prefetch_kernel",
     lambda: l2_prefetch.prefetch_l2([qweight, scales, qzeros])),
    (rotary, "_rotary_kernel", lambda: rotary.rotary_inplace(q, kk, cos, sin, 128)),
    (rotary, "_rotary_kernel",
     lambda: rotary.rotary_inplace(q, kk, cos, sin, 128, (head_w, head_w), 1e-6)),
    (store_kv, "_store_kv_kernel", lambda: store_kv.store_kv(kk, kk, cache, slots)),
    (store_kv, "_store_kv_kernel",
     lambda: store_kv.store_kv(kk, kk, cache.to(torch.float8_e4m3fn), slots, 2.0, 0.5)),
    (argmax, "_argmax_kernel", lambda: argmax.argmax_rows(logits)),
    (argmax, "_argmax_kernel",
     lambda: argmax.argmax_rows(logits, bitmask, torch.tensor([0, -1, 1, 0], dtype=torch.int32))),
]
splits = [consts.get("SPLIT_K") for case in cases
          for consts, _ in compile_as_launched(*case)]
assert splits[:10] == [1] * 5 + [4] * 5, splits  # each split count as the case asked
print("compiled", len(splits))
'''


@pytest.mark.slow
def test_kernels_compile_for_sm90_as_launched():
    proc = run_sm90_script(_SCRIPT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("compiled 36"), proc.stdout[-2000:]
