"""The layers' Triton kernels (ember.kernels: RMSNorm + residual add, rotary, SiLU-and-mul,
greedy argmax) against the torch paths, and the layers' choice between them.

Without CUDA the kernels run under TRITON_INTERPRET=1 on the CPU at small shapes (the kernel
functions are called directly: the layers only pick them on CUDA in half precision); with CUDA
the same cases run compiled. Rotary and the residual add round where torch rounds, so they must match it
bit for bit; RMSNorm and SiLU may differ by an ulp (reduction order, exp). The interpreter
truncates float32 -> bfloat16 instead of rounding to nearest, so there bf16 gets ulp tolerances
too. The ``gpu``-marked test runs tiny bf16 decoders with the fused ops on and off.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before a kernel module is imported: @triton.jit reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ember.kernels import KernelConfig, dispatch, use_kernel_config  # noqa: E402
from ember.kernels.argmax import argmax_rows  # noqa: E402
from ember.kernels.launch import merge_counters  # noqa: E402
from ember.kernels.rms_norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_router,
    rms_norm,
)
from ember.kernels.rotary import rotary_inplace  # noqa: E402
from ember.kernels.silu_and_mul import silu_and_mul  # noqa: E402
from ember.layers.activation import SiluAndMul  # noqa: E402
from ember.layers.norm import RMSNorm  # noqa: E402
from ember.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bit_exact(dtype: torch.dtype) -> bool:
    """Whether ops that round like torch can be expected to equal it bit for bit."""
    return not (INTERPRET and dtype == torch.bfloat16)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    # Two ulps, relative to each value and to the tensor's scale (cancellation in rotary).
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps * scale)


TORCH_LAYERS = KernelConfig(triton_layers=False)  # layers built under it are the torch reference


def _norm(hidden: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    with use_kernel_config(TORCH_LAYERS):
        norm = RMSNorm(hidden, 1e-5, dtype).to(DEV)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    return norm


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


# ---- RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_matches_torch(dtype, hidden):
    norm = _norm(hidden, dtype)
    x = _randn(7, hidden, dtype=dtype, seed=1, scale=3.0)
    got = rms_norm(x, norm.weight, norm.eps)
    _assert_close(got, norm._forward_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_qkv_view(dtype):
    # Qwen3's q/k norm: [T, heads, head_size] views of the fused qkv output, not contiguous.
    t, hq, hk, d = 5, 6, 2, 32
    qkv = _randn(t, (hq + 2 * hk) * d, dtype=dtype, seed=2, scale=2.0)
    before = qkv.clone()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    for x, seed in ((q, 3), (k, 4)):
        norm = _norm(d, dtype, seed)
        got = rms_norm(x, norm.weight, norm.eps)
        assert got.is_contiguous()
        _assert_close(got, norm._forward_torch(x))
    assert torch.equal(qkv, before)  # inputs untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
def test_fused_add_rms_norm(dtype, hidden):
    norm = _norm(hidden, dtype)
    x = _randn(6, hidden, dtype=dtype, seed=5, scale=2.0)
    residual = _randn(6, hidden, dtype=dtype, seed=6, scale=4.0)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    # The torch path (CPU here, or a disabled CUDA run) adds into x in place.
    want_out, want_residual = norm.forward_with_residual(x0.clone(), r0)
    if _bit_exact(dtype):
        assert torch.equal(new_residual, want_residual)
    else:
        _assert_close(new_residual, want_residual)
    _assert_close(out, want_out)
    # Same as the two-step module path in float32 to 1e-5 as well.
    if dtype == torch.float32:
        _assert_close(out, norm._forward_torch(x0 + r0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,experts", [(1, 64, 16), (3, 96, 12), (2, 576, 40)])
def test_fused_add_rms_norm_router(dtype, rows, hidden, experts):
    # The MoE layer's closing add, norm and router GEMV in one kernel: the norm and the sum as
    # fused_add_rms_norm gives them, the logits as F.linear of that norm (float32 sums).
    norm = _norm(hidden, dtype)
    x = _randn(rows, hidden, dtype=dtype, seed=21, scale=2.0)
    residual = _randn(rows, hidden, dtype=dtype, seed=22, scale=4.0)
    router = _randn(experts, hidden, dtype=dtype, seed=23, scale=hidden**-0.5)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual, logits = fused_add_rms_norm_router(x, residual, norm.weight, norm.eps,
                                                          router)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    want_out, want_residual = fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(new_residual, want_residual) and torch.equal(out, want_out)
    assert logits.shape == (rows, experts) and logits.dtype == dtype
    want = torch.nn.functional.linear(out.float(), router.float())
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(logits.float(), want, rtol=tol, atol=tol * want.abs().max().item())


# ---- rotary -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,rotary_dim", [(16, 16), (32, 24), (64, 32)])
@pytest.mark.parametrize("heads", [1, 4])  # per program; 4: the last of 8 heads' programs full
def test_rotary_inplace_on_fused_qkv_views(dtype, head_size, rotary_dim, heads):
    t, hq, hk = 5, 6, 2
    rope = RotaryEmbedding(head_size, 10000.0, rotary_dim=rotary_dim)
    qkv = _randn(t, (hq + 2 * hk) * head_size, dtype=dtype, seed=7, scale=2.0)
    q = qkv[:, : hq * head_size].view(t, hq, head_size)
    k = qkv[:, hq * head_size : (hq + hk) * head_size].view(t, hk, head_size)
    v_before = qkv[:, (hq + hk) * head_size :].clone()
    positions = torch.tensor([0, 1, 5, 17, 250], device=DEV)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q, want_k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)

    rotary_inplace(q, k, cos, sin, rotary_dim, heads=heads)
    if _bit_exact(dtype):
        assert torch.equal(q, want_q) and torch.equal(k, want_k)
    else:
        _assert_close(q, want_q)
        _assert_close(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * head_size :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,heads", [(16, 1), (16, 2), (64, 8)])
def test_rotary_inplace_with_per_head_norm(dtype, head_size, heads):
    # Qwen3: RMSNorm over each head of q and k, then the rotation, in one kernel, in place on
    # views of the fused qkv output; against the torch ops (norm, then rope.apply).
    t, hq, hk = 5, 5, 2  # 7 heads: programs of 2 and 8 heads are partly empty
    rope = RotaryEmbedding(head_size, 10000.0)
    qkv = _randn(t, (hq + 2 * hk) * head_size, dtype=dtype, seed=11, scale=2.0)
    q = qkv[:, : hq * head_size].view(t, hq, head_size)
    k = qkv[:, hq * head_size : (hq + hk) * head_size].view(t, hk, head_size)
    v_before = qkv[:, (hq + hk) * head_size :].clone()
    q_norm, k_norm = _norm(head_size, dtype, seed=12), _norm(head_size, dtype, seed=13)
    positions = torch.tensor([0, 1, 5, 17, 250], device=DEV)
    cos, sin = rope.cos_sin(positions, dtype)
    want_q = rope.apply(q_norm._forward_torch(q), cos, sin)
    want_k = rope.apply(k_norm._forward_torch(k), cos, sin)

    # heads per program: 1, 2, 8 (one program a token)
    rotary_inplace(q, k, cos, sin, head_size, (q_norm.weight, k_norm.weight), q_norm.eps,
                   heads=heads)
    # The norm's statistics may differ by an ulp (reduction order), so ulp tolerances.
    _assert_close(q, want_q)
    _assert_close(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * head_size :], v_before)  # v untouched


def test_apply_qk_fuses_the_norms_only_where_the_kernel_can(monkeypatch):
    # The layer hands plain RMSNorms over whole, fully rotated heads to the kernel; partial
    # rotary keeps the norms as their own kernels. Both give the torch path's result.
    calls: list[bool] = []
    real = rotary_inplace

    def spy(q, k, cos, sin, rotary_dim, norm_weights=None, eps=0.0):
        calls.append(norm_weights is not None)
        real(q, k, cos, sin, rotary_dim, norm_weights, eps)

    import ember.kernels.rotary as rotary_module

    monkeypatch.setattr(rotary_module, "rotary_inplace", spy)
    monkeypatch.setattr(dispatch, "takes_kernel", lambda x: x.dtype == torch.float16)
    for rotary_dim, fused in ((32, True), (16, False)):
        rope = RotaryEmbedding(32, 10000.0, rotary_dim=rotary_dim)
        assert rope.use_kernel
        norms = (_norm(32, torch.float16, seed=14), _norm(32, torch.float16, seed=15))
        q = _randn(3, 4, 32, dtype=torch.float16, seed=16)
        k = _randn(3, 2, 32, dtype=torch.float16, seed=17)
        cos, sin = rope.cos_sin(torch.arange(3, device=DEV), torch.float16)
        want_q = rope.apply(norms[0]._forward_torch(q), cos, sin)
        want_k = rope.apply(norms[1]._forward_torch(k), cos, sin)
        got_q, got_k = rope.apply_qk(q.clone(), k.clone(), cos, sin, norms)
        assert calls.pop() is fused
        _assert_close(got_q, want_q)
        _assert_close(got_k, want_k)


def test_heads_per_program_fill_the_gpu_then_grow():
    from ember.kernels.rotary import heads_per_program

    assert heads_per_program(1, 36, 132) == 1  # a decode step: one head a program
    assert heads_per_program(256, 40, 132) == 16
    assert heads_per_program(8192, 40, 132) == 64  # prefill: one program a token
    assert heads_per_program(3, 12, 4) == 2


def test_rotary_inplace_accepts_2d_cos_sin_and_empty_batch():
    rope = RotaryEmbedding(16, 10000.0)
    q = _randn(3, 4, 16, dtype=torch.float32, seed=8)
    k = _randn(3, 2, 16, dtype=torch.float32, seed=9)
    cos, sin = rope.cos_sin(torch.arange(3, device=DEV), torch.float32)
    want_q, want_k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    rotary_inplace(q, k, cos[:, 0], sin[:, 0], 16)
    _assert_close(q, want_q)
    _assert_close(k, want_k)
    rotary_inplace(q[:0], k[:0], cos[:0], sin[:0], 16)  # no launch, no error


# ---- SiLU and mul -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 1100])  # 1100: more than one column block per row
def test_silu_and_mul(dtype, d):
    x = _randn(3, 2 * d, dtype=dtype, seed=10, scale=3.0)
    with use_kernel_config(TORCH_LAYERS):
        ref = SiluAndMul()(x)
    _assert_close(silu_and_mul(x), ref)
    x3 = x.view(3, 1, 2 * d)  # leading dims are flattened and restored
    assert silu_and_mul(x3).shape == (3, 1, d)


# ---- when the layers use the kernels -----------------------------------------------------------


def test_layers_take_kernels_only_for_cuda_half():
    for dtype in DTYPES:
        assert not dispatch.takes_kernel(torch.zeros(2, dtype=dtype))  # CPU: never
    if torch.cuda.is_available():
        assert not dispatch.takes_kernel(torch.zeros(2, device="cuda"))  # float32
        assert dispatch.takes_kernel(torch.zeros(2, dtype=torch.bfloat16, device="cuda"))


def test_kernel_config_is_read_as_layers_are_built():
    assert dispatch.layer_kernels_enabled()  # the default, with triton installed
    with use_kernel_config(TORCH_LAYERS):
        assert not dispatch.layer_kernels_enabled()
        torch_norm, torch_rope = RMSNorm(8), RotaryEmbedding(16, 10000.0)
    assert not torch_norm.use_kernel and not torch_rope.use_kernel
    assert RMSNorm(8).use_kernel and SiluAndMul().use_kernel  # built after: the default again


# ---- whole decoder --------------------------------------------------------------------------------


def _to_device(md, device: str):
    tensors = {f.name: getattr(md, f.name) for f in dataclasses.fields(md)}
    moved = {n: v.to(device) for n, v in tensors.items() if isinstance(v, torch.Tensor)}
    return dataclasses.replace(md, **moved, backend_data=None)


def _decoder_runner(arch: str, backend_name: str, dtype: torch.dtype, tmp_path):
    """A tiny decoder on DEV and a function running two steps (a 2-request prefill, then a
    decode step) from the same fresh KV caches; it returns each step's hidden states."""
    from model_factory import Chunk, PagedCache, make_tiny_model

    from ember.attention_backends.sdpa import SdpaBackend
    from ember.layers.attention import ForwardContext
    from ember.models.llama import LlamaForCausalLM
    from ember.models.loader import load_model
    from ember.models.qwen3 import Qwen3ForCausalLM

    if backend_name == "triton":
        from ember.attention_backends.triton_backend import TritonBackend as backend
    else:
        backend = SdpaBackend
    cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[arch]
    # hidden 576 (not a power of two, like SmolLM2-135M), GQA 3, partial rotary on llama.
    extra = {"partial_rotary_factor": 0.5} if arch == "llama" else {}
    path = make_tiny_model(arch, tmp_path, hidden_size=576, num_attention_heads=6,
                           num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
                           **extra)  # fmt: skip
    model = load_model(path, cls, backend, dtype, device=DEV)
    if arch == "llama":
        assert model.model.rotary_emb.rotary_dim == 16
    cache = PagedCache(model, num_blocks=16, block_size=16, seed=0, backend=backend)
    caches0 = [c.to(DEV) for c in cache.kv_caches]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (3, 6)]
    steps = [[Chunk(0, prompts[0]), Chunk(1, prompts[1])], [Chunk(0, [5]), Chunk(1, [7])]]
    built = [cache.build(chunks) for chunks in steps]

    def run() -> list[torch.Tensor]:
        kv = [c.clone() for c in caches0]
        outs = []
        for ids, pos, md in built:
            md = backend.build_metadata(_to_device(md, DEV))
            with torch.no_grad():
                outs.append(model(ids.to(DEV), pos.to(DEV), ForwardContext(md, kv)).float())
        return outs

    return run


