"""The fused MoE layer's decode path (ember.kernels.moe_decode) against the torch experts
(ember.layers.moe.moe_torch): routing given or done inside the up kernel, top 1 to 8, experts
shared by tokens, float32 and bfloat16; which calls take the path; the scratch counts it must
leave alone; the expert-hit counters benchmarks read.

Without CUDA the kernels run under TRITON_INTERPRET=1 at small shapes; the ``gpu`` tests run
them compiled at the Qwen3-30B-A3B and Mixtral shapes in bfloat16, and under a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before a kernel module is imported: @triton.jit reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ember.kernels import fused_moe as fm  # noqa: E402
from ember.kernels import moe_decode as md  # noqa: E402
from ember.layers.moe import moe_torch, route  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (tokens, experts, top_k, hidden, intermediate): more experts than active ones, sizes that are
# no multiple of the CPU tiles (16 / 32), top-1, top-3 (k not a power of two), top-8; 80
# experts: the up kernel's routing ranks them in several strips, the last one partly masked.
SHAPES = [(1, 8, 2, 32, 16), (2, 16, 8, 40, 24), (5, 12, 1, 24, 40), (5, 16, 2, 40, 24),
          (1, 10, 3, 48, 20), (5, 24, 8, 32, 16), (2, 80, 8, 16, 16)]


def _case(shape, dtype, seed=0):
    t, e, _, h, inter = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter**0.5
    logits = torch.randn(t, e, generator=gen)  # float32: no ties among the experts
    return (*(a.to(DEV, dtype) for a in (x, w13, w2)), logits.to(DEV))


def _config(shape, dtype, fuse_route=True):
    _, e, k, _, _ = shape
    cfg = md.decode_config(k, e, dtype, fm.compiled_for_gpu(torch.empty(0, device=DEV)))
    return replace(cfg, fuse_route=fuse_route)


def _round_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 -> float32 as the kernels round: to nearest even when compiled;
    toward zero under TRITON_INTERPRET, whose float32 -> bfloat16 cast truncates."""
    if fm.compiled_for_gpu(t):
        return t.to(torch.bfloat16).float()
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def _rounded_reference(x, w13, w2, weights, ids):
    """The decode path's arithmetic in float32 torch, pair by pair: each matmul output rounded
    to bf16, SiLU rounded before the multiply, the weight rounded, the slots summed in float32
    and rounded once (what the sorted path and moe_torch round, in that order)."""
    inter = w2.shape[2]
    x, w13, w2, weights = x.float(), w13.float(), w2.float(), weights.float()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            h = _round_bf16(w13[e] @ x[t])
            g, u = h[:inter], h[inter:]
            act = _round_bf16(_round_bf16(g / (1 + torch.exp(-g))) * u)
            acc += _round_bf16(_round_bf16(w2[e] @ act) * _round_bf16(weights[t, s]))
        out[t] = _round_bf16(acc)
    return out


