"""int8 activations (ember.kernels.int8_act) and the 4-bit layers' integer GEMV
(ember.kernels.w4a8_gemv) against torch references.

The activation form is checked against a torch quantizer written from its documented rules and
against the packs' bit layout (each byte of a pack's masked nibbles meets x's byte of the same
row). The GEMV's integer dots are exact, so it must equal the float product of the dequantized
int8 rows and the dequantized 4-bit weight up to float32 rounding. The producers (RMSNorm,
SiLU-and-mul) must write what the standalone quantizer makes of their half-precision output.
Without CUDA the kernels run under TRITON_INTERPRET=1 (dp4a from its bytes); the ``gpu`` cases
run Llama-3.1-8B's projection shapes compiled, with inline PTX dp4a.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ember.kernels.int8_act import (  # noqa: E402
    GROUP,
    PACKS_ORDER,
    dequantize_int8_reference,
    quantize_int8,
    quantize_int8_reference,
)
from ember.kernels.rms_norm import fused_add_rms_norm, rms_norm, rms_norm_int8  # noqa: E402
from ember.kernels.silu_and_mul import silu_and_mul, silu_and_mul_int8  # noqa: E402
from ember.kernels.w4a8_gemv import MAX_ROWS, w4a8_gemv  # noqa: E402
from ember.quantization.int4_common import (  # noqa: E402
    dequantize_int4,
    pack_weight,
    quantize_int4,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEV == "cuda"


def _assert_quantized_equal(got, want):
    """Equal int8 forms: on the interpreter bit for bit; compiled, the division may round a
    value half a step the other way (q off by one, its sums by one step)."""
    q, scales, sums = got
    wq, wscales, wsums = (t.to(q.device) for t in want)
    torch.testing.assert_close(scales, wscales, rtol=1e-6, atol=0)
    if ON_GPU:
        assert (q.int() - wq.int()).abs().max().item() <= 1
        torch.testing.assert_close(sums, wsums, rtol=0, atol=float(2 * wscales.max()))
    else:
        assert torch.equal(q, wq)
        torch.testing.assert_close(sums, wsums, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows,k", [(1, 128), (3, 384), (2, 2048 + 256)])
def test_quantize_int8_matches_the_reference(rows, k):
    x = torch.randn(rows, k, dtype=torch.bfloat16) * torch.linspace(0.1, 8, k).to(torch.bfloat16)
    x[0, :GROUP] = 0  # a group of zeros: scale 0, q 0, no NaN
    got = quantize_int8(x.to(DEV))
    want = quantize_int8_reference(x)
    _assert_quantized_equal(got, want)
    q, scales, sums = got
    assert scales[0, 0].item() == 0 and not q[0, :GROUP].any()
    assert int(q.abs().max()) <= 127
    # Every value within half a step of its group's scale.
    err = (dequantize_int8_reference(q.cpu(), scales.cpu()) - x.float()).abs()
    step = scales.cpu().repeat_interleave(GROUP, dim=1)
    assert (err <= step * 0.5 + 1e-6).all()


def test_stored_order_lines_up_with_the_pack_nibbles():
    """Byte b of a pack's nibbles masked with 0x0F0F0F0F (and of the pack shifted by 4) is the
    row stored at x's byte b (and b + 4): the ember pack order (row 2s at bit 4s, 2s + 1 at
    16 + 4s) read four bytes at a time."""
    bit_of_row = [(j % 2) * 16 + (j // 2) * 4 for j in range(8)]
    for position, row in enumerate(PACKS_ORDER):
        word, byte = divmod(position, 4)
        assert bit_of_row[row] == 8 * byte + 4 * word


def _weight(k, n, group, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=gen) / k**0.5
    weight = pack_weight(*quantize_int4(w, group), k if group == -1 else group)
    return weight, dequantize_int4(weight)


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("k,n,group,config", [
    (512, 96, 128, (16, 128, 2, 4, 1, False)),  # K split in two, a partial column tile
    (256, 64, 64, (32, 256, 1, 4, 1, True)),  # two weight groups in an x group
    (384, 40, -1, (8, 128, 1, 2, 1, False)),  # one weight group over K
    (256, 48, 32, (16, 64, 2, 4, 1, False)),
])
def test_w4a8_gemv_matches_the_dequantized_product(rows, k, n, group, config):
    weight, deq = _weight(k, n, group, seed=rows)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    q, scales, sums = quantize_int8_reference(x)
    bias = torch.randn(n, dtype=torch.bfloat16)
    got = w4a8_gemv(q.to(DEV), scales.to(DEV), sums.to(DEV), weight.qweight.to(DEV),
                    weight.qzeros.to(DEV), weight.scales.to(DEV), weight.group_size,
                    torch.float32, bias.to(DEV), config=config)
    want = dequantize_int8_reference(q, scales) @ deq + bias.float()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_w4a8_gemv_rows_are_their_one_row_results():
    """A row's result does not depend on the rows beside it."""
    weight, _ = _weight(256, 64, 128)
    q, scales, sums = (t.to(DEV) for t in quantize_int8_reference(torch.randn(3, 256)))
    args = (weight.qweight.to(DEV), weight.qzeros.to(DEV), weight.scales.to(DEV), 128,
            torch.float32)
    config = (32, 128, 1, 4, 1, False)
    both = w4a8_gemv(q, scales, sums, *args, config=config)
    for r in range(3):
        one = w4a8_gemv(q[r:r + 1].contiguous(), scales[r:r + 1].contiguous(),
                        sums[r:r + 1].contiguous(), *args, config=config)
        assert torch.equal(both[r:r + 1], one)


