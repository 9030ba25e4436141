"""The linear-layer / weight-loading contract: parameters with loading metadata, shard and
tensor-parallel slicing by the default loader, packed parameters, a checkpoint-path method
end to end through LLM, and quantization selection errors."""

from __future__ import annotations

import json

import pytest
import torch
from model_factory import make_tiny_model
from torch import nn

from ember import LLM, SamplingParams
from ember.layers.linear import (
    Linear,
    LinearMethod,
    bind_weight_loaders,
    linear_method_provider,
    set_weight_attrs,
    weight_loader,
)
from ember.quantization.base import QuantizationMethod, resolve_quantization
from ember.registry import QuantizationRegistry
from ember.registry import isolated as registry_isolated


class _Holder(nn.Module):
    def __init__(self, layer: Linear) -> None:
        super().__init__()
        self.proj = layer


def _load(layer: Linear, pname: str, tensor: torch.Tensor, shard: int | None) -> None:
    params = bind_weight_loaders(_Holder(layer))
    param = params[f"proj.{pname}"]
    weight_loader(param)(param, tensor, shard)


def test_unquantized_layer_is_nn_linear_shaped_and_metadata_survives_meta_build():
    with torch.device("meta"):
        layer = Linear(8, 6, bias=True, dtype=torch.float32, output_sizes=[2, 4])
    layer = layer.to_empty(device="cpu")  # new Parameter objects: metadata must come back
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    assert layer.weight.shape == (6, 8) and layer.weight.output_dim == 0
    assert layer.weight.input_dim == 1 and layer.bias.output_dim == 0
    x = torch.randn(3, 8)
    nn.init.normal_(layer.weight), nn.init.normal_(layer.bias)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    with pytest.raises(ValueError, match="unknown weight attribute 'colour'"):
        set_weight_attrs(layer.weight, {"colour": 1})


def test_fused_shards_load_into_their_slices_and_shapes_are_checked():
    layer = Linear(4, 10, bias=False, output_sizes=[6, 2, 2])
    parts = [torch.randn(6, 4), torch.randn(2, 4), torch.randn(2, 4)]
    for i, p in enumerate(parts):
        _load(layer, "weight", p, i)
    assert torch.equal(layer.weight, torch.cat(parts))
    with pytest.raises(ValueError, match=r"weight 'proj.weight' has shape \(3, 4\).*\(2, 4\)"):
        _load(layer, "weight", torch.randn(3, 4), 1)
    with pytest.raises(ValueError, match="shard 3 of a layer with 3 output shards"):
        _load(layer, "weight", torch.randn(2, 4), 3)


def test_tensor_parallel_slices_per_shard_and_along_the_input():
    full_q, full_k = torch.randn(8, 6), torch.randn(4, 6)
    bias_q = torch.randn(8)
    for rank in (0, 1):
        col = Linear(6, 6, bias=True, output_sizes=[4, 2], tp_rank=rank, tp_size=2,
                     tp_split="output")
        _load(col, "weight", full_q, 0), _load(col, "weight", full_k, 1)
        _load(col, "bias", torch.cat([bias_q, torch.zeros(4)])[:8], 0)
        assert torch.equal(col.weight[:4], full_q[rank * 4:(rank + 1) * 4])
        assert torch.equal(col.weight[4:], full_k[rank * 2:(rank + 1) * 2])
        assert torch.equal(col.bias[:4], bias_q[rank * 4:(rank + 1) * 4])
        full_o, bias_o = torch.randn(5, 8), torch.randn(5)
        row = Linear(4, 5, bias=True, tp_rank=rank, tp_size=2, tp_split="input")
        _load(row, "weight", full_o, None), _load(row, "bias", bias_o, None)
        assert torch.equal(row.weight, full_o[:, rank * 4:(rank + 1) * 4])
        assert torch.equal(row.bias, bias_o)  # a row-parallel bias is loaded whole
    with pytest.raises(ValueError, match="tp_split must be one of"):
        Linear(4, 4, tp_split="rows")


