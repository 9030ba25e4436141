"""Mixture of experts below the engine: routing against transformers' routers, the torch expert
path against transformers' MoE blocks, the fused Triton path (routing, expert sort, grouped
GEMMs) against the torch path, and expert-weight loading (per-expert and fused names, errors).

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 at small shapes; the ``gpu``
tests run them compiled at the Qwen3-30B-A3B and Mixtral shapes in bfloat16, and under a
captured CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before a kernel module is imported: @triton.jit reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from moe_factory import make_moe_config, make_moe_hf_model, make_moe_model  # noqa: E402

from ember.attention_backends.sdpa import SdpaBackend  # noqa: E402
from ember.kernels import fused_moe as fm  # noqa: E402
from ember.layers.moe import FusedMoE, moe_torch, route  # noqa: E402
from ember.models.loader import load_model  # noqa: E402
from ember.models.mixtral import MixtralForCausalLM  # noqa: E402
from ember.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CLASSES = {"qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}


def _experts(e: int, h: int, inter: int, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h**0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter**0.5
    return w13.to(device, dtype), w2.to(device, dtype)


# ---- routing and the torch path against transformers ---------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_block_equals_hf(arch, dtype):
    """Our SparseMoeBlock (router + torch experts) against HF's block on the same weights, bit
    for bit, in float32 and bfloat16 (each casts its routing weights as HF does)."""
    hf = make_moe_hf_model(arch).to(dtype)
    hf_block = hf.model.layers[0].mlp
    model = load_model(hf.config, CLASSES[arch], SdpaBackend, dtype,
                       weights=((n, t) for n, t in _hf_state(arch, hf)))
    ours = model.model.layers[0].mlp
    x = torch.randn(1, 37, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(dtype)
    with torch.no_grad():
        want = hf_block(x)
        want = want[0] if isinstance(want, tuple) else want  # older transformers: (out, logits)
        got = ours(x[0])
    assert torch.equal(got, want.reshape(got.shape))


def _hf_state(arch, hf):
    """HF's weights under the names its checkpoints use (per expert), as save_pretrained writes."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        return list(load_file(os.path.join(d, "model.safetensors")).items())


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_topk_softmax(renormalize):
    logits = torch.randn(9, 12, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits, 3, renormalize, None)
    probs = torch.softmax(logits, -1)
    want_w, want_ids = probs.topk(3, -1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)


# ---- the fused Triton path against the torch path -------------------------------------------