@pytest.mark.parametrize("n", [256, 384, 2432])  # 2,432: three programs, the last partial
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_int8_writes_the_norm_quantized(n, residual):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen).to(DEV, torch.bfloat16)
    r = torch.randn(3, n, generator=gen).to(DEV, torch.bfloat16) if residual else None
    w = (1 + torch.randn(n, generator=gen) / 4).to(DEV, torch.bfloat16)
    q, scales, sums, h = rms_norm_int8(x, w, 1e-6, r)
    if residual:
        y, h_want = fused_add_rms_norm(x, r, w, 1e-6)
        assert torch.equal(h, h_want)
    else:
        y = rms_norm(x, w, 1e-6)
        assert h is None
    _assert_quantized_equal((q, scales, sums), quantize_int8_reference(y.cpu()))


@pytest.mark.parametrize("d", [256, 1152])
def test_silu_and_mul_int8_writes_the_product_quantized(d):
    x = (torch.randn(2, 2 * d) * 3).to(DEV, torch.bfloat16)
    got = silu_and_mul_int8(x)
    _assert_quantized_equal(got, quantize_int8_reference(silu_and_mul(x).cpu()))


def _paged_decode_inputs(seq_lens, num_heads, num_kv_heads, head_size, dtype, block_size=16):
    """q [batch, heads, head_size] and a paged cache holding each request's context (block
    table: each request's blocks in a row)."""
    gen = torch.Generator().manual_seed(len(seq_lens))
    per = max(1, -(-max(seq_lens) // block_size))
    cache = torch.randn(2, per * len(seq_lens), block_size, num_kv_heads, head_size,
                       generator=gen).to(DEV, dtype)
    table = torch.arange(per * len(seq_lens), dtype=torch.int32).view(len(seq_lens), per)
    q = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(DEV, dtype)
    return q, cache, table.to(DEV)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_attention_writes_its_output_quantized(num_splits):
    """int8_out: the split merge writes each head as one int8 group, what quantize_int8 makes
    of the half-precision output (a padded row, seq_len 0, as zeros)."""
    from ember.kernels.decode_attention import paged_decode_attention
    from ember.kernels.int8_act import empty_int8_rows

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    seq_lens = torch.tensor([37, 0, 70], dtype=torch.int32, device=DEV)
    q, cache, table = _paged_decode_inputs([37, 0, 70], 4, 2, GROUP, dtype)
    plain = paged_decode_attention(q, cache, seq_lens, table, 0.1, num_splits=num_splits)
    quantized = empty_int8_rows(3, 4 * GROUP, DEV)
    paged_decode_attention(q, cache, seq_lens, table, 0.1, num_splits=num_splits,
                           int8_out=quantized)
    _assert_quantized_equal(quantized, quantize_int8_reference(plain.reshape(3, -1).cpu()))
    assert not quantized[0][1].any() and not quantized[1][1].any()
    with pytest.raises(ValueError, match="split launches"):
        paged_decode_attention(q, cache, seq_lens, table, 0.1, num_splits=1,
                               int8_out=quantized)


def test_triton_backend_writes_int8_for_a_decode_step(monkeypatch):
    """TritonImpl: int8 output where a 4-bit o_proj asks (heads of 128, a decode-only step),
    half precision otherwise (a prefill in the step; heads of 64); the attention layer hands
    the int8 tensors on as a QuantizedActivation when the layer after asks for int8."""
    from ember.attention_backends.base import AttentionMetadata
    from ember.attention_backends.triton_backend import TritonBackend
    from ember.kernels import dispatch
    from ember.layers.attention import Attention, ForwardContext
    from ember.layers.linear import QuantizedActivation

    dtype = torch.bfloat16 if ON_GPU else torch.float32
    impl = TritonBackend.impl_cls()(4, GROUP, 0.1, 2)
    assert impl.writes_quantized(torch.int8) and not impl.writes_quantized(torch.float8_e4m3fn)
    assert not TritonBackend.impl_cls()(4, 64, 0.1, 2).writes_quantized(torch.int8)
    q, cache, table = _paged_decode_inputs([37, 70], 4, 2, GROUP, dtype)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, 2, GROUP, generator=gen).to(DEV, dtype) for _ in range(2))

    def step(prefill: bool):
        """Both requests' next token: two decodes, or a decode and a one-token prefill chunk."""
        lens, qsl = [37, 70], [0, 1, 2]
        slots = [int(table[r, (n - 1) // 16]) * 16 + (n - 1) % 16 for r, n in enumerate(lens)]
        return AttentionMetadata(
            num_actual_tokens=2, slot_mapping=torch.tensor(slots, device=DEV),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV), block_table=table,
            max_query_len=1, max_seq_len=70, query_start_loc_cpu=qsl, seq_lens_cpu=lens,
            num_decode_tokens=1 if prefill else 2)

    plain = impl.forward(q, k, v, cache.clone(), step(False))
    got = impl.forward(q, k, v, cache.clone(), step(False), quantize=torch.int8)
    assert isinstance(got, tuple) and got[0].dtype == torch.int8
    _assert_quantized_equal(got, quantize_int8_reference(plain.cpu()))
    mixed = impl.forward(q, k, v, cache.clone(), step(True), quantize=torch.int8)
    assert isinstance(mixed, torch.Tensor)
    tol = 2e-2 if ON_GPU else 1e-4
    torch.testing.assert_close(mixed, plain, atol=tol, rtol=tol)

    class Int8Layer:  # a layer after attention that asks for int8 rows
        def quantized_input_dtype(self, x):
            return torch.int8

    monkeypatch.setattr(dispatch, "on_gpu", lambda x: True)  # the interpreter stands in
    layer = Attention(4, GROUP, 0.1, 2, 0, TritonBackend)
    flat = (q.reshape(2, -1), k.reshape(2, -1), v.reshape(2, -1))
    wrapped = layer(*flat, ForwardContext(step(False), [cache.clone()]), quant_for=Int8Layer())
    assert isinstance(wrapped, QuantizedActivation)
    _assert_quantized_equal(tuple(wrapped), quantize_int8_reference(plain.cpu()))
    assert isinstance(layer(*flat, ForwardContext(step(False), [cache.clone()])), torch.Tensor)


LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("shape", list(LLAMA8B))
def test_w4a8_gemv_at_llama8b_shapes_on_cuda(shape):
    """The tuned tiles, compiled with inline-PTX dp4a, against the float reference (1-4
    rows)."""
    n, k = LLAMA8B[shape]
    weight, deq = _weight(k, n, 128)
    deq = deq.cuda()
    args = (weight.qweight.cuda(), weight.qzeros.cuda(), weight.scales.half().cuda(), 128,
            torch.bfloat16)
    for rows in range(1, MAX_ROWS + 1):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        q, scales, sums = quantize_int8(x)
        got = w4a8_gemv(q, scales, sums, *args)
        want = dequantize_int8_reference(q.cpu(), scales.cpu()).cuda() @ deq
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, f"{shape} rows={rows}: error {err}"
        # Against the unquantized activations: the 8-bit rounding's cost.
        exact = x.float() @ deq
        err_x = ((got.float() - exact).abs().max() / exact.abs().max()).item()
        assert err_x < 3e-2, f"{shape} rows={rows}: error against bf16 x {err_x}"


@pytest.mark.skipif(ON_GPU, reason="the gpu cases cover CUDA")
@pytest.mark.parametrize("group", [128, 64])
def test_awq_layer_takes_int8_rows_on_the_interpreter(group, monkeypatch):
    """With KernelConfig(int4_int8_activations=True), the default, a 4-bit layer asks for int8
    rows at 1-2 half-precision rows (not 3, not float32; with the switch off, never), and given
    them (as a producer writes them: ember.testing's check hands them over) computes through
    w4a8_gemv within the bf16 bound of x @ dequantized.T."""
    import dataclasses
    from functools import partial

    from ember.kernels import w4a8_gemv as w4a8_module
    from ember.kernels.config import kernel_config, use_kernel_config
    from ember.quantization import int4_linear
    from ember.testing import check_quantized_linear
    from ember.testing.quantized_checkpoints import awq_tensors

    monkeypatch.setattr(int4_linear, "_kernels_take", lambda x: True)
    launched = []
    real = w4a8_module.w4a8_gemv

    def spy(xq, *args, **kwargs):
        launched.append(xq.shape[0])
        return real(xq, *args, **kwargs)

    monkeypatch.setattr(w4a8_module, "w4a8_gemv", spy)
    with use_kernel_config(dataclasses.replace(kernel_config(), int4_int8_activations=True)):
        check_quantized_linear("awq", partial(awq_tensors, group_size=group),
                               config={"group_size": group}, shapes=(([64, 32], 256),),
                               batch_sizes=(1, 2, 3), dtypes=("bfloat16", "float16"))
        method = int4_linear.Int4LinearMethod(group)
        layer = type("L", (), {"in_features": 256})()
        assert method.quantized_input_dtype(layer, torch.zeros(2, 256).half()) == torch.int8
        assert method.quantized_input_dtype(layer, torch.zeros(3, 256).half()) is None
        assert method.quantized_input_dtype(layer, torch.zeros(1, 256)) is None
        layer.in_features = 192  # not whole groups of 128 columns
        assert method.quantized_input_dtype(layer, torch.zeros(1, 192).half()) is None
    assert sorted(set(launched)) == [1, 2] and len(launched) == 4, launched
    with use_kernel_config(dataclasses.replace(kernel_config(), int4_int8_activations=False)):
        assert int4_linear.Int4LinearMethod(group).quantized_input_dtype(
            type("L", (), {"in_features": 256})(), torch.zeros(1, 256).half()) is None


_SM90_SCRIPT = r'''
import re
import torch
from sm90_launch import compile_as_launched
from ember.kernels import int8_act, w4a8_gemv

# Llama-8B's projections with their tiles: dp4a in inline PTX, two a pack, the unpacking
# shared by the rows, no register spills.
for k, n in [(4096, 6144), (4096, 28672), (14336, 4096)]:
    qw = torch.randint(0, 2**31 - 1, (n, k // 8), dtype=torch.int32)
    qz = torch.randint(0, 2**31 - 1, (k // 128, n // 8), dtype=torch.int32)
    s = torch.rand(k // 128, n).half()
    counts = {}
    for rows in (1, 2):
        xq = int8_act.quantize_int8_reference(torch.randn(rows, k))
        config = w4a8_gemv.w4a8_gemv_config(n, k, torch.device("cpu"))  # any row count's
        (consts, ptx), = compile_as_launched(
            w4a8_gemv, "_w4a8_gemv_kernel",
            lambda: w4a8_gemv.w4a8_gemv(*xq, qw, qz, s, 128, torch.bfloat16))
        assert consts["ASM"] and consts["ROWS"] == rows, consts
        assert "ld.local" not in ptx and "st.local" not in ptx, (k, n, rows, "spilled")
        packs = 2 * config.block_n * config.block_k // 8 // (32 * config.num_warps)
        counts[rows] = (len(re.findall(r"dp4a\.u32\.s32", ptx)),
                        len(re.findall(r"and\.b32\s+%r\d+, %r\d+, 252645135;", ptx)))  # 0x0F0F0F0F
        assert counts[rows][0] == 2 * rows * packs, (k, n, rows, counts, packs)
    assert counts[1][1] == counts[2][1] > 0, (k, n, "the unpacking repeated per row", counts)
print("ok")
'''


@pytest.mark.slow
def test_w4a8_gemv_compiles_for_sm90():
    """Without a GPU (tests/sm90_launch.py): launched as w4a8_gemv launches it, at Llama-8B's
    shapes with their tuned tiles for 1 and 2 rows, the kernel compiles for sm90 with two
    inline-PTX dp4a a pack a row, one unpacking of each pack for every row, and no register
    spills."""
    from conftest import run_sm90_script

    proc = run_sm90_script(_SM90_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_awq_layers_take_int8_rows_on_cuda():
    """ember.testing's check at a Llama-8B-like fused shape with int8 rows on: 1-2 rows also
    through w4a8_gemv on the rows a producer writes, within the bf16 bound."""
    import dataclasses
    from functools import partial

    from ember.kernels.config import kernel_config, use_kernel_config
    from ember.testing import check_quantized_linear
    from ember.testing.quantized_checkpoints import awq_tensors

    with use_kernel_config(dataclasses.replace(kernel_config(), int4_int8_activations=True)):
        lines = check_quantized_linear("awq", partial(awq_tensors, group_size=128),
                                       config={"group_size": 128}, device="cuda",
                                       shapes=(([1024, 512], 4096),), batch_sizes=(1, 2, 3),
                                       dtypes=("float16", "bfloat16"))
    print("\n".join(lines))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_awq_model_with_int8_rows_against_half_rows(tmp_path, monkeypatch):
    """A bf16 AWQ model decoding two sequences with int8 rows (its norms, attention and
    SiLU-and-mul writing them, w4a8_gemv computing) against the same model with half-precision rows: the
    producers run only with int8 rows on, and the generated tokens' logprobs agree within the
    8-bit rounding's effect (printed with the greedy agreement)."""
    import dataclasses

    from model_factory import make_tiny_model

    from ember import LLM, SamplingParams
    from ember.kernels import decode_attention as decode_module
    from ember.kernels import rms_norm as rms_norm_module
    from ember.kernels import silu_and_mul as silu_module
    from ember.kernels.config import kernel_config, use_kernel_config
    from ember.testing.quantized_checkpoints import write_quantized_checkpoint

    calls = {"rms_norm_int8": 0, "silu_and_mul_int8": 0, "attention_int8": 0}

    def counting(fn, name):
        def counted(*args, **kwargs):
            calls[name] += name != "attention_int8" or kwargs.get("int8_out") is not None
            return fn(*args, **kwargs)
        return counted

    for module, name, key in ((rms_norm_module, "rms_norm_int8", "rms_norm_int8"),
                              (silu_module, "silu_and_mul_int8", "silu_and_mul_int8"),
                              (decode_module, "paged_decode_attention", "attention_int8")):
        monkeypatch.setattr(module, name, counting(getattr(module, name), key))
    src = str(make_tiny_model("llama", tmp_path / "src", hidden_size=512,
                              intermediate_size=1024, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=128, num_hidden_layers=4))
    write_quantized_checkpoint(src, str(tmp_path / "awq"), "awq", group_size=128)
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 3, 250, 11]},
               {"prompt_token_ids": [200, 1, 77, 13]}]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)

    def run(int8: bool):
        config = dataclasses.replace(kernel_config(), int4_int8_activations=int8)
        with use_kernel_config(config):
            llm = LLM(str(tmp_path / "awq"), skip_tokenizer_init=True, max_model_len=128,
                      dtype="bfloat16")
        outs = llm.generate(prompts, params)
        llm.shutdown()
        return [(o.outputs[0].token_ids,
                 [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in outs]

    half = run(False)
    assert calls == {"rms_norm_int8": 0, "silu_and_mul_int8": 0, "attention_int8": 0}
    int8 = run(True)
    assert all(calls.values()), calls
    same = total = 0
    err = 0.0
    for (tok_a, lp_a), (tok_b, lp_b) in zip(half, int8):
        for i, (a, b) in enumerate(zip(tok_a, tok_b)):
            total += 1
            same += a == b
            if tok_a[:i + 1] == tok_b[:i + 1]:  # the same context so far
                err = max(err, abs(lp_a[i] - lp_b[i]))
    print(f"AWQ int8 rows vs half rows: greedy agreement {same / total:.2f}, max logprob "
          f"difference on shared prefixes {err:.4f} nats")
    assert err < 1.0


def test_methods_name_their_weights_to_prefetch(monkeypatch):
    """With KernelConfig(l2_prefetch=True) read as it was built, a 4-bit layer names its three
    tensors and an fp8 layer its weight and scales for 1-2 rows on a GPU; 3 rows, the switch
    off, or the CPU: nothing."""
    from types import SimpleNamespace

    from ember.kernels import dispatch
    from ember.quantization import int4_linear
    from ember.quantization.fp8 import Fp8LinearMethod

    int4 = SimpleNamespace(l2_prefetch=True, qweight=torch.zeros(4, dtype=torch.int32),
                           scales=torch.zeros(4), qzeros=torch.zeros(4, dtype=torch.int32))
    fp8 = SimpleNamespace(l2_prefetch=True, weight=torch.zeros(4, dtype=torch.float8_e4m3fn),
                          weight_scale=torch.zeros(4))
    int4_method, fp8_method = int4_linear.Int4LinearMethod(128), Fp8LinearMethod(True)
    assert int4_method.weights_to_prefetch(int4, 1) == []  # the CPU
    assert fp8_method.weights_to_prefetch(fp8, 1) == []
    monkeypatch.setattr(int4_linear, "_kernels_take", lambda x: True)
    monkeypatch.setattr(dispatch, "on_gpu", lambda x: True)
    for rows in (1, 2):
        assert int4_method.weights_to_prefetch(int4, rows) == [int4.qweight, int4.scales,
                                                               int4.qzeros]
        assert fp8_method.weights_to_prefetch(fp8, rows) == [fp8.weight, fp8.weight_scale]
    assert int4_method.weights_to_prefetch(int4, 3) == []
    assert fp8_method.weights_to_prefetch(fp8, 3) == []
    int4.l2_prefetch = fp8.l2_prefetch = False
    assert int4_method.weights_to_prefetch(int4, 1) == []
    assert fp8_method.weights_to_prefetch(fp8, 1) == []


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_l2_prefetch_changes_no_output(method, tmp_path, monkeypatch):
    """The weights read into L2 beside attention (ember.layers.weight_prefetch) are a hint:
    an AWQ or fp8 model decoding one sequence gives the same tokens and logprobs with it as
    without, and the prefetch kernel did launch."""
    import dataclasses

    from model_factory import make_tiny_model

    from ember import LLM, SamplingParams
    from ember.kernels import l2_prefetch
    from ember.kernels.config import kernel_config, use_kernel_config
    from ember.testing.quantized_checkpoints import write_quantized_checkpoint

    launches = []
    real = l2_prefetch.prefetch_l2
    monkeypatch.setattr(l2_prefetch, "prefetch_l2",
                        lambda tensors: (launches.append(len(tensors)), real(tensors)))
    src = str(make_tiny_model("llama", tmp_path / "src", hidden_size=512,
                              intermediate_size=1024, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=128, num_hidden_layers=3))
    path, kw = src, {"quantization": "fp8"}
    if method == "awq":
        path, kw = str(tmp_path / "awq"), {}
        write_quantized_checkpoint(src, path, "awq", group_size=128)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)

    def run(prefetch: bool):
        with use_kernel_config(dataclasses.replace(kernel_config(), l2_prefetch=prefetch)):
            llm = LLM(path, skip_tokenizer_init=True, max_model_len=128, dtype="bfloat16",
                      **kw)
        out = llm.generate([{"prompt_token_ids": [5, 17, 42, 99, 3]}], params)[0].outputs[0]
        llm.shutdown()
        return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]

    without = run(False)
    assert not launches
    assert run(True) == without
    assert launches