def _compare_decoders(fused: list[torch.Tensor], unfused: list[torch.Tensor]) -> None:
    for a, b in zip(fused, unfused):
        assert torch.isfinite(a).all()
        # Two half-precision layers: only RMSNorm/SiLU ulps (and, in the interpreter, bf16
        # truncation) differ, so the two paths stay close.
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)
        assert (a - b).abs().mean() < 0.01


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decoder_wiring_with_kernels_forced(arch, tmp_path, monkeypatch):
    """The layers' fused branches (residual threading, Qwen3 per-head norm on strided views,
    in-place rotary) give the torch path's hidden states; on the CPU the predicate is forced."""
    run = _decoder_runner(arch, "sdpa", torch.float16, tmp_path)
    unfused = run()
    calls = []

    def forced(x: torch.Tensor) -> bool:
        calls.append(x.dtype)
        return x.dtype in (torch.float16, torch.bfloat16)

    monkeypatch.setattr(dispatch, "takes_kernel", forced)
    fused = run()
    assert calls
    _compare_decoders(fused, unfused)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("backend_name", ["triton", "sdpa"])
def test_gpu_bf16_decoder_kernels_match_torch_layers(arch, backend_name, tmp_path):
    fused = _decoder_runner(arch, backend_name, torch.bfloat16, tmp_path / "kernels")()
    with use_kernel_config(TORCH_LAYERS):
        unfused = _decoder_runner(arch, backend_name, torch.bfloat16, tmp_path / "torch")()
    _compare_decoders(fused, unfused)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_rows_matches_torch_including_ties(rows):
    """Greedy argmax over vocabulary chunks: same ids as torch, ties resolved to the first
    index (across chunks too), a vocabulary that is not a multiple of the chunk, and the
    counters left zero so the next call (or a graph replay) starts clean."""
    vocab = 10_000  # three chunks, the last one partial
    logits = _randn(rows, vocab, dtype=torch.float32, seed=rows)
    logits[0, 9_999] = 50.0  # the max in the partial last chunk
    if rows > 1:
        logits[1, 7_000] = logits[1, 123] = 60.0  # tie across chunks: the first wins
        logits[2, :] = float("-inf")
        logits[2, 4_096] = 1.0
    for _ in range(2):
        got = argmax_rows(logits)
        assert got.dtype == torch.int64
        assert torch.equal(got.cpu(), logits.argmax(dim=-1).cpu())
    assert torch.count_nonzero(merge_counters(1, logits.device)) == 0