def _assert_close_to_torch(got, x, w13, w2, weights, ids):
    """float32: moe_torch within the sorted path's tolerance. bfloat16: the rounded reference
    within one bf16 ulp (on the GPU, where float32 sums of thousands of terms run in another
    order and may cross a rounding boundary, plus half an ulp of the largest output), and on
    the GPU also the sorted path's bound against float32 arithmetic on the same inputs: twice
    the torch path's own error, or 1% of the largest output. (Not under the interpreter: its
    truncating bf16 cast errs by up to 3% here, by rounding mode alone.)"""
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, moe_torch(x, w13, w2, weights, ids), atol=2e-5, rtol=2e-5)
        return
    rounded = _rounded_reference(x, w13, w2, weights, ids)
    on_gpu = fm.compiled_for_gpu(x)
    atol = 2**-8 * rounded.abs().max().item() if on_gpu else 1e-5
    torch.testing.assert_close(got.float(), rounded, rtol=2**-7, atol=atol)
    if not on_gpu:
        return
    want = moe_torch(x.float(), w13.float(), w2.float(), weights.to(x.dtype).float(), ids)
    ref = moe_torch(x, w13, w2, weights.to(x.dtype), ids)
    err = (got.float() - want).abs().max().item()
    ref_err = (ref.float() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= max(2 * ref_err, 1e-2 * scale), (err, ref_err, scale)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("renormalize", [True, False])
def test_decode_experts_match_torch(shape, dtype, renormalize):
    """Routing given (fused_experts with a DecodeConfig): float32 weights rounded to the
    activation dtype in the kernel, as Qwen3-MoE casts them."""
    x, w13, w2, logits = _case(shape, dtype)
    weights, ids = route(logits, shape[2], renormalize, None)
    got = fm.fused_experts(x, w13, w2, weights, ids, config=_config(shape, dtype))
    assert got.dtype == dtype and got.shape == x.shape
    _assert_close_to_torch(got, x, w13, w2, weights, ids)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("fuse_route", [True, False], ids=["fused_route", "route_kernel"])
def test_decode_moe_routes_as_torch(shape, dtype, renormalize, fuse_route):
    """The whole layer (fused_moe) on the decode path, routing in the up kernel or in the
    route kernel (without its counts), against HF's routing and the torch experts."""
    x, w13, w2, logits = _case(shape, dtype, seed=1)
    weights, ids = route(logits, shape[2], renormalize, None)
    got = fm.fused_moe(x, w13, w2, logits, shape[2], renormalize,
                       config=_config(shape, dtype, fuse_route))
    _assert_close_to_torch(got, x, w13, w2, weights, ids)
    assert not fm._counts(x.device).any()  # nothing left for an align that never runs


def test_expert_shared_by_tokens():
    """Three tokens on expert 3 (one of them twice over, in different slots of the tokens),
    expert 5 unhit: each pair reads its own expert, the sum per token is over its slots."""
    shape = (3, 6, 2, 40, 24)
    x, w13, w2, _ = _case(shape, torch.float32, seed=2)
    ids = torch.tensor([[0, 3], [3, 1], [2, 3]], device=DEV)
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.1, 0.9]], device=DEV)
    want = moe_torch(x, w13, w2, weights, ids)
    got = fm.fused_experts(x, w13, w2, weights, ids, config=_config(shape, torch.float32))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # The sorted path agrees, and the decode path gives the same bits every time.
    torch.testing.assert_close(fm.fused_experts(x, w13, w2, weights, ids), want, atol=2e-5,
                               rtol=2e-5)
    again = fm.fused_experts(x, w13, w2, weights, ids, config=_config(shape, torch.float32))
    assert torch.equal(got, again)


def test_fused_routing_breaks_ties_as_the_route_kernel():
    """Logits in {0, 1, 2}: ties everywhere (as bf16 router logits often have). Routing in the
    up kernel takes the lowest index first, as the route kernel's k rounds of argmax do."""
    shape = (3, 40, 8, 16, 16)
    x, w13, w2, _ = _case(shape, torch.float32, seed=3)
    logits = torch.randint(0, 3, (3, 40), generator=torch.Generator().manual_seed(3)).float()
    logits[0] = 0.0  # one token with every expert tied
    logits = logits.to(DEV)
    weights, ids, _ = fm.route(logits, 8, True, count=False)
    assert ids[0].tolist() == list(range(8))
    want = moe_torch(x, w13, w2, weights, ids.long())
    for fuse in (True, False):
        got = fm.fused_moe(x, w13, w2, logits, 8, True, config=_config(shape, x.dtype, fuse))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_which_calls_take_the_decode_path():
    # One token only (the H200 sweep: the sorted path wins from 2 tokens on).
    assert md.takes_decode_path(1, 8, 128) and not md.takes_decode_path(2, 8, 128)
    assert md.takes_decode_path(1, 2, 8) and not md.takes_decode_path(2, 2, 8)
    assert md.takes_decode_path(1, 3, 4)  # one token: its experts are distinct
    assert not md.takes_decode_path(1, md.DECODE_MAX_TOP_K + 1, 64)


