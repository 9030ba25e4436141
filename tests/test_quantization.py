"""Quantization methods: the built-in int8 passes the conformance kit, runs end to end through
LLM, and a method registered in user code is picked up by name."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model

from ember import LLM, SamplingParams
from ember.quantization.base import QuantizationMethod, QuantizedLinear
from ember.registry import QuantizationRegistry
from ember.registry import isolated as registry_isolated
from ember.testing import check_quantization_method


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("q")))


def test_int8_passes_conformance_kit():
    report = check_quantization_method("int8", dtypes=("float32", "bfloat16"),
                                       max_weight_error=0.02)
    assert report and all(line.startswith("ok") for line in report)


def _quantized_layers(llm) -> list[QuantizedLinear]:
    model = llm.llm_engine.executor.runner.model
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def test_int8_end_to_end_close_to_float(tiny_llama):
    prompts = [{"prompt_token_ids": [5, 17, 42, 99, 7, 3, 250][: n]} for n in (3, 5, 7)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    ref = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=64).generate(prompts, params)
    llm = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=64, quantization="int8")
    layers = _quantized_layers(llm)
    hf_layers = 3  # the tiny model: qkv, o, gate_up, down per layer; lm_head stays float
    assert len(layers) == 4 * hf_layers
    assert all(layer.state[0].dtype == torch.int8 for layer in layers)
    out = llm.generate(prompts, params)
    assert_all_blocks_free(llm)
    # int8 rounding moves logprobs a little, never the first (prompt-conditioned) token much.
    for a, b in zip(ref, out):
        first_ref = a.outputs[0].logprobs[0]
        first_q = b.outputs[0].logprobs[0]
        tok = a.outputs[0].token_ids[0]
        assert tok in first_q and abs(first_q[tok].logprob - first_ref[tok].logprob) < 0.1


class _CountingHalfPrecision(QuantizationMethod):
    """A user method: weights stored in float16; counts its kernel calls."""

    name = "user_fp16"
    calls = 0

    def quantize(self, weight):
        return weight.to(torch.float16)

    def dequantize(self, state):
        return state.float()

    def apply(self, state, x, bias):
        type(self).calls += 1
        return super().apply(state, x, bias)


def test_method_registered_in_user_code_is_used(tiny_llama):
    with registry_isolated():
        QuantizationRegistry.register_quantization_method("user_fp16", _CountingHalfPrecision)
        assert "user_fp16" in QuantizationRegistry.get_supported_quantization_methods()
        llm = LLM(tiny_llama, skip_tokenizer_init=True, max_model_len=64, quantization="user_fp16")
        out = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3
        assert _CountingHalfPrecision.calls > 0
        assert_all_blocks_free(llm)


def test_unknown_quantization_lists_known_methods(tiny_llama):
    with pytest.raises(ValueError, match="unknown quantization method 'nope'.*int8"):
        LLM(tiny_llama, skip_tokenizer_init=True, quantization="nope")