def test_argmax_launches_past_the_first_skip_the_jit_while_nothing_specializes_anew():
    """ember.kernels.fast_launch: compiled, the first launch's kernel is kept and launched
    directly after; a launch that specializes otherwise (a tensor off 16-byte alignment,
    another vocabulary width) compiles its own, and every answer is torch's. Interpreted,
    nothing is kept."""
    from ember.kernels import fast_launch

    fast_launch._COMPILED.clear()
    wide = _randn(4, 10_001, dtype=torch.float32, seed=7)
    for logits in (wide[:, :10_000], wide[:, :10_000].clone(), wide[:, 1:], wide):
        for _ in range(2):
            assert torch.equal(argmax_rows(logits).cpu(), logits.argmax(dim=-1).cpu())
    # Four keys: row stride 10,001 and 10,000, the misaligned view, the 10,001-wide rows.
    assert len(fast_launch._COMPILED) == (0 if INTERPRET else 4)


def test_masked_argmax_rows_matches_torch():
    """Under a grammar bitmask narrower than the vocabulary: masked rows take the argmax of
    their allowed tokens (none past the bitmask, ties to the first), unmasked rows (-1) the
    plain argmax, a row with nothing allowed gives 0 as torch's argmax of all -inf does; the
    bitmask rows are looked up through mask_rows, in any order."""
    from ember.structured_output.bitmask import unpack_bitmask

    rows, vocab, words = 5, 10_000, 200  # the bitmask covers 6,400 of the 10,000 tokens
    logits = _randn(rows, vocab, dtype=torch.float32, seed=3)
    logits[:, 9_000] = 100.0  # past the bitmask: wins only in unmasked rows
    gen = torch.Generator().manual_seed(4)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bitmask[2] = 0  # nothing allowed
    logits[0, 5_000] = logits[0, 100] = 50.0  # a tie inside row 0's allowed tokens...
    bitmask[1, 100 // 32] |= 1 << (100 % 32)  # (row 0 reads bitmask row 1)
    bitmask[1, 5_000 // 32] |= 1 << (5_000 % 32)
    mask_rows = torch.tensor([1, -1, 0, 2, -1], dtype=torch.int32)
    ref = logits.cpu().clone()
    for row, m in enumerate(mask_rows.tolist()):
        if m >= 0:
            ref[row] = ref[row].masked_fill(~unpack_bitmask(bitmask[m:m + 1], vocab)[0],
                                            float("-inf"))
    want = ref.argmax(dim=-1)
    assert want[0] == 100 and want[1] == 9_000 and want[3] == 0
    got = argmax_rows(logits, bitmask.to(DEV), mask_rows.to(DEV))
    assert torch.equal(got.cpu(), want.cpu())
    # Every row masked in order (no row map): row i takes bitmask row i.
    in_order = bitmask[[1, 0, 2]].clone()
    ref = logits.cpu()[:3].clone()
    for row in range(3):
        ref[row] = ref[row].masked_fill(~unpack_bitmask(in_order[row:row + 1], vocab)[0],
                                        float("-inf"))
    got = argmax_rows(logits[:3], in_order.to(DEV))
    assert torch.equal(got.cpu(), ref.argmax(dim=-1).cpu())
