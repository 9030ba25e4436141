"""`LLM` end to end through each example plugin (installed by examples/plugins/install.sh):
an OLMo checkpoint (model plugin), attention_backend="paged_torch" (backend plugin), the
cpu_variant platform (platform plugin), and the broken plugin leaving the rest working."""

from __future__ import annotations

import random

import pytest
import torch
from model_factory import make_tiny_model
from plugin_utils import EXAMPLES, examples_installed, last_json, pip_install_target, run_py
from reference import check_greedy_match, ember_top5, hf_greedy

from ember import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not examples_installed(),
                                reason="run examples/plugins/install.sh first")
MAX_NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 6, 19)]


def _executor(llm):
    return llm.llm_engine.executor


def _assert_matches_hf(llm, hf, prompts, label):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        ref = hf_greedy(hf, prompt, MAX_NEW, set())
        check_greedy_match(ref, out.outputs[0].token_ids, ember_top5(out.outputs[0]),
                           f"{label}[{i}]")
    return outputs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return str(path), hf


@pytest.fixture(scope="module")
def tiny_olmo(tmp_path_factory):
    from transformers import OlmoConfig, OlmoForCausalLM

    torch.manual_seed(0)
    config = OlmoConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                        max_position_embeddings=256, initializer_range=0.1, clip_qkv=0.5,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = OlmoForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("olmo") / "tiny-olmo"
    hf.save_pretrained(path, safe_serialization=True)
    return str(path), hf


def test_llm_runs_an_olmo_checkpoint_through_the_model_plugin(tiny_olmo):
    path, hf = tiny_olmo
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=64)
    model = _executor(llm).runner.model
    assert type(model).__module__ == "ember_olmo.model"
    _assert_matches_hf(llm, hf, _prompts(hf.config.vocab_size), "olmo")


def test_llm_with_the_backend_plugin(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=64, attention_backend="paged_torch")
    assert _executor(llm).attn_backend.name == "paged_torch"
    _assert_matches_hf(llm, hf, _prompts(hf.config.vocab_size), "paged_torch")


def test_llm_on_the_platform_plugin(tiny_llama, monkeypatch):
    path, hf = tiny_llama
    with pytest.raises(ValueError, match="cpu_variant.*set EMBER_CPU_VARIANT=1"):
        LLM(path, skip_tokenizer_init=True, max_model_len=64, device="cpu_variant")
    monkeypatch.setenv("EMBER_CPU_VARIANT", "1")
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=64)  # detected: the one OOT platform
    assert _executor(llm).platform.name == "cpu_variant"
    assert _executor(llm).attn_backend.name == "cpu_variant_sdpa"
    _assert_matches_hf(llm, hf, _prompts(hf.config.vocab_size), "cpu_variant")


def test_llm_works_with_the_broken_plugin_installed(tiny_llama, tmp_path):
    path, _ = tiny_llama
    site = tmp_path / "site"
    pip_install_target(EXAMPLES / "ember-broken-plugin", site)
    proc = run_py(f"""
        import json
        from ember import LLM, SamplingParams
        from ember.plugins import get_report
        llm = LLM({path!r}, skip_tokenizer_init=True, max_model_len=64,
                  attention_backend="paged_torch")
        out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}],
                           SamplingParams(temperature=0, max_tokens=4))
        report = {{p.name: p.status for p in get_report().plugins}}
        print(json.dumps([len(out[0].outputs[0].token_ids), report]))
    """, path=[site], EMBER_DISABLE_PROGRESS="1")
    n_tokens, report = last_json(proc)
    assert n_tokens == 4
    assert report == {"broken": "failed", "cpu_variant": "loaded", "olmo": "loaded",
                      "paged_torch": "loaded"}
    assert proc.stderr.count("ember plugin 'broken'") == 1
