"""hf_overrides reach the built model for every format: outputs equal HF transformers built with
the same override on a tiny random checkpoint (dict, nested and callable forms)."""

from __future__ import annotations

import pytest
import torch
from model_factory import make_tiny_model
from reference import hf_greedy

from ember import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [11, 3, 99, 140, 17, 250]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("ov")))


def _hf_reference(path: str, **overrides) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **overrides).eval()
    return [hf_greedy(hf, p, MAX_NEW, set()).token_ids for p in PROMPTS]


def _ember(path: str, hf_overrides) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=128, hf_overrides=hf_overrides)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("override", [{"rms_norm_eps": 100.0}, {"num_hidden_layers": 1}])
def test_dict_override_matches_transformers(tiny_llama, override):
    expected = _hf_reference(tiny_llama, **override)
    baseline = _hf_reference(tiny_llama)
    assert expected != baseline  # the override changes the model, so the check means something
    llm, got = _ember(tiny_llama, override)
    assert got == expected
    model = llm.llm_engine.engine_core.executor.runner.model
    if "num_hidden_layers" in override:
        assert len(model.model.layers) == 1  # only layer 0 was built (and read)
    llm.shutdown()


def _one_layer(config):
    config.num_hidden_layers = 1
    return config


def test_callable_override_matches_transformers(tiny_llama):
    expected = _hf_reference(tiny_llama, num_hidden_layers=1)
    llm, got = _ember(tiny_llama, _one_layer)
    assert got == expected
    llm.shutdown()


def test_layers_beyond_the_override_are_not_read(tiny_llama, monkeypatch):
    """With num_hidden_layers=1 only layer 0's tensors come off disk."""
    from ember.models.loader import beyond_num_layers, iter_safetensors, safetensors_files
    from ember.models.loader.formats import load_weights  # noqa: F401 - the path under test

    read: list[str] = []
    import safetensors

    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.inner = real_open(*a, **k)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama)
    config.num_hidden_layers = 1
    names = [n for n, _ in iter_safetensors(safetensors_files(tiny_llama), False,
                                            beyond_num_layers(config))]
    assert names == read
    layers = {n.split(".")[2] for n in read if ".layers." in n}
    assert layers == {"0"}


def test_nested_dict_updates_a_sub_config():
    from transformers import AutoConfig

    from ember.model_resolution import apply_hf_overrides

    config = AutoConfig.for_model("llava", text_config={"model_type": "llama"})
    apply_hf_overrides(config, {"text_config": {"rms_norm_eps": 0.5}})
    assert config.text_config.rms_norm_eps == 0.5
    assert config.text_config.model_type == "llama"


def test_bad_overrides_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="hf_overrides must be a dict or a function"):
        LLM(tiny_llama, skip_tokenizer_init=True, hf_overrides=[("a", 1)])
    with pytest.raises(ValueError, match="must return the"):
        LLM(tiny_llama, skip_tokenizer_init=True, hf_overrides=lambda c: None)


def test_unpicklable_override_with_a_core_process_is_a_clear_error(tiny_llama):
    from ember.config import EngineArgs
    from ember.engine.llm_engine import LLMEngine

    args = EngineArgs(model=tiny_llama, skip_tokenizer_init=True, hf_overrides=lambda c: c)
    try:
        import cloudpickle  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="hf_overrides"):
            LLMEngine(args, multiprocess=True)
    else:
        LLMEngine(args, multiprocess=True).shutdown()


def test_module_level_override_reaches_a_core_process(tiny_llama, monkeypatch):
    monkeypatch.setenv("EMBER_ENGINE_PROCESS", "1")
    llm, got = _ember(tiny_llama, _one_layer)
    try:
        assert llm.llm_engine.client.multiprocess
        assert got == _hf_reference(tiny_llama, num_hidden_layers=1)
    finally:
        llm.shutdown()


def test_gguf_override_reads_only_the_kept_layers(tmp_path, monkeypatch):
    """On a GGUF file too: num_hidden_layers=1 builds one layer and never dequantizes the
    other's tensors."""
    from test_gguf import write_gguf

    import ember.models.loader.gguf as gguf_loader

    path = tmp_path / "two-layers.gguf"
    write_gguf(path, "llama", tied=False)
    read: list[str] = []
    real = gguf_loader._dequantize

    def recording(path_, f, info):
        read.append(info.name)
        return real(path_, f, info)

    monkeypatch.setattr(gguf_loader, "_dequantize", recording)
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=16,
              hf_overrides={"num_hidden_layers": 1, "rms_norm_eps": 0.5})
    assert llm.apply_model(lambda m: (len(m.model.layers), m.model.norm.eps))[0] == (1, 0.5)
    assert {n.split(".")[1] for n in read if n.startswith("blk.")} == {"0"}
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    llm.shutdown()
