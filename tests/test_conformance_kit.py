"""ember.testing must catch broken plugins: each check passes on a correct implementation and
fails, naming the case, on a deliberately wrong one."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from ember.attention_backends.sdpa import SdpaBackend, SdpaImpl
from ember.models.llama import LlamaForCausalLM
from ember.testing import (
    AttentionGrid,
    check_attention_backend,
    check_model_against_transformers,
    check_quantization_method,
)

SMALL = AttentionGrid(heads=((4, 2),), head_sizes=(32,))


class ForgetsContextImpl(SdpaImpl):
    """Wrong: drops every earlier cached key (as if the block table were ignored)."""

    def forward(self, query, key, value, kv_cache, metadata):
        kv_cache.zero_()
        return super().forward(query, key, value, kv_cache, metadata)


class ForgetsContext(SdpaBackend):
    @classmethod
    def impl_cls(cls):
        return ForgetsContextImpl


class WrongGqaImpl(SdpaImpl):
    """Wrong: maps query heads to kv heads round-robin instead of in groups."""

    def forward(self, query, key, value, kv_cache, metadata):
        n, h, d = query.shape
        group = self.num_heads // self.num_kv_heads
        perm = torch.arange(h).view(group, self.num_kv_heads).t().reshape(-1)
        out = super().forward(query[:, perm], key, value, kv_cache, metadata)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(h)
        return out.view(n, h, d)[:, inverse].reshape(n, h * d)


class WrongGqa(SdpaBackend):
    @classmethod
    def impl_cls(cls):
        return WrongGqaImpl


def test_reference_passes_against_itself():
    assert all(x.startswith("ok") for x in check_attention_backend(SdpaBackend, grid=SMALL))


def test_backend_that_loses_cached_context_fails_naming_the_case():
    with pytest.raises(AssertionError, match=r"ForgetsContext differs .*\[decode"):
        check_attention_backend(ForgetsContext, grid=dict(heads=((4, 2),), head_sizes=(32,),
                                                          scenarios=("decode",)))


def test_backend_with_wrong_gqa_mapping_fails():
    with pytest.raises(AssertionError, match="WrongGqa differs"):
        check_attention_backend(WrongGqa, grid=SMALL)


class Int8PerChannel:
    """A toy int8 weight-only method: per-output-channel scales."""

    def quantize(self, w):
        scale = w.abs().amax(1, keepdim=True).float() / 127
        return {"q": torch.round(w.float() / scale).to(torch.int8), "scale": scale}

    def dequantize(self, state):
        return state["q"].float() * state["scale"]

    def apply(self, state, x, bias=None):
        y = (x.float() @ state["q"].float().T) * state["scale"].T
        return (y + (bias.float() if bias is not None else 0)).to(x.dtype)


class Int8ForgetsScale(Int8PerChannel):
    def apply(self, state, x, bias=None):
        return (x.float() @ state["q"].float().T).to(x.dtype)


def test_quantization_check():
    lines = check_quantization_method(Int8PerChannel, max_weight_error=0.05)
    assert len(lines) == 2
    with pytest.raises(AssertionError, match="differs from x @ dequantize"):
        check_quantization_method(Int8ForgetsScale())
    with pytest.raises(AssertionError, match="round-trip|changes the"):
        check_quantization_method(Int8PerChannel, max_weight_error=1e-6)


def _llama_config():
    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, initializer_range=0.1)


class LlamaWithoutRope(LlamaForCausalLM):
    """Wrong: positions ignored (every token at position 0)."""

    def forward(self, input_ids, positions, ctx):
        return super().forward(input_ids, torch.zeros_like(positions), ctx)


def test_model_check_passes_for_ember_llama_and_catches_a_broken_one():
    lines = check_model_against_transformers("LlamaForCausalLM", _llama_config(),
                                             max_new_tokens=4)
    assert len(lines) == 3
    config = _llama_config()
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(AssertionError, match="LlamaForCausalLM: logits of prompt"):
        check_model_against_transformers(LlamaWithoutRope, config, max_new_tokens=4)
