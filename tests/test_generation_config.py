"""generation_config="auto" (vLLM's default): the model's generation_config.json (or GGUF
sampling metadata) gives the sampling values used when no SamplingParams is passed; "vllm"
ignores it; override_generation_config wins over the file."""

from __future__ import annotations

import json

import pytest
from model_factory import make_tiny_model

from ember import LLM, SamplingParams
from ember.models.loader.generation_config import default_sampling_values

GEN_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "repetition_penalty": 1.1, "max_new_tokens": 7, "bos_token_id": 1}


@pytest.fixture(scope="module")
def tiny_with_gen_config(tmp_path_factory):
    path = make_tiny_model("qwen2", tmp_path_factory.mktemp("gen"))
    (path / "generation_config.json").write_text(json.dumps(GEN_CONFIG))
    return str(path)


def test_auto_reads_the_models_values(tiny_with_gen_config):
    llm = LLM(tiny_with_gen_config, skip_tokenizer_init=True, max_model_len=64,
              num_gpu_blocks_override=32)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.9, 20, 0.05)
    assert params.repetition_penalty == 1.1 and params.max_tokens == 7
    # generate() without SamplingParams uses them: max_new_tokens=7 ends the output at 7 tokens.
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 or out.finish_reason == "stop"
    explicit = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                            SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(explicit[0].outputs[0].token_ids) == 3  # given params are used as they are
    llm.shutdown()


def test_vllm_ignores_it(tiny_with_gen_config):
    llm = LLM(tiny_with_gen_config, skip_tokenizer_init=True, max_model_len=64,
              num_gpu_blocks_override=32, generation_config="vllm")
    assert llm.get_default_sampling_params() == SamplingParams()
    llm.shutdown()


def test_override_and_folder(tiny_with_gen_config, tmp_path):
    values = default_sampling_values(tiny_with_gen_config, "auto", {"temperature": 0.0,
                                                                     "max_new_tokens": 3})
    assert values["temperature"] == 0.0 and values["max_tokens"] == 3 and values["top_p"] == 0.9
    assert default_sampling_values(tiny_with_gen_config, "vllm", {"top_k": 5}) == {"top_k": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert default_sampling_values(tiny_with_gen_config, str(tmp_path)) == {"temperature": 0.3}
    # A folder without the file gives nothing; a model without one gives nothing.
    assert default_sampling_values(str(tmp_path / ".."), "auto") == {}


def test_bad_values_are_refused(tiny_with_gen_config, tmp_path):
    with pytest.raises(ValueError, match="generation_config must be"):
        LLM(tiny_with_gen_config, skip_tokenizer_init=True, generation_config="nonsense")
    with pytest.raises(ValueError, match="default sampling values"):
        default_sampling_values(tiny_with_gen_config, "auto", {"top_p": 7.0})
    with pytest.raises(ValueError, match="default sampling values"):
        default_sampling_values(tiny_with_gen_config, "auto", {"not_a_field": 1})


def test_gguf_sampling_metadata(tmp_path):
    """A GGUF file's general.sampling.* keys are its generation config; none gives nothing."""
    from test_gguf import write_gguf

    plain = tmp_path / "plain.gguf"
    write_gguf(plain, "llama", tied=True)
    assert default_sampling_values(str(plain), "auto") == {}
    tuned = tmp_path / "tuned.gguf"

    def sampling_keys(writer):  # write_gguf's hook for extra metadata
        writer.add_float32("general.sampling.temp", 0.7)
        writer.add_int32("general.sampling.top_k", 40)

    write_gguf(tuned, "llama", tied=True, tokenizer=sampling_keys)
    values = default_sampling_values(str(tuned), "auto")
    assert values["top_k"] == 40 and values["temperature"] == pytest.approx(0.7)
