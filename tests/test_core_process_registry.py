"""A model registered in user code reaches the engine core when it runs in its own process (the
core process is started with the registry snapshot)."""

from __future__ import annotations

import json

from model_factory import make_tiny_model

from ember import LLM, ModelRegistry, SamplingParams


def test_user_registration_reaches_the_core_process(tmp_path, monkeypatch):
    from ember.models.llama import LlamaForCausalLM

    path = make_tiny_model("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["UserRegisteredLlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    ModelRegistry.register_model("UserRegisteredLlamaForCausalLM", LlamaForCausalLM)
    monkeypatch.setenv("EMBER_ENGINE_PROCESS", "1")
    llm = LLM(str(path), skip_tokenizer_init=True, num_gpu_blocks_override=64)
    try:
        assert llm.llm_engine.client.multiprocess
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert llm.platform == "cpu" and llm.attention_backend
    finally:
        llm.shutdown()