# (tokens, experts, top_k, hidden, intermediate): experts left without tokens, an expert with
# more tokens than one BLOCK_M block, sizes that are no multiple of the tiles, top-1.
SHAPES = [(1, 8, 2, 32, 16), (7, 6, 3, 40, 24), (24, 3, 2, 32, 48), (3, 4, 1, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_route_matches_torch(shape, renormalize):
    t, e, k, _, _ = shape
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t)).to(DEV)
    weights, ids, ranks = fm.route(logits, k, renormalize)
    want_w, want_ids = route(logits, k, renormalize, None)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-6)
    # Ranks number each expert's pairs 0, 1, 2...: every (expert, rank) pair once.
    flat = ids.flatten().tolist()
    seen = sorted(zip(flat, ranks.tolist()))
    assert seen == sorted((x, r) for x in set(flat) for r in range(flat.count(x)))
    fm.align(ids.flatten(), ranks, e, 16)  # consumes the counts the route left
    assert not fm._counts(logits.device)[:e].any()


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_sorts_pairs_by_expert(block_m):
    gen = torch.Generator().manual_seed(1)
    e, n = 5, 70  # four experts hit, most with more rows than one block
    ids = torch.randint(0, e, (n,), generator=gen, dtype=torch.int32)
    ids[ids == 3] = 2  # expert 3 gets nothing
    ids = ids.to(DEV)
    ranks = fm.count(ids, e)
    sorted_ids, expert_ids, num_post = fm.align(ids, ranks, e, block_m)
    total = int(num_post)
    counts = torch.bincount(ids.cpu().long(), minlength=e)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())
    sorted_ids, expert_ids = sorted_ids.cpu(), expert_ids.cpu()
    real = sorted_ids[:total]
    assert sorted(real[real < n].tolist()) == list(range(n))  # each pair once
    assert (sorted_ids[total:] == n).all()  # the rest is sentinel
    for b in range(total // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < n].long()
        assert (ids.cpu()[rows] == expert_ids[b]).all(), f"block {b}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_experts_match_torch_float32(shape):
    t, e, k, h, inter = shape
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(t, h, generator=gen).to(DEV)
    w13, w2 = _experts(e, h, inter, device=DEV)
    logits = torch.randn(t, e, generator=gen).to(DEV)
    weights, ids = route(logits, k, True, None)
    want = moe_torch(x, w13, w2, weights, ids)
    got = fm.fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # The whole forward (routing on the device too).
    got = fm.fused_moe(x, w13, w2, logits, k, True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_fused_moe_no_tokens():
    w13, w2 = _experts(4, 16, 16, device=DEV)
    x = torch.empty(0, 16, device=DEV)
    assert fm.fused_moe(x, w13, w2, torch.empty(0, 4, device=DEV), 2, True).shape == (0, 16)


def test_too_many_experts_refused():
    with pytest.raises(ValueError, match="experts"):
        fm.route(torch.zeros(1, fm.MAX_EXPERTS + 1, device=DEV), 2, True)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(4, 5, 16, 16, True, torch.float32)


# ---- weight loading --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_checkpoint_layout_loads_the_same(arch):
    """transformers 5 keeps experts fused in memory ([E, 2I, H] gate_up, [E, H, I] down): a
    state dict in that layout loads into the same tensors as the per-expert checkpoint."""
    hf = make_moe_hf_model(arch)
    per_expert = load_model(hf.config, CLASSES[arch], SdpaBackend, torch.float32,
                            weights=iter(_hf_state(arch, hf)))
    fused = load_model(hf.config, CLASSES[arch], SdpaBackend, torch.float32,
                       weights=iter(hf.state_dict().items()))
    a, b = per_expert.state_dict(), fused.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_missing_and_misshapen_experts_are_named(tmp_path):
    hf = make_moe_hf_model("qwen3_moe")
    state = _hf_state("qwen3_moe", hf)
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=r"missing.*layers\.2\.mlp\.experts\.w13.*\(5, 1\)"):
        load_model(hf.config, Qwen3MoeForCausalLM, SdpaBackend, torch.float32,
                   weights=((n, t) for n, t in state if n != missing))
    bad = [(n, t[:, :-1] if n == missing else t) for n, t in state]
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj"):
        load_model(hf.config, Qwen3MoeForCausalLM, SdpaBackend, torch.float32, weights=iter(bad))
    extra = [*state, ("model.layers.0.mlp.experts.9.gate_proj.weight", state[0][1])]
    with pytest.raises(ValueError, match=r"experts\.9"):
        load_model(hf.config, Qwen3MoeForCausalLM, SdpaBackend, torch.float32,
                   weights=iter(extra))
    cfg = make_moe_config("qwen3_moe")
    cfg.quantization_config = {"quant_method": "awq", "bits": 4}
    with pytest.raises(ValueError, match="quant_method 'awq'"), torch.device("meta"):
        Qwen3MoeForCausalLM(cfg, SdpaBackend, torch.float32)
    path = make_moe_model("mixtral", tmp_path, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        load_model(path, MixtralForCausalLM, SdpaBackend, torch.float32)


def test_dense_and_sparse_layers_follow_the_config():
    cfg = make_moe_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0],
                          decoder_sparse_step=2)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg, SdpaBackend, torch.float32)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["DecoderMLP", "SparseMoeBlock", "DecoderMLP", "SparseMoeBlock"]


# ---- GPU: real shapes in bfloat16, CUDA graphs ----------------------------------------------