class _PackedMethod(LinearMethod):
    """AWQ-like layout: int32 qweight [in, out / 8] packed along the output dim, scales [1, out]."""

    def create_weights(self, layer, input_size, output_sizes, dtype):
        out = sum(output_sizes)
        layer.register_weight("qweight", nn.Parameter(
            torch.zeros(input_size, out // 8, dtype=torch.int32), requires_grad=False),
            {"output_dim": 1, "input_dim": 0, "packed_dim": 1, "packed_factor": 8})
        layer.register_weight("scales", nn.Parameter(torch.zeros(1, out, dtype=dtype),
                                                     requires_grad=False), {"output_dim": 1})

    def apply(self, layer, x, bias):
        raise NotImplementedError


def test_packed_parameters_narrow_by_the_packing_factor():
    layer = Linear(4, 24, bias=False, quant_method=_PackedMethod(), output_sizes=[16, 8])
    q0 = torch.randint(0, 2**30, (4, 2), dtype=torch.int32)
    q1 = torch.randint(0, 2**30, (4, 1), dtype=torch.int32)
    _load(layer, "qweight", q0, 0), _load(layer, "qweight", q1, 1)
    _load(layer, "scales", torch.ones(1, 16), 0), _load(layer, "scales", torch.full((1, 8), 2.0), 1)
    assert torch.equal(layer.qweight, torch.cat([q0, q1], dim=1))
    assert layer.scales[0, :16].eq(1).all() and layer.scales[0, 16:].eq(2).all()


class _HalfStorage(LinearMethod):
    """A checkpoint-path method: stores the weight in float16 and counts its calls."""

    calls = 0

    def create_weights(self, layer, input_size, output_sizes, dtype):
        layer.register_weight("weight", nn.Parameter(
            torch.empty(sum(output_sizes), input_size, dtype=torch.float16), requires_grad=False),
            {"output_dim": 0, "input_dim": 1})

    def process_weights_after_loading(self, layer):
        layer.processed = True

    def apply(self, layer, x, bias):
        type(self).calls += 1
        return torch.nn.functional.linear(x, layer.weight.to(x.dtype), bias)


class _HalfCheckpoint(QuantizationMethod):
    name = "half_ckpt"
    checkpoint_formats = ("half_ckpt",)

    def get_linear_method(self, layer, prefix):
        return _HalfStorage()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("contract")))


def test_checkpoint_method_selected_by_metadata_end_to_end(tiny_llama, tmp_path, caplog):
    import shutil

    quant_dir = tmp_path / "half"
    shutil.copytree(tiny_llama, quant_dir)
    cfg = json.loads((quant_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "half_ckpt"}
    (quant_dir / "config.json").write_text(json.dumps(cfg))
    prompt = {"prompt_token_ids": [5, 17, 42, 99]}
    greedy = SamplingParams(temperature=0, max_tokens=5)
    ref = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=64).generate(prompt, greedy)
    with pytest.raises(ValueError, match="holds half_ckpt-quantized weights.*no registered"):
        LLM(str(quant_dir), skip_tokenizer_init=True, max_model_len=64)
    with registry_isolated():
        QuantizationRegistry.register_quantization_method(
            "half_ckpt", _HalfCheckpoint, checkpoint_formats=["half_ckpt"])
        with caplog.at_level("INFO", logger="ember"):
            llm = LLM(str(quant_dir), skip_tokenizer_init=True, max_model_len=64)
        model = llm.llm_engine.executor.runner.model
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert len(layers) == 4 * 3 and all(m.weight.dtype == torch.float16 for m in layers)
        assert all(getattr(m, "processed", False) for m in layers)
        assert "model weights take" in caplog.text and "half_ckpt, 12 linear layers" in caplog.text
        out = llm.generate(prompt, greedy)
        assert _HalfStorage.calls > 0
        assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
        with pytest.raises(ValueError, match="quantization='int8', but .* holds half_ckpt"):
            LLM(str(quant_dir), skip_tokenizer_init=True, quantization="int8")


def test_selection_errors(tiny_llama):
    from ember.models.loader import load_config

    cfg = load_config(tiny_llama)
    assert resolve_quantization(None, cfg, "m", False) is None
    assert resolve_quantization("int8", cfg, "m", False) == "int8"
    cfg.quantization_config = {"quant_method": "mystery"}
    with pytest.raises(ValueError, match="holds mystery-quantized weights"):
        resolve_quantization(None, cfg, "m", False)
    with pytest.raises(ValueError, match="quantization='none'.*cannot turn back into floats"):
        resolve_quantization("none", cfg, "m", False)


def test_provider_gives_layers_their_method():
    with linear_method_provider(lambda layer, prefix: _PackedMethod() if "q" in prefix else None):
        quant = Linear(8, 8, prefix="x.q_proj")
        plain = Linear(8, 8, prefix="x.o_proj")
    assert isinstance(quant.quant_method, _PackedMethod) and hasattr(quant, "qweight")
    assert type(plain.quant_method).__name__ == "UnquantizedLinearMethod"
