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


class NoImplCls(SdpaBackend.__mro__[1]):  # AttentionBackend itself, impl_cls() not overridden
    name = "no_impl"


class ImplWithoutForward(SdpaBackend):
    @classmethod
    def impl_cls(cls):
        from ember.attention_backends.base import AttentionImpl

        return type("Bare", (AttentionImpl,), {})


class FlatInputImpl(SdpaImpl):
    """Wrong: returns [T, H, D] instead of [T, H * D]."""

    def forward(self, query, key, value, kv_cache, metadata):
        return super().forward(query, key, value, kv_cache, metadata).view(query.shape)


class FlatOutput(SdpaBackend):
    @classmethod
    def impl_cls(cls):
        return FlatInputImpl


class WritesPaddingImpl(SdpaImpl):
    """Wrong: stores K/V at slot -1 (the last slot of the cache) instead of skipping it."""

    def forward(self, query, key, value, kv_cache, metadata):
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
        pad = metadata.slot_mapping < 0
        if pad.any():
            flat[0, -1] = key[pad][-1]
        return super().forward(query, key, value, kv_cache, metadata)


class WritesPadding(SdpaBackend):
    @classmethod
    def impl_cls(cls):
        return WritesPaddingImpl


class GraphSafeSdpa(SdpaBackend):
    """SDPA declared graph-safe, so the kit runs the runner-style padded decode batches."""

    supports_cuda_graphs = True


def test_contract_shape_is_checked_before_any_case():
    with pytest.raises(AssertionError, match="must override the classmethod impl_cls"):
        check_attention_backend(NoImplCls, grid=SMALL)
    with pytest.raises(AssertionError, match="does not override forward"):
        check_attention_backend(ImplWithoutForward, grid=SMALL)
    with pytest.raises(AssertionError, match=r"expected \[T, num_heads \* head_size\]"):
        check_attention_backend(FlatOutput, grid=SMALL)


def test_a_write_at_slot_minus_one_fails():
    with pytest.raises(AssertionError, match="changed the KV cache in a step whose slots are all -1"):
        check_attention_backend(WritesPadding, grid=SMALL)


def test_padded_decode_batches_are_built_as_the_graph_runner_builds_them():
    from ember.testing.attention import _Allocator, build_step_metadata

    alloc = _Allocator(4)
    for req in (0, 1):
        alloc.start(req, None)
    build_step_metadata(alloc, [(0, 3), (1, 5)], torch.device("cpu"), None)
    md, _ = build_step_metadata(alloc, [(0, 1), (1, 1)], torch.device("cpu"), pad_to=4)
    assert md.num_actual_tokens == 2 and md.num_decode_tokens == 4
    assert md.slot_mapping.tolist()[2:] == [-1, -1]
    assert md.seq_lens_cpu == [4, 6, 0, 0] and md.query_start_loc_cpu == [0, 1, 2, 3, 4]
    assert md.block_table[2:].eq(0).all()
    lines = check_attention_backend(GraphSafeSdpa, grid=dict(
        heads=((4, 2),), head_sizes=(32,), scenarios=("padded_decode",)))
    assert lines and all(line.startswith("ok") for line in lines)


def test_backend_with_wrong_gqa_mapping_fails():
    with pytest.raises(AssertionError, match="WrongGqa differs"):
        check_attention_backend(WrongGqa, grid=SMALL)


class Int8PerChannel:
    """A toy int8 weight-only method: per-output-channel scales."""

    def quantize(self, w):
        scale = (w.abs().amax(1, keepdim=True).float() / 127).clamp(min=1e-12)  # zero rows
        return {"q": torch.round(w.float() / scale).to(torch.int8), "scale": scale}

    def dequantize(self, state):
        return state["q"].float() * state["scale"]

    def apply(self, state, x, bias=None):
        y = (x.float() @ state["q"].float().T) * state["scale"].T
        return (y + (bias.float() if bias is not None else 0)).to(x.dtype)


class Int8ForgetsScale(Int8PerChannel):
    def apply(self, state, x, bias=None):
        return (x.float() @ state["q"].float().T).to(x.dtype)


class Int8DividesByZero(Int8PerChannel):
    """Wrong: the scale of an all-zero row is 0, and 0 / 0 is NaN."""

    def quantize(self, w):
        scale = w.abs().amax(1, keepdim=True).float() / 127
        return {"q": torch.round(w.float() / scale).to(torch.int8), "scale": scale}


def test_quantization_check():
    lines = check_quantization_method(Int8PerChannel, max_weight_error=0.05)
    assert len(lines) == 2
    with pytest.raises(AssertionError, match="differs from x @ dequantize"):
        check_quantization_method(Int8ForgetsScale())
    with pytest.raises(AssertionError, match="round-trip|changes the"):
        check_quantization_method(Int8PerChannel, max_weight_error=1e-6)


def test_quantization_check_catches_a_divide_by_zero_on_an_all_zero_row():
    with pytest.raises(AssertionError, match=r"quantize computes NaN or inf \(in .*\).*all zeros"):
        check_quantization_method(Int8DividesByZero())


def test_builtin_int8_passes_the_kit():
    assert check_quantization_method("int8", max_weight_error=0.05)


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


class IgnoresWindowImpl(SdpaImpl):
    """Wrong: attends to every earlier key even when the layer has a sliding window."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads, sliding_window=None,
                 logits_soft_cap=None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, None, logits_soft_cap)


class IgnoresWindow(SdpaBackend):
    @classmethod
    def impl_cls(cls):
        return IgnoresWindowImpl


def test_default_grid_follows_the_registration():
    from ember.registry import AttentionBackendRegistry, isolated
    from ember.testing.attention import default_grid

    assert default_grid(IgnoresWindow).sliding_windows == (None,)  # not registered
    with isolated():
        AttentionBackendRegistry.register_backend("ignores_window", IgnoresWindow,
                                                  devices=["cpu"], dtypes=["float32"],
                                                  head_sizes=[32], sliding_window=True)
        grid = default_grid(IgnoresWindow)
        assert grid.sliding_windows == (None, 7) and grid.head_sizes == (32,)
        with pytest.raises(AssertionError, match=r"IgnoresWindow differs .*window=7"):
            check_attention_backend(IgnoresWindow)