def test_fused_moe_dispatch(monkeypatch):
    """One token goes to moe_decode without touching the align counts; more tokens, ranks
    from the route kernel, or a MoeConfig go to the sorted path."""
    calls = []
    real = md.decode_moe
    monkeypatch.setattr(md, "decode_moe", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    shape = (2, 16, 2, 32, 16)
    x, w13, w2, logits = _case(shape, torch.float32)
    one_x, one_logits = x[:1], logits[:1]
    fm.fused_moe(one_x, w13, w2, one_logits, 2, True)
    assert len(calls) == 1 and calls[0]["router_logits"] is one_logits
    assert not fm._counts(x.device).any()
    fm.fused_moe(one_x, w13, w2, one_logits, 2, True,
                 config=fm.moe_config(2, 16, x.dtype, False))
    weights, ids, ranks = fm.route(one_logits, 2, True)
    fm.fused_experts(one_x, w13, w2, weights, ids, ranks)  # consumes the counts: sorted path
    fm.fused_moe(x, w13, w2, logits, 2, True)  # two tokens
    assert len(calls) == 1
    assert not fm._counts(x.device).any()
    weights, ids, ranks = fm.route(logits, 2, True)
    with pytest.raises(ValueError, match="ranks"):
        fm.fused_experts(x, w13, w2, weights, ids, ranks, config=_config(shape, x.dtype))
    fm.align(ids.flatten(), ranks, 16, 16)  # clears what that route counted


def test_decode_path_counts_expert_hits():
    """What the MoE benchmark reads: distinct experts per call (an expert shared by two tokens
    counts once) and the calls, on either routing."""
    shape = (3, 6, 2, 16, 16)
    x, w13, w2, logits = _case(shape, torch.float32)
    fm.expert_hit_stats(DEV, reset=True)
    fm.count_expert_hits(True)
    try:
        ids = torch.tensor([[0, 3], [3, 1], [3, 0]], device=DEV)
        fm.fused_experts(x, w13, w2, torch.full((3, 2), 0.5, device=DEV), ids,
                         config=_config(shape, x.dtype))
        assert fm.expert_hit_stats(DEV, reset=True) == (3, 1)
        fm.fused_moe(x[:1], w13, w2, logits[:1], 2, True)  # one token: the path by itself
        assert fm.expert_hit_stats(DEV, reset=True) == (2, 1)
    finally:
        fm.count_expert_hits(False)


# ---- GPU: real shapes in bfloat16, CUDA graphs ----------------------------------------------

# Qwen3-30B-A3B (128 experts, top 8, 2048 / 768) and Mixtral-8x7B (8, top 2, 4096 / 14336).
GPU_SHAPES = [(128, 8, 2048, 768), (8, 2, 4096, 14336)]


def _gpu_case(shape, tokens, seed):
    e, k, h, inter = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen).cuda().bfloat16()
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).cuda().bfloat16()
    w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).cuda().bfloat16()
    return x, w13, w2, torch.randn(tokens, e, generator=gen).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_gpu_decode_bf16_close_to_torch(shape, tokens):
    """Forced at every size (the benchmark times it past the dispatch threshold), with either
    routing; the same bits on a second run; the sorted path on the same inputs as well."""
    e, k, _, _ = shape
    x, w13, w2, logits = _gpu_case(shape, tokens, tokens)
    weights, ids = route(logits, k, True, None)
    for fuse in (True, False):
        cfg = replace(md.decode_config(k, e, x.dtype, True), fuse_route=fuse)
        got = fm.fused_moe(x, w13, w2, logits, k, True, config=cfg)
        _assert_close_to_torch(got, x, w13, w2, weights, ids)
        assert torch.equal(got, fm.fused_moe(x, w13, w2, logits, k, True, config=cfg))
    sorted_path = fm.fused_moe(x, w13, w2, logits, k, True,
                               config=fm.moe_config(tokens * k, e, x.dtype, True))
    _assert_close_to_torch(sorted_path, x, w13, w2, weights, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [True, False], ids=["fused_route", "route_kernel"])
