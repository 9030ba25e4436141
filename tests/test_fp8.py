"""fp8 (W8A8) linear layers: the per-token activation kernel, checkpoint configs, refusals, and on
the GPU the layers and whole models against their bf16 references.

On the CPU: ember.kernels.fp8_quant under TRITON_INTERPRET=1 against torch's cast; the per-channel
quantization at load; which compressed-tensors / fp8 configs load and which are refused; and the
refusal of the CPU platform itself. ``gpu``: ember.testing's quantization check (fp8 layers
against x @ dequantized.T, within a bound that covers activation quantization), fp8 checkpoints
of both layouts, and LLM(quantization="fp8") on a bf16 model against the bf16 model (the test
prints the logit error and greedy agreement).
"""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from model_factory import make_tiny_model  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402
from ember.kernels.fp8_quant import per_token_fp8  # noqa: E402
from ember.quantization.fp8 import (  # noqa: E402
    ACTIVATION_GROUP,
    Fp8LinearMethod,
    Fp8Quantization,
    per_token_fp8_torch,
    quantize_weight_per_channel,
)
from ember.testing import check_quantized_linear  # noqa: E402
from ember.testing.quantized_checkpoints import (  # noqa: E402
    fp8_tensors,
    quantization_config,
    write_quantized_checkpoint,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_fp8_equals_torch(dtype):
    x = (torch.randn(5, 300) * torch.tensor([[1.0], [1e-3], [30.0], [0.0], [1.0]])).to(dtype)
    x[4, 7] = 200.0  # one outlier sets its row's scale
    q, scales = per_token_fp8(x.to(DEV))
    assert q.dtype == FP8 and scales.shape == (5, 1) and scales.dtype == torch.float32
    want_scale = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    torch.testing.assert_close(scales.cpu(), want_scale, rtol=0, atol=0)
    want_q = (x.float() * (1.0 / want_scale)).clamp(-448, 448).to(FP8)
    assert torch.equal(q.cpu().float(), want_q.float())
    assert q[3].float().abs().max() == 0  # an all-zero row: zeros, no NaN
    q_torch, scales_torch = per_token_fp8_torch(x.to(DEV))  # the compile-time path
    assert torch.equal(q_torch.float(), q.float())
    # torch's CUDA division may round its last bit differently from the kernel's.
    torch.testing.assert_close(scales_torch, scales, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV == "cpu", reason="the Triton interpreter multiplies bfloat16 as its bit patterns"))])
