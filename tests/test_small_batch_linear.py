"""The small-batch linear kernel (ember.kernels.small_batch_linear) against F.linear, and the
Linear layer's choice of it (ember.layers.linear).

Without CUDA it runs under TRITON_INTERPRET=1 at small shapes; with CUDA the same cases run
compiled, plus the projection shapes of the shipped models in bf16. The layer only takes the
kernel on CUDA in half precision for weights up to the size limit; elsewhere it is nn.Linear.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ember import kernels  # noqa: E402
from ember.kernels import KernelConfig, dispatch, use_kernel_config  # noqa: E402
from ember.kernels.launch import merge_counters  # noqa: E402
from ember.kernels.small_batch_linear import (  # noqa: E402
    SmallBatchLinearConfig,
    small_batch_linear,
    small_batch_linear_config,
)
from ember.layers import linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=gen).to(dtype).to(DEV) if bias else None
    return x, w, b


MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 1024), (1024, 2048),
                (6144, 1024), (1024, 3072), (6144, 4096), (4096, 4096), (28672, 4096),
                (4096, 14336), (5120, 2048), (2048, 4096),
                (128, 2048)]  # (out, in) of the shipped models' projections and routers


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # both accumulate in fp32; each output is rounded once, maybe differently
        eps = torch.finfo(want.dtype).eps
        torch.testing.assert_close(got.float(), want.float(), atol=4 * eps, rtol=4 * eps)


# bf16 dots are wrong under the interpreter (no numpy bf16); fp16 covers half precision
# there, and the GPU cases below run bf16 compiled.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 40, 72, False), (3, 17, 300, True),
                                        (16, 64, 16, False), (5, 33, 520, True)])
def test_small_batch_linear_matches_f_linear(m, n, k, bias, dtype):
    # Shapes that are not multiples of the tiles (n 17/33/40, k 72/300/520) and every row count.
    x, w, b = _case(m, n, k, dtype, bias)
    _check(small_batch_linear(x, w, b), F.linear(x, w, b))


def test_small_batch_linear_strided_rows_and_explicit_config():
    x, w, b = _case(4, 48, 96, torch.float32, True, seed=1)
    wide = torch.zeros(4, 200, device=DEV)
    wide[:, 10:106] = x  # a row-strided view, as q/k/v slices of a fused output are
    got = small_batch_linear(wide[:, 10:106], w, b, config=(32, 32))
    _check(got, F.linear(x, w, b))


def test_linear_layer_dispatch():
    """The layer equals nn.Linear everywhere; it only takes the kernel where enabled: the kernel
    configuration and the weight size are read when the layer is built, the input decides per
    call."""
    layer = linear.Linear(24, 8, bias=True).to(DEV)
    assert layer.small_batch_max_rows == 16  # on by default
    with use_kernel_config(KernelConfig(triton_layers=False)):
        assert linear.Linear(24, 8).small_batch_max_rows == 0
    # Llama-8B: o_proj (34 MB in bf16) up to 16 rows, gate_up (235 MB) at batch 1 only; a
    # vocabulary-sized layer never.
    with torch.device("meta"):
        assert linear.Linear(4096, 4096, bias=False).small_batch_max_rows == 16
        assert linear.Linear(4096, 28672, bias=False).small_batch_max_rows == 1
        assert linear.Linear(4096, 128256, bias=False).small_batch_max_rows == 0
    x = torch.randn(2, 24, device=DEV)
    assert not dispatch.takes_kernel(x)  # float32: never
    _check(layer(x), F.linear(x, layer.weight, layer.bias))
    if torch.cuda.is_available():
        assert dispatch.takes_kernel(x.bfloat16())


def test_tuned_rules_pick_the_shipped_tiles():
    """The H200 rules, as data, give the shapes their tuned tiles (first matching rule)."""
    assert small_batch_linear_config(28672, 4096) == SmallBatchLinearConfig(32, 256, num_stages=3)
    assert small_batch_linear_config(4096, 14336) == SmallBatchLinearConfig(32, 512, num_stages=3)
    assert small_batch_linear_config(6144, 4096) == SmallBatchLinearConfig(64, 128, num_stages=6)
    assert small_batch_linear_config(4096, 4096) == SmallBatchLinearConfig(32, 256, num_stages=5)
    assert small_batch_linear_config(2048, 4096) == SmallBatchLinearConfig(64, 256, 4)
    assert small_batch_linear_config(576, 1536) == SmallBatchLinearConfig(32, 256, 4, 1024)
    assert small_batch_linear_config(576, 576) == SmallBatchLinearConfig(32, 128, l2_prefetch=1024)
    assert small_batch_linear_config(3072, 576) == SmallBatchLinearConfig(32, 256, l2_prefetch=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", MODEL_SHAPES)
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_model_shapes(m, n, k):
    x, w, _ = _case(m, n, k, torch.bfloat16, False)
    _check(small_batch_linear(x, w), F.linear(x, w))


@pytest.mark.parametrize("split_k", [2, 3, 5])
@pytest.mark.parametrize("m,bias", [(1, False), (6, True)])
def test_split_k_matches_f_linear_and_is_repeatable(m, bias, split_k):
    """Splitting K: the partial sums meet in split order (the same bits every launch) and the
    per-tile counts are left at zero, so the next launch (or graph replay) starts clean. K 300
    over BLOCK_K 32 gives splits of unequal length (whole BLOCK_K steps each)."""
    x, w, b = _case(m, 40, 300, torch.float32, bias, seed=4)
    first = small_batch_linear(x, w, b, config=(16, 32, split_k))
    _check(first, F.linear(x, w, b))
    assert torch.equal(small_batch_linear(x, w, b, config=(16, 32, split_k)), first)
    assert not merge_counters(1, x.device).any()


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (1024, 2048)])
def test_gpu_split_k_model_shapes(n, k, split_k):
    config = SmallBatchLinearConfig(32, 256, split_k)
    for m in (1, 8):
        x, w, _ = _case(m, n, k, torch.bfloat16, False)
        first = small_batch_linear(x, w, config=config)
        _check(first, F.linear(x, w))
        assert torch.equal(small_batch_linear(x, w, config=config), first)


@pytest.mark.gpu
@pytest.mark.parametrize("l2_prefetch", [64, 1000, 4096])
@pytest.mark.parametrize("n,k,split_k", [(6144, 4096, 1), (4096, 4096, 2), (576, 1536, 1)])
def test_gpu_l2_prefetch_changes_no_bits(n, k, split_k, l2_prefetch):
    """Prefetching W rows into L2 (rounded to whole powers of two of lines, within each split)
    is only a hint: the result has the same bits as without it."""
    for m in (1, 8):
        x, w, _ = _case(m, n, k, torch.bfloat16, False)
        plain = small_batch_linear(x, w, config=SmallBatchLinearConfig(32, 256, split_k))
        got = small_batch_linear(
            x, w, config=SmallBatchLinearConfig(32, 256, split_k, l2_prefetch))
        assert torch.equal(got, plain)


@pytest.mark.parametrize(
    "config", sorted({small_batch_linear_config(n, k) for n, k in MODEL_SHAPES}))
def test_every_default_config_matches_f_linear(config):
    """Each config small_batch_linear_config picks for the shipped models' shapes computes the right
    result (at a small shape with partial last tiles; the GPU test runs the real shapes). On a
    GPU in half precision, as the layers call it: the widest tiles, picked for 2-byte weights,
    need more shared memory in float32 than an H200 has."""
    dtype = torch.float16 if DEV == "cuda" else torch.float32
    x, w, b = _case(2, 72, 1100, dtype, True, seed=3)
    _check(small_batch_linear(x, w, b, config=config), F.linear(x, w, b))


def test_decoder_with_small_batch_kernel_forced(tmp_path, monkeypatch):
    """A tiny fp16 decoder whose projections go through the kernel (forced on the CPU, with the
    other layer kernels; every step here has <= 16 tokens) gives the torch path's hidden
    states."""
    from test_layer_kernels import _compare_decoders, _decoder_runner

    run = _decoder_runner("llama", "sdpa", torch.float16, tmp_path)
    plain = run()  # on the CPU the input test says no until forced below
    calls = []
    real = kernels.small_batch_linear.small_batch_linear

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "takes_kernel", lambda x: x.dtype == torch.float16)
    monkeypatch.setattr(kernels.small_batch_linear, "small_batch_linear", counted)
    _compare_decoders(run(), plain)
    assert len(calls) == 2 * 2 * 4  # 2 steps x 2 layers x (qkv, o, gate_up, down)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_bf16_decoder_small_batch_kernel(arch, tmp_path, monkeypatch):
    """The same decoder with only the projections switched between the kernel and cuBLAS."""
    from test_layer_kernels import _compare_decoders, _decoder_runner

    run = _decoder_runner(arch, "triton", torch.bfloat16, tmp_path)
    with_kernel = run()
    monkeypatch.setattr(kernels.small_batch_linear, "small_batch_linear",
                        lambda x, w, b=None: F.linear(x, w, b))
    _compare_decoders(with_kernel, run())