def test_gpu_decode_in_cuda_graph_equals_eager(fuse):
    e, k, h, inter = GPU_SHAPES[0]
    x, w13, w2, logits = _gpu_case(GPU_SHAPES[0], 4, 0)
    cfg = replace(md.decode_config(k, e, x.dtype, True), fuse_route=fuse)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fm.fused_moe(x, w13, w2, logits, k, True, config=cfg)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, logits, k, True, config=cfg)
    for seed in range(3):  # new inputs in place: the graph routes them afresh
        gen = torch.Generator().manual_seed(seed + 10)
        x.copy_(torch.randn(4, h, generator=gen))
        logits.copy_(torch.randn(4, e, generator=gen))
        graph.replay()
        want = fm.fused_moe(x, w13, w2, logits, k, True, config=cfg)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert not fm._counts(x.device).any()


_SM90_SCRIPT = r'''
import re
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ember.kernels import moe_decode as md

def compile_ptx(kernel, sig, consts, opts, odd=()):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else sig[n] for n in names}
    # As a launch specialises them: pointers 16-byte aligned, sizes and strides multiples of 16.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if n not in odd}
    src = ASTSource(kernel, signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

def streams_16_bytes(ptx, stages):
    # Straight into registers, or (pipelined) copied asynchronously into shared memory.
    if stages > 1:
        return re.search(r"cp\.async\.cg\.shared\.global [^;]*, 0x10", ptx) is not None
    return "ld.global.v4" in ptx

B, I, F = "*bf16", "*i32", "*fp32"
up = dict(x_ptr=B, w_ptr=B, out_ptr=B, ids_ptr=I, weights_ptr=F, logits_ptr=B, H="i32",
          INTER="i32", E="i32", stride_x="i32", stride_we="i32", stride_wn="i32",
          stride_o="i32", stride_l="i32")
down = dict(a_ptr=B, w_ptr=B, out_ptr=B, ids_ptr=I, weights_ptr=F, stats_ptr="*i64", N="i32",
            H="i32", INTER="i32", E="i32", stride_a="i32", stride_we="i32", stride_wn="i32",
            stride_o="i32")
for e, k in ((128, 8), (8, 2)):  # Qwen3-30B-A3B, Mixtral
    cfg = md.decode_config(k, e, torch.bfloat16, True)
    opts = dict(num_warps=cfg.num_warps)
    block_e = triton.next_power_of_2(e)
    for fuse in (True, False):
        ptx = compile_ptx(md._up_kernel, up, dict(
            K_TOP=k, FUSE_ROUTE=fuse, RENORMALIZE=True, BLOCK_E=block_e,
            CHUNK_E=4096 // block_e, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            STAGES=cfg.up_stages, PDL=True), opts, odd=("E",))
        # Weights stream in 16-byte loads, or decode would not reach the bandwidth.
        assert streams_16_bytes(ptx, cfg.up_stages), ("up", e, k, fuse)
    ptx = compile_ptx(md._down_kernel, down, dict(
        K_TOP=k, K_PAD=md._k_pad(k), ROUND_WEIGHT=True, STATS=True, BLOCK_E=block_e,
        BLOCK_H=cfg.block_h, BLOCK_I=cfg.block_i, STAGES=cfg.down_stages, PDL=True), opts,
        odd=("N", "E"))
    assert streams_16_bytes(ptx, cfg.down_stages), ("down", e, k)
print("ok")
'''


@pytest.mark.slow
def test_decode_kernels_compile_for_sm90():
    """Without a GPU: both decode kernels compile for an H200 (sm90, triton's own ptxas) at the
    tiles decode_config picks, and the weights stream in 16-byte loads. Run in a fresh
    interpreter: this process may have TRITON_INTERPRET set."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