@pytest.mark.parametrize("m,n,k,config,bias", [
    (1, 72, 200, (64, 32, 1), False),  # K and N tails
    (3, 64, 256, (64, 64, 3), True),  # K split in three
    (16, 130, 96, (64, 32, 0), False),  # every row; splits filling the SMs
    (5, 128, 512, None, True),  # the tuned tiles
])
def test_fp8_gemv_equals_its_reference(m, n, k, config, bias, dtype):
    """ember.kernels.fp8_gemv (W8A8, x quantized per row and K tile) against the same arithmetic
    in torch (fp8_linear_reference: the same quantized bits, float64 sums): equal to the
    output's rounding; and within W8A8's error of the unquantized product."""
    from ember.kernels.fp8_gemv import fp8_gemv, fp8_gemv_config
    from ember.quantization.fp8 import fp8_linear_reference

    torch.manual_seed(m + n)
    q, scale = quantize_weight_per_channel(torch.randn(n, k))
    x = (torch.randn(m, k) * torch.linspace(0.01, 30, k)).to(dtype)  # tiles of unlike ranges
    x[0, : k // 2] = 0.0  # an all-zero tile row: zeros, no NaN
    b = torch.randn(n).to(dtype) if bias else None
    got = fp8_gemv(x.to(DEV), q.to(DEV), scale.to(DEV), b.to(DEV) if bias else None,
                   config=config).cpu()
    block_k = (config or fp8_gemv_config(n, k))[1]
    want = fp8_linear_reference(x, q, scale, block_k, b)
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    exact = x.double() @ (q.double() * scale.double()[:, None]).T
    if bias:
        exact += b.double()
    assert (got.double() - exact).abs().max() < 0.1 * exact.abs().max()


@pytest.mark.parametrize("m,n,k,config,bias,groups", [
    (1, 72, 200, (64, 32, 1), True, 1),  # K and N tails
    (16, 130, 96, (64, 32, 0), False, 1),  # every row; splits filling the SMs
    (5, 128, 512, None, False, 1),  # the tuned tiles
    (3, 72, 512, (64, 64, 2), True, 4),  # a scale per 128 columns, K split in two
    (16, 64, 256, (64, 32, 0), False, 2),  # a scale per 128 columns, splits filling the SMs
])
def test_fp8_gemv_takes_x_quantized_per_token(m, n, k, config, bias, groups):
    """x already quantized (float8_e4m3fn and one scale per row, or per row and group of
    columns, as a producer kernel writes it): the dot of the two fp8 operands, each K tile's
    scaled by its row's (group's) scale, and the channel's scales."""
    from ember.kernels.fp8_gemv import fp8_gemv

    torch.manual_seed(m + n)
    q, scale = quantize_weight_per_channel(torch.randn(n, k))
    x = torch.randn(m, k) * torch.linspace(0.01, 30, k)
    x[0] = 0.0  # an all-zero row: zeros, no NaN
    xq, x_scale = per_token_fp8_torch(x.reshape(m * groups, k // groups))
    xq, x_scale = xq.reshape(m, k), x_scale.reshape(m, groups)
    b = torch.randn(n).half() if bias else None
    got = fp8_gemv(xq.to(DEV), q.to(DEV), scale.to(DEV), b.to(DEV) if bias else None,
                   config=config, x_scale=x_scale.to(DEV), out_dtype=torch.float16).cpu()
    x_deq = xq.double().reshape(m, groups, -1) * x_scale.double()[:, :, None]
    want = (x_deq.reshape(m, k) @ q.double().T) * scale.double()
    if bias:
        want += b.double()
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    if not bias:
        assert got[0].abs().max() == 0
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    with pytest.raises(AssertionError, match="row scales"):
        fp8_gemv(xq.to(DEV), q.to(DEV), scale.to(DEV))


def test_producers_hand_fp8_layers_quantized_rows(monkeypatch):
    """RMSNorm (with and without the residual add) and SiLU-and-mul, told the fp8 layer they
    feed, write float8_e4m3fn rows and per-token scales equal bit for bit to per_token_fp8 of
    their half-precision output (SiLU-and-mul per group of columns where the layer takes
    that), and the layer computes on them as given; a layer that does not ask, or
    KernelConfig(quantized_producers=False), gets the half-precision rows."""
    from ember.kernels import dispatch, silu_and_mul
    from ember.kernels.config import KernelConfig, use_kernel_config
    from ember.layers.activation import SiluAndMul
    from ember.layers.linear import Linear, QuantizedActivation
    from ember.layers.norm import RMSNorm

    # The kernels' path on the CPU: under the interpreter, float16 (module docstring).
    monkeypatch.setattr(dispatch, "takes_kernel", lambda x: x.dtype == torch.float16)
    torch.manual_seed(0)
    layer = Linear(256, 48, bias=True, dtype=torch.float16, device=DEV,
                   quant_method=Fp8LinearMethod(serialized=False))
    layer.weight.data.copy_(torch.randn(48, 256).half())
    layer.bias.data.copy_(torch.randn(48).half())
    layer.quant_method.process_weights_after_loading(layer)
    norm = RMSNorm(256, 1e-6, torch.float16).to(DEV)
    norm.weight.data.copy_(torch.rand(256).half() + 0.5)
    x, res = torch.randn(5, 256, device=DEV).half(), torch.randn(5, 256, device=DEV).half()

    def check(got, half_rows: torch.Tensor) -> None:
        assert isinstance(got, QuantizedActivation)
        want_q, want_scale = per_token_fp8(half_rows)
        assert torch.equal(got.data.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(got.scale, want_scale)
        y = layer(got)
        want = ((want_q.double() @ layer.weight.double().T) * want_scale.double()
                * layer.weight_scale.double() + layer.bias.double())
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-3 * want.abs().max())

    check(norm(x, quant_for=layer), norm(x))
    got, h = norm.forward_with_residual(x, res, layer)
    half_rows, h_plain = norm.forward_with_residual(x, res)
    assert torch.equal(h, h_plain)
    check(got, half_rows)
    act, gate_up = SiluAndMul(), torch.randn(5, 2 * 256, device=DEV).half() * 4
    check(act(gate_up, quant_for=layer), act(gate_up))
    wide = torch.randn(2, 2 * 20000, device=DEV).half() * 4  # two passes over the row
    q, scale = silu_and_mul.silu_and_mul_fp8(wide)
    want_q, want_scale = per_token_fp8(act(wide))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    # A layer that takes a scale per group of columns (fp8's decode batches: ACTIVATION_GROUP)
    # gets SiLU-and-mul's rows quantized a group at a time, each group as per_token_fp8 would
    # quantize it alone; above its small-batch rows, one scale per row.
    wide_layer = Linear(2048, 64, bias=False, dtype=torch.float16, device=DEV,
                        quant_method=Fp8LinearMethod(serialized=False))
    wide_layer.weight.data.copy_(torch.randn(64, 2048).half())
    wide_layer.quant_method.process_weights_after_loading(wide_layer)
    wide_layer.small_batch_max_rows = 4
    gate_up = torch.randn(3, 2 * 2048, device=DEV).half() * torch.linspace(0.1, 8, 2 * 2048,
                                                                            device=DEV).half()
    assert wide_layer.quantized_input_group(gate_up) == ACTIVATION_GROUP == 1024

    def check_grouped(got, half_rows: torch.Tensor) -> None:
        want_q, want_scale = per_token_fp8(half_rows.reshape(6, 1024))
        assert got.scale.shape == (3, 2)
        assert torch.equal(got.data.view(torch.uint8), want_q.view(torch.uint8).reshape(3, 2048))
        assert torch.equal(got.scale, want_scale.reshape(3, 2))
        y = wide_layer(got)
        x_deq = want_q.double().reshape(3, 2, 1024) * want_scale.double().reshape(3, 2, 1)
        want = (x_deq.reshape(3, 2048) @ wide_layer.weight.double().T
                * wide_layer.weight_scale.double())
        torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-3 * want.abs().max())

    check_grouped(act(gate_up, quant_for=wide_layer), act(gate_up))
    assert wide_layer.quantized_input_group(torch.randn(5, 4096, device=DEV).half()) == 0
    assert act(torch.randn(5, 4096, device=DEV).half(), quant_for=wide_layer).scale.shape == (5, 1)
    plain_layer = Linear(256, 48, bias=False, dtype=torch.float16, device=DEV)
    assert isinstance(norm(x, quant_for=plain_layer), torch.Tensor)
    with use_kernel_config(KernelConfig(quantized_producers=False)):
        assert isinstance(RMSNorm(256, 1e-6, torch.float16).to(DEV)(x, quant_for=layer),
                          torch.Tensor)
        assert isinstance(SiluAndMul()(gate_up, quant_for=layer), torch.Tensor)


def test_weight_quantized_per_channel_at_load():
    weight = torch.randn(48, 64)
    weight[5] = 0.0
    layer_method = Fp8LinearMethod(serialized=False)
    from ember.layers.linear import Linear

    layer = Linear(64, 48, bias=False, quant_method=layer_method, output_sizes=[32, 16])
    layer.weight.data.copy_(weight)
    layer_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (48,)
    deq = layer_method.dequantize_weight(layer)
    assert deq[5].abs().max() == 0
    # e4m3 keeps 3 mantissa bits: at most half a step (1/16 of the value) off per element.
    err = (deq - weight).abs() / weight.abs().amax(1, keepdim=True).clamp(min=1e-12)
    assert err.max() <= 1 / 16
    q, scale = quantize_weight_per_channel(weight)
    assert torch.equal(q.float(), layer.weight.float()) and torch.equal(scale, layer.weight_scale)


def test_checkpoint_configs():
    ct = Fp8Quantization.from_config(quantization_config("fp8", strategy="tensor"))
    assert ct.serialized and not ct.static_input and ct.get_linear_method(None, "lm_head") is None
    static = Fp8Quantization.from_config({"quant_method": "fp8", "activation_scheme": "static",
                                          "ignored_layers": ["model.layers.1.mlp"]})
    assert static.static_input
    assert static.get_linear_method(None, "model.layers.1.mlp.down_proj") is None
    assert static.get_linear_method(None, "model.layers.11.mlp.down_proj") is not None
    assert not Fp8Quantization.from_config({}).serialized  # a float checkpoint, quantized


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu case below covers CUDA")
def test_fp8_layers_on_the_cpu_kernel_path():
    """The layer's own arithmetic (per-token kernel under the interpreter, torch's CPU
    _scaled_mm with row-wise scales) within its bound; the engine still refuses the CPU."""
    lines = check_quantized_linear(
        "fp8", partial(fp8_tensors, strategy="tensor"),
        config=quantization_config("fp8", strategy="tensor"), shapes=(([64, 32], 128),),
        batch_sizes=(1, 7), dtypes=("float16", "bfloat16"), atol=0.1)
    print("\n".join(lines))


@pytest.mark.parametrize("config,match", [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise scales"),
    ({**quantization_config("fp8"), "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
     "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}}, "scheme int4"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "block"}}}}, "'block' fp8 scales"),
    ({**quantization_config("fp8"), "sparsity_config": {"format": "sparse-24-bitmask"}},
     "sparse format 'sparse-24-bitmask'"),
])
def test_unsupported_fp8_configs_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        Fp8Quantization.from_config(config)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only refusal")
def test_fp8_refuses_the_cpu(tmp_path):
    tiny = str(make_tiny_model("llama", tmp_path))
    with pytest.raises(ValueError, match="quantization 'fp8' runs on cuda, not on 'cpu'"):
        LLM(tiny, skip_tokenizer_init=True, max_model_len=64, quantization="fp8")


# ---- on the GPU ------------------------------------------------------------------------------

PROMPTS = [[5, 17, 42, 99, 3, 250, 11, 8, 64, 31], [200, 1, 77, 13, 90]]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_layers_within_their_bound(strategy):
    """W8A8 against x @ dequantized.T: activation rounding (e4m3: up to 1/16 of each element,
    about 2% typical, random signs) keeps the output within 10% of its largest value (a wrong
    scale layout is off by 100% and more); the CPU case measured 2-4%."""
    lines = check_quantized_linear(
        "fp8", partial(fp8_tensors, strategy=strategy),
        config=quantization_config("fp8", strategy=strategy), device="cuda",
        shapes=(([64, 32], 128), ([4096, 1024], 4096)), batch_sizes=(1, 7, 33, 300),
        dtypes=("bfloat16", "float16"), atol=0.1)
    print("\n".join(lines))


@pytest.mark.gpu
def test_fp8_linear_against_the_bf16_linear():
    """A bf16 projection quantized at load (Llama-8B's o_proj shape) against the bf16 layer it
    came from: W8A16 at one row, W8A8 at 64; the errors are printed."""
    from ember.layers.linear import Linear

    torch.manual_seed(0)
    w = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    layer = Linear(4096, 4096, bias=False, dtype=torch.bfloat16, device="cuda",
                   quant_method=Fp8LinearMethod(serialized=False))
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8
    for rows in (1, 64):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        want = torch.nn.functional.linear(x, w).float()
        err = ((layer(x).float() - want).abs().max() / want.abs().max()).item()
        print(f"fp8 vs bf16 linear, {rows} rows: max error {err:.4f} of the largest output")
        assert err < 0.1


def _logits(llm: LLM) -> tuple[list[list[float]], list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    lps = [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in outs]
    return lps, [o.outputs[0].token_ids for o in outs]


def _compare(ref, got) -> tuple[float, float]:
    err = max(abs(a - b) for ra, rb in zip(ref[0], got[0]) for a, b in zip(ra, rb))
    same = sum(a == b for ra, rb in zip(ref[1], got[1]) for a, b in zip(ra, rb))
    return err, same / sum(map(len, ref[1]))


@pytest.mark.gpu
def test_fp8_models_against_bf16(tmp_path):
    """quantization="fp8" on a bf16 checkpoint, and the compressed-tensors checkpoint of the
    same weights, against the bf16 model: prompt-logprob error and greedy agreement, printed."""
    src = str(make_tiny_model("llama", tmp_path, hidden_size=512, intermediate_size=1024,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                              num_hidden_layers=4))
    kw = dict(skip_tokenizer_init=True, max_model_len=128, dtype="bfloat16")
    ref = _logits(LLM(src, **kw))
    at_load = LLM(src, quantization="fp8", **kw)
    layer = at_load.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == FP8
    err_load, same_load = _compare(ref, _logits(at_load))
    at_load.shutdown()
    write_quantized_checkpoint(src, str(tmp_path / "ct"), "fp8", strategy="tensor")
    err_ckpt, same_ckpt = _compare(ref, _logits(LLM(str(tmp_path / "ct"), **kw)))
    print(f"fp8 vs bf16: quantized at load: max prompt-logprob error {err_load:.4f}, greedy "
          f"agreement {same_load:.2f}; per-tensor checkpoint: {err_ckpt:.4f}, {same_ckpt:.2f}")
    # Measured on an H200: 0.85 (per channel) and 1.77 (per tensor) nats at worst over every
    # prompt position of random weights, whose near-uniform logits make logprobs sensitive. A
    # broken path (a scale lost or applied twice) is off by many nats.
    assert err_load < 1.5 and err_ckpt < 3.0


@pytest.mark.gpu
def test_fp8_model_with_quantized_producers(tmp_path, monkeypatch):
    """An fp8 model whose norms and SiLU-and-mul hand its layers quantized rows, and the same
    model with each layer quantizing its own input (KernelConfig(quantized_producers=False)),
    both against the bf16 model: the producers' kernels run only in the first, and its error
    is within the fp8 bound (prompt logprobs, greedy tokens; printed)."""
    from ember.kernels import rms_norm, silu_and_mul
    from ember.kernels.config import KernelConfig, use_kernel_config

    calls = {"rms_norm_fp8": 0, "silu_and_mul_fp8": 0}

    def counting(fn, name: str):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for module, name in ((rms_norm, "rms_norm_fp8"), (silu_and_mul, "silu_and_mul_fp8")):
        monkeypatch.setattr(module, name, counting(getattr(module, name), name))
    src = str(make_tiny_model("llama", tmp_path, hidden_size=512, intermediate_size=1024,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                              num_hidden_layers=4))
    kw = dict(skip_tokenizer_init=True, max_model_len=128, dtype="bfloat16")
    bf16_llm = LLM(src, **kw)
    ref = _logits(bf16_llm)
    bf16_llm.shutdown()
    with use_kernel_config(KernelConfig(quantized_producers=False)):
        plain_llm = LLM(src, quantization="fp8", **kw)
    err_plain, same_plain = _compare(ref, _logits(plain_llm))
    plain_llm.shutdown()
    assert calls == {"rms_norm_fp8": 0, "silu_and_mul_fp8": 0}
    err, same = _compare(ref, _logits(LLM(src, quantization="fp8", **kw)))
    assert calls["rms_norm_fp8"] > 0 and calls["silu_and_mul_fp8"] > 0
    print(f"fp8 vs bf16: quantized producers: max prompt-logprob error {err:.4f}, greedy "
          f"agreement {same:.2f}; each layer quantizing: {err_plain:.4f}, {same_plain:.2f}")
    assert err < 1.5  # the bound of test_fp8_models_against_bf16


_SM90_SCRIPT = r'''
import re
import torch
from sm90_launch import compile_as_launched
from ember.kernels import fp8_gemv as g
from ember.kernels.tuning.nvidia_h200 import TUNING

n = k = 4096
x = torch.randn(1, k).bfloat16()
w, w_scale = torch.randn(n, k).to(torch.float8_e4m3fn), torch.rand(n)
x8, x_scale = x.to(torch.float8_e4m3fn), torch.rand(1, 1)
rules = [(r, False) for r in TUNING.fp8_gemv] + [(r, True) for r in TUNING.fp8_gemv_quantized_x]
for rule, x_fp8, split in [(r, f, s) for r, f in rules for s in (1, 4)]:
    cfg = rule.config._replace(split_k=split)
    (consts, ptx), = compile_as_launched(g, "_fp8_gemv_kernel", lambda: g.fp8_gemv(
        x8 if x_fp8 else x, w, w_scale, config=cfg, x_scale=x_scale if x_fp8 else None))
    assert consts["SPLIT_K"] == split and consts["X_FP8"] == x_fp8, (cfg, consts)
    assert re.search(r"wgmma\.mma_async[^;]*e4m3\.e4m3", ptx), (cfg, "no fp8 wgmma")
    assert re.search(r"cp\.async\.cg\.shared\.global [^;]*, 0x10", ptx), (cfg, "16 B copies")
    assert "ld.local" not in ptx and "st.local" not in ptx, (cfg, "registers spilled")
    # x written in fp8 by the kernel before: no conversion to e4m3 left in the loop.
    assert not x_fp8 or "e4m3x2" not in ptx.split("wgmma")[0], (cfg, "x converted")
print("ok")
'''


@pytest.mark.slow
def test_fp8_gemv_compiles_to_fp8_tensor_cores_for_sm90():
    """Without a GPU: at every tile rule of the H200 tables, launched as fp8_gemv launches it
    (tests/sm90_launch.py), the kernel compiles for sm90 (triton's own ptxas) to fp8 wgmma,
    streams the weight in 16-byte asynchronous copies and spills no registers (a slow-path
    division once did). Run in a fresh interpreter: this process may have TRITON_INTERPRET
    set."""
    from conftest import run_sm90_script

    proc = run_sm90_script(_SM90_SCRIPT)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_scaled_mm_accumulates_as_the_kernel_config_says(monkeypatch):
    """Above the small-batch rows the fp8 GEMM is torch._scaled_mm with fast accumulation (as
    vLLM's sm90 CUTLASS kernels), unless KernelConfig.fp8_fast_accumulation is off."""
    import dataclasses

    from ember.kernels.config import kernel_config, use_kernel_config
    from ember.layers.linear import QuantizedActivation
    from ember.quantization.fp8 import fp8_linear_quantized

    seen = []

    def scaled_mm(a, b, **kwargs):
        seen.append(kwargs["use_fast_accum"])
        return torch.zeros(a.shape[0], b.shape[1], dtype=kwargs["out_dtype"])

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    x = QuantizedActivation(torch.zeros(20, 32, dtype=torch.float8_e4m3fn), torch.ones(20, 1))
    weight, scale = torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(16)
    fp8_linear_quantized(x, weight, scale, None, torch.bfloat16)
    with use_kernel_config(dataclasses.replace(kernel_config(), fp8_fast_accumulation=False)):
        fp8_linear_quantized(x, weight, scale, None, torch.bfloat16)
    assert seen == [True, False]
