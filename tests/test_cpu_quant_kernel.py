"""ember's native quantized CPU kernel (ember.kernels.cpu.quant_linear), 4- and 8-bit codes:
against the float64 product of the same bfloat16-rounded activations and exact weights, each row
bit for bit its own one-row call (the batch does not change a row), its plain-C build bit for
bit its AVX512-BF16 one, threads not changing a bit, and the packing's refusals."""

from __future__ import annotations

import pytest
import torch

from ember.kernels.cpu import quant_linear as Q

pytestmark = pytest.mark.skipif(not Q.available(), reason="no C compiler to build the kernel")


def _case(n: int, k: int, seed: int = 0, bits: int = 4):
    g = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(low, high, (n, k), generator=g)
    # float16-exact scales and offsets, as GGUF's blocks hold them
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
    w = (codes.float().view(n, k // 32, 32) * d[..., None] + m[..., None]).view(n, k)
    return Q.pack(codes, d, m, bits=bits), w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 96), (576, 1536), (3072, 576), (7, 32)])
@pytest.mark.parametrize("rows", [1, 7, 8, 9, 37])
def test_against_the_float64_product(n, k, rows, bits):
    blocks, w = _case(n, k, bits=bits)
    x = torch.randn(rows, k)
    got = Q.quant_linear(x, blocks, n, bits)
    want = x.to(torch.bfloat16).double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # float32 sums of exact products: error a few float32 ulps of the largest terms
    scale = (x.to(torch.bfloat16).double().abs() @ w.double().abs().T).max()
    assert (got.double() - want).abs().max() <= 1e-6 * scale


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_its_batch(bits):
    blocks, _ = _case(100, 192, bits=bits)
    x = torch.randn(37, 192)
    batch = Q.quant_linear(x, blocks, 100, bits)
    for i in range(37):
        assert torch.equal(Q.quant_linear(x[i:i + 1], blocks, 100, bits)[0], batch[i])
    assert torch.equal(Q.quant_linear(x[5:21], blocks, 100, bits), batch[5:21])
    wide = torch.randn(37, 192 + 34)  # a strided view: rows 226 apart
    wide[:, 10:202] = x
    assert torch.equal(Q.quant_linear(wide[:, 10:202], blocks, 100, bits), batch)
    # leading dimensions are kept; bfloat16 input is the same values
    assert torch.equal(Q.quant_linear(x.view(1, 37, 192), blocks, 100, bits)[0], batch)
    assert torch.equal(Q.quant_linear(x.bfloat16(), blocks, 100, bits), batch)


def test_a_long_batch_in_row_blocks_keeps_each_row():
    """Past ROW_BLOCK (192) rows the tiles pass over the rows a block at a time: rows of every
    block, the last one short, equal their one-row calls, with one thread and two."""
    blocks, w = _case(40, 96, seed=3)
    x = torch.randn(401, 96)
    batch = Q.quant_linear(x, blocks, 40, threads=1)
    for i in (0, 191, 192, 383, 384, 400):
        assert torch.equal(Q.quant_linear(x[i:i + 1], blocks, 40)[0], batch[i])
    assert torch.equal(Q.quant_linear(x, blocks, 40, threads=2), batch)
    want = x.to(torch.bfloat16).double() @ w.double().T
    scale = (x.to(torch.bfloat16).double().abs() @ w.double().abs().T).max()
    assert (batch.double() - want).abs().max() <= 1e-6 * scale


def test_threads_do_not_change_a_bit():
    blocks, _ = _case(200, 128)
    x = torch.randn(19, 128)
    one = Q.quant_linear(x, blocks, 200, threads=1)
    assert torch.equal(Q.quant_linear(x, blocks, 200, threads=2), one)
    assert torch.equal(Q.quant_linear(x, blocks, 200, threads=3), one)


def test_plain_c_build_equals_the_native_one():
    """The build for CPUs without AVX512-BF16 (forced here with -mno-avx512bf16): the same
    arithmetic, so the same bits (the inputs hold no denormals, which the instruction flushes)."""
    plain = Q._load(Q.build(extra_flags=("-mno-avx512bf16",)))
    assert plain.ember_quant_native() == 0
    for n, k, rows, bits in [(48, 64, 9, 4), (40, 96, 3, 8), (576, 1536, 17, 4), (96, 64, 11, 8)]:
        blocks, _ = _case(n, k, seed=n, bits=bits)
        x = torch.randn(rows, k)
        assert torch.equal(Q.quant_linear(x, blocks, n, bits, lib=plain),
                           Q.quant_linear(x, blocks, n, bits))


def test_packing_refuses_what_the_kernel_cannot_hold():
    codes = torch.zeros(16, 48, dtype=torch.uint8)
    assert Q.pack(codes, torch.ones(16, 1), torch.zeros(16, 1)) is None  # K not a multiple of 32
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    huge = torch.full((16, 2), 1e6)  # past float16
    assert Q.pack(codes, huge, torch.zeros(16, 2)) is None
    blocks, _ = _case(16, 64)
    with pytest.raises(ValueError, match="features"):
        Q.quant_linear(torch.randn(2, 32), blocks, 16)
    assert Q.quant_linear(torch.randn(0, 64), blocks, 16).shape == (0, 16)


def test_symmetric_8bit_packing_gives_back_q8_0():
    """A Q8_0 tensor's dequantized values packed again: the same codes and scales, so the
    kernel computes with the file's own weights."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (48, 96), generator=g)
    codes[:, ::32] = 127  # as Q8_0 rounds: each group's largest magnitude is 127
    d = (torch.rand(48, 3, generator=g) * 0.01 + 1e-4).half().float()
    w = (codes.float().view(48, 3, 32) * d[..., None]).view(48, 96)
    assert torch.equal(Q.pack_symmetric_8bit(w), Q.pack(codes, d, torch.zeros_like(d), bits=8))


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        Q.build(extra_flags=("-DEMBER_TEST_UNIQUE_KEY",))


def test_traced_code_calls_one_op():
    """Under torch.compile a native layer and head are one custom op each (fullgraph: a ctypes
    call would break the graph), computing what the eager call does."""
    from ember.quantization import gguf as gguf_method

    blocks, w = _case(48, 64)
    part = gguf_method._Part(48, "native", {"blocks": blocks}, {"bits": 4})
    head = gguf_method.NativeLogits.build(w)
    x = torch.randn(3, 64)
    for module in (part, head):
        module.prepare_for_compile()  # as the model runner's compile_model does
    for fn in (part.forward, head.forward):
        traced = torch.compile(fn, fullgraph=True, backend="eager")
        assert torch.equal(traced(x), fn(x))
