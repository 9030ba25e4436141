"""Loading: the three formats, and clear ValueErrors for every way a model path can be wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import assert_all_blocks_free
from model_factory import make_tiny_model

from ember import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not found"):
        LLM("/no/such/model")


def test_unknown_architecture_lists_known_ones(tiny_llama, tmp_path):
    target = tmp_path / "weird"
    shutil.copytree(tiny_llama, target)
    config = json.loads((target / "config.json").read_text())
    config["architectures"] = ["FrobnicatorForCausalLM"]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FrobnicatorForCausalLM") as info:
        LLM(str(target), skip_tokenizer_init=True)
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)


def test_truncated_safetensors(tiny_llama, tmp_path):
    target = tmp_path / "cut"
    shutil.copytree(tiny_llama, target)
    weights = next(target.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt|truncated"):
        LLM(str(target), skip_tokenizer_init=True)


def test_garbage_safetensors(tiny_llama, tmp_path):
    target = tmp_path / "garbage"
    shutil.copytree(tiny_llama, target)
    next(target.glob("*.safetensors")).write_bytes(b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="corrupt|truncated"):
        LLM(str(target), skip_tokenizer_init=True)


def test_truncated_gguf(tmp_path):
    from ember.default_model import default_model_path

    data = open(default_model_path(), "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt|truncated"):
        LLM(str(cut))


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))


def test_dummy_weights_from_config_alone(tiny_llama, tmp_path):
    target = tmp_path / "config_only"
    target.mkdir()
    shutil.copy(tiny_llama / "config.json", target / "config.json")
    llm = LLM(str(target), load_format="dummy", skip_tokenizer_init=True, max_model_len=64)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, detokenize=False))
    assert len(out[0].outputs[0].token_ids) == 5
    assert_all_blocks_free(llm)


def test_unknown_llm_argument():
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(not_a_setting=1)
