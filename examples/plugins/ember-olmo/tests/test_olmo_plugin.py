"""ember-olmo against transformers' OlmoForCausalLM, through ember's conformance kit.

The model is resolved by name through ember's registry, so these tests also show the plugin is
installed and registered (run examples/plugins/install.sh first)."""

import pytest
from transformers import OlmoConfig

from ember.testing import check_model_against_transformers


def tiny_olmo(**overrides):
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.update(overrides)
    return OlmoConfig(**config)


@pytest.mark.parametrize("overrides", [
    {},  # GQA, untied lm_head
    {"clip_qkv": 0.05, "tie_word_embeddings": True},  # OLMo-1B: clamped q/k/v, tied
    {"num_key_value_heads": 4, "attention_bias": True},
], ids=["gqa", "clip-tied", "mha-bias"])
def test_olmo_matches_transformers_float32(overrides):
    lines = check_model_against_transformers("OlmoForCausalLM", tiny_olmo(**overrides))
    assert len(lines) == 3


def test_olmo_bfloat16_stays_close():
    check_model_against_transformers("OlmoForCausalLM", tiny_olmo(), dtype="bfloat16",
                                     max_new_tokens=4, tie_margin=float("inf"))


def test_olmo_through_another_backend():
    # The model only talks to ember's Attention layer, so any backend works under it.
    check_model_against_transformers("OlmoForCausalLM", tiny_olmo(),
                                     attention_backend="paged_torch")