# Qwen3-30B-A3B (128 experts, top 8, 2048 / 768) and Mixtral-8x7B (8, top 2, 4096 / 14336).
GPU_SHAPES = [(128, 8, 2048, 768), (8, 2, 4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 3, 16, 200, 2048])
def test_gpu_fused_moe_bf16_close_to_torch(shape, tokens):
    e, k, h, inter = shape
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=gen).cuda().bfloat16()
    w13, w2 = _experts(e, h, inter, torch.bfloat16, "cuda")
    # float32 logits: bf16 ones tie often among 128 experts, and torch.topk and the kernel may
    # break a tie differently (a different expert, not an error).
    logits = torch.randn(tokens, e, generator=gen).cuda()
    weights, ids = route(logits, k, True, torch.bfloat16)
    want = moe_torch(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = fm.fused_moe(x, w13, w2, logits, k, True, round_weights=True)
    ref = moe_torch(x, w13, w2, weights, ids)  # the torch path in bf16: the error to meet
    err = (got.float() - want).abs().max().item()
    ref_err = (ref.float() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= max(2 * ref_err, 1e-2 * scale), (err, ref_err, scale)


@pytest.mark.gpu
def test_gpu_fused_moe_in_cuda_graph_equals_eager():
    e, k, h, inter = GPU_SHAPES[0]
    w13, w2 = _experts(e, h, inter, torch.bfloat16, "cuda")
    x = torch.randn(8, h, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(8, e, device="cuda", dtype=torch.bfloat16)
    eager = fm.fused_moe(x, w13, w2, logits, k, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fm.fused_moe(x, w13, w2, logits, k, True)  # warm-up: compiles, allocates the scratch
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fm.fused_moe(x, w13, w2, logits, k, True)
    for seed in range(3):  # new inputs in place: the graph routes them afresh
        gen = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(8, h, generator=gen))
        logits.copy_(torch.randn(8, e, generator=gen))
        graph.replay()
        torch.testing.assert_close(out, fm.fused_moe(x, w13, w2, logits, k, True), atol=0, rtol=0)
    assert not torch.equal(out, eager)


def test_expert_hit_stats_count_distinct_experts():
    """What the MoE benchmark reads: distinct experts hit per call, summed, and the calls."""
    fm.expert_hit_stats(DEV, reset=True)
    fm.count_expert_hits(True)
    try:
        w13, w2 = _experts(6, 16, 16, device=DEV)
        x = torch.randn(5, 16, device=DEV)
        ids = torch.tensor([[0, 1], [1, 0], [4, 1], [0, 4], [1, 0]], device=DEV)
        fm.fused_experts(x, w13, w2, torch.full((5, 2), 0.5, device=DEV), ids)
        fm.fused_experts(x[:1], w13, w2, torch.full((1, 2), 0.5, device=DEV), ids[:1])
        assert fm.expert_hit_stats(DEV, reset=True) == (3 + 2, 2)
        assert fm.expert_hit_stats(DEV) == (0, 0)
    finally:
        fm.count_expert_hits(False)


def test_bench_bytes_add_up_to_the_model():
    """The MoE benchmark's byte counts (ember.bench.moe) against the parameters of the model
    built from the Qwen3-30B-A3B config: dense + every expert + the embedding = all of it."""
    import json
    from pathlib import Path

    from ember.bench.moe import moe_bytes

    raw = json.loads((Path(__file__).parents[1] / "ember/configs/qwen3-30b-a3b/config.json").read_text())
    cfg = make_moe_config("qwen3_moe", **{k: v for k, v in raw.items()
                                         if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg, SdpaBackend, torch.bfloat16)
    shape = moe_bytes(cfg, Qwen3MoeForCausalLM)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    total = sum(p.numel() for p in model.parameters()) * 2
    experts = shape["num_sparse_layers"] * cfg.num_experts * shape["expert_bytes"]
    embed = cfg.vocab_size * cfg.hidden_size * 2
    assert shape["dense_bytes"] + experts + embed + norms * 2 == total
    assert 60e9 < total < 62e9  # ~61 GB, as published


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expected_weight_names_are_the_checkpoints(arch):
    hf = make_moe_hf_model(arch)
    with torch.device("meta"):
        model = CLASSES[arch](hf.config, SdpaBackend, torch.float32)
    assert model.expected_weight_names() == {n for n, _ in _hf_state(arch, hf)}


_SM90_SCRIPT = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ember.kernels import fused_moe as fm

def compile_ptx(kernel, sig, consts, opts):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else sig[n] for n in names}
    # As a launch specialises them: pointers 16-byte aligned, sizes and strides multiples of 16.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig
             if n not in ("E", "N", "max_padded", "max_blocks")}
    src = ASTSource(kernel, signature, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

B, I = "*bf16", "*i32"
route = dict(logits_ptr=B, stride_l="i32", ids_ptr=I, weights_ptr="*fp32", ranks_ptr=I,
             counts_ptr=I, E="i32")
for count in (True, False):
    compile_ptx(fm._route_kernel, route, dict(K=8, BLOCK_K=8, BLOCK_E=128, RENORMALIZE=True,
                                              COUNT=count, PDL=True), {})
align = dict(ids_ptr=I, ranks_ptr=I, counts_ptr=I, starts_ptr=I, sorted_ptr=I,
             expert_ids_ptr=I, num_post_ptr=I, stats_ptr="*i64", N="i32", E="i32",
             max_padded="i32", max_blocks="i32")
compile_ptx(fm._align_kernel, align, dict(BLOCK_M=16, BLOCK_E=128, BLOCK_B=32, BLOCK=1024,
                                          STATS=True, PDL=True), dict(num_warps=8))
compile_ptx(fm._sum_k_kernel, dict(src_ptr=B, out_ptr=B, H="i32"),
            dict(K=8, BLOCK=1024, PDL=True), {})
common = dict(w_ptr=B, out_ptr=B, sorted_ptr=I, expert_ids_ptr=I, num_post_ptr=I, N="i32",
              H="i32", INTER="i32", stride_we="i32", stride_wn="i32", stride_o="i32")
for rows in (1, 64, 512, 4096):  # each band of tiles at the Qwen3-30B-A3B shape
    cfg = fm.moe_config(rows * 8, 128, torch.bfloat16, True)
    for kernel, sig, extra, tile in (
            (fm._gemm1_kernel, dict(x_ptr=B, stride_x="i32", **common), dict(K_TOP=8), cfg.gemm1),
            (fm._gemm2_kernel, dict(a_ptr=B, weights_ptr="*fp32", stride_a="i32", **common),
             dict(ROUND_WEIGHT=True), cfg.gemm2)):
        ptx = compile_ptx(kernel, sig, dict(extra, BLOCK_M=cfg.block_m, BLOCK_N=tile.block_n,
                                            BLOCK_K=tile.block_k, PRECISION="tf32", PDL=True),
                          dict(num_warps=tile.num_warps, num_stages=tile.num_stages))
        # The weight stream is software-pipelined (asynchronous copies), or decode would not
        # reach the bandwidth.
        assert "cp.async" in ptx or "cp.async.bulk" in ptx, (kernel.fn.__name__, cfg)
print("ok")
'''


def test_norm_and_router_fuse_at_decode_batch_sizes(monkeypatch):
    """The layer's closing add + norm + router as one kernel gives the unfused path's result;
    the block takes it only for the rows the router's small-batch kernel would take."""
    from ember.kernels import dispatch
    from ember.kernels import rms_norm as rms_norm_kernels
    from ember.layers.moe import SparseMoeBlock
    from ember.layers.norm import RMSNorm

    hidden, experts, inter = 64, 16, 32
    block = SparseMoeBlock(hidden, experts, 4, inter, True, torch.float16).to(DEV)
    norm = RMSNorm(hidden, 1e-6, torch.float16).to(DEV)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(experts, hidden, generator=gen) / hidden**0.5)
        w13, w2 = _experts(experts, hidden, inter, torch.float16, DEV, seed=6)
        block.experts.w13.copy_(w13)
        block.experts.w2.copy_(w2)
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    fused_calls = []
    real = rms_norm_kernels.fused_add_rms_norm_router

    def spy(*args, **kwargs):
        fused_calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(rms_norm_kernels, "fused_add_rms_norm_router", spy)
    monkeypatch.setattr(dispatch, "takes_kernel", lambda x: x.dtype == torch.float16)
    for rows in (1, 3, block.gate.small_batch_max_rows + 1):
        h = torch.randn(rows, hidden, generator=gen).to(DEV, torch.float16)
        residual = torch.randn(rows, hidden, generator=gen).to(DEV, torch.float16)
        with torch.no_grad():
            got, got_residual = block.forward_after_norm(h.clone(), residual, norm)
            x = rms_norm_kernels.fused_add_rms_norm(h, residual, norm.weight, norm.eps)[0]
            want = block.experts(x, torch.nn.functional.linear(x, block.gate.weight))
        assert torch.equal(got_residual, h + residual)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert fused_calls == [1, 3]


@pytest.mark.slow
def test_fused_moe_kernels_compile_for_sm90():
    """The GPU-only paths without a GPU: every fused MoE kernel compiles for an H200 (sm90,
    triton's own ptxas) at the tiles moe_config picks, and the GEMMs' weight loads are
    pipelined. Run in a fresh interpreter: this process may have TRITON_INTERPRET set."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.gpu
def test_expert_hit_stats_read_by_a_device_name_without_index():
    """The benchmark reads the stats with the runner's device, which may be "cuda" while the
    kernels ran on "cuda:0" tensors: both name the same buffer."""
    from ember.kernels.buffers import device_key

    assert device_key("cuda") == device_key(torch.device("cuda", torch.cuda.current_device()))
    fm.expert_hit_stats("cuda:0", reset=True)
    fm.count_expert_hits(True)
    try:
        w13, w2 = _experts(4, 16, 16, device="cuda:0")
        x = torch.randn(2, 16, device="cuda:0")
        ids = torch.tensor([[0, 1], [2, 1]], device="cuda:0")
        fm.fused_experts(x, w13, w2, torch.full((2, 2), 0.5, device="cuda:0"), ids)
        assert fm.expert_hit_stats("cuda", reset=True) == (3, 1)
    finally:
        fm.count_expert_hits(False)


def test_expert_hit_stats_reset_outside_inference_mode():
    """The counter is made inside the engine's inference mode; a benchmark resets it outside."""
    from ember.kernels.buffers import release_scratch

    release_scratch("moe_hit_stats")
    try:
        with torch.inference_mode():
            fm._stats(torch.device("cpu"))[:] = torch.tensor([5, 2])
        assert fm.expert_hit_stats("cpu", reset=True) == (5, 2)
        assert fm.expert_hit_stats("cpu") == (0, 0)
    finally:
        release_scratch("moe_hit_stats")


def test_scratch_buffers_are_keyed_by_the_device_not_its_spelling():
    from ember.kernels.buffers import release_scratch, scratch_buffer

    try:
        first = scratch_buffer("test.key", 4, torch.float32, "cpu")
        assert scratch_buffer("test.key", 4, torch.float32, torch.device("cpu")) is first
    finally:
        release_scratch("test.key")
