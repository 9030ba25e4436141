"""ember-gemma against transformers' GemmaForCausalLM, through ember's conformance kit.

The model is resolved by name through ember's registry, so these tests also show the plugin is
installed and registered (run examples/plugins/install.sh first)."""

import pytest
from transformers import GemmaConfig

from ember.testing import check_model_against_transformers


def tiny_gemma(**overrides):
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=128, initializer_range=0.1)
    config.update(overrides)
    return GemmaConfig(**config)


@pytest.mark.parametrize("overrides", [
    {},  # GQA
    {"num_key_value_heads": 1},  # MQA, like Gemma-2B
    {"num_key_value_heads": 4, "attention_bias": True, "head_dim": 16},
], ids=["gqa", "mqa", "mha-bias"])
def test_gemma_matches_transformers_float32(overrides):
    lines = check_model_against_transformers("GemmaForCausalLM", tiny_gemma(**overrides))
    assert len(lines) == 3


def test_gemma_bfloat16_stays_close():
    check_model_against_transformers("GemmaForCausalLM", tiny_gemma(), dtype="bfloat16",
                                     max_new_tokens=4, tie_margin=float("inf"))


def test_gemma_through_another_backend():
    # The model only talks to ember's Attention layer, so any backend works under it.
    check_model_against_transformers("GemmaForCausalLM", tiny_gemma(),
                                     attention_backend="paged_torch")
