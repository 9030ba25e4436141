"""The disk cache of quantized models as their method's post-load work left them
(ember.quantization.snapshot_cache): the default model's second load takes its packed int4
layers and int8 head from the cache instead of decoding the GGUF blocks, and computes the same
tokens; a damaged entry, other overrides and the cache switched off all load the checkpoint."""

from __future__ import annotations

import os

import pytest

from ember import LLM, SamplingParams
from ember.quantization import gguf as gguf_method
from ember.quantization import snapshot_cache

PROMPTS = [[1, 504, 3458, 314, 253, 1345], [1, 9690, 28, 549, 1056, 314], [2, 30, 31, 32]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture
def loads(tmp_path, monkeypatch):
    """EMBER_CACHE_DIR in a temporary directory; records what each snapshot_cache.load gave
    (True: the model came from the cache)."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    seen: list[bool] = []
    real = snapshot_cache.load

    def recording(*args, **kwargs):
        model = real(*args, **kwargs)
        seen.append(model is not None)
        return model

    monkeypatch.setattr(snapshot_cache, "load", recording)
    return seen


def _run(**kwargs) -> tuple[list[list[int]], dict]:
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(None, skip_tokenizer_init=True, **kwargs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        model = llm.llm_engine.executor.runner.model
        layout = {name: [(p.rows, p.kind) for p in m.gguf_parts]
                  for name, m in model.named_modules() if hasattr(m, "gguf_parts")}
        heads = [name for name, m in model.named_modules()
                 if isinstance(getattr(m, "logits_method", None),
                               (gguf_method.Int8Logits, gguf_method.NativeLogits))]
        # torch's allocator aligns to 64 bytes and its CPU kernels may count on it (the int8
        # matmul faulted on a head restored 8 bytes off); the cache keeps that true.
        head = model.get_submodule(heads[0]).logits_method
        part_buffers = [b for m in model.modules() for p in getattr(m, "gguf_parts", ())
                        for b in p.buffers()]
        assert all(t.data_ptr() % 64 == 0 for t in [*head.buffers(), *part_buffers])
        return [o.outputs[0].token_ids for o in outs], {"layout": layout, "heads": heads}
    finally:
        llm.shutdown()


def _entries(root) -> list[str]:
    base = os.path.join(root, "quantized-models")
    return sorted(os.listdir(base)) if os.path.isdir(base) else []


def test_second_load_is_restored_and_computes_the_same(loads, tmp_path):
    tokens, built = _run()
    assert loads == [False] and len(_entries(tmp_path)) == 1
    again, restored = _run()
    assert loads == [False, True]
    assert again == tokens
    assert restored == built  # the same parts (rows, 4-bit kind) and int8 head
    assert any(kind in ("native", "int4_cpu") for parts in built["layout"].values()
               for _, kind in parts)
    assert built["heads"] == ["model.embed_tokens"]  # tied: the embedding is the head


def test_damaged_entry_loads_the_checkpoint_and_is_replaced(loads, tmp_path):
    tokens, _ = _run()
    (entry,) = _entries(tmp_path)
    path = os.path.join(tmp_path, "quantized-models", entry, "tensors.safetensors")
    with open(path, "r+b") as f:
        f.truncate(1000)
    assert _run()[0] == tokens
    assert loads == [False, False]  # the damaged entry was not used ...
    assert os.path.getsize(path) > 1000  # ... and was written again
    assert _run()[0] == tokens and loads[-1] is True


def test_other_overrides_get_their_own_entry(loads, tmp_path):
    _run()
    _run(hf_overrides={"num_hidden_layers": 2})
    assert loads == [False, False] and len(_entries(tmp_path)) == 2
    _run(max_model_len=128)  # the context limit shapes no weight: the first entry serves
    assert loads[-1] is True and len(_entries(tmp_path)) == 2


def test_dummy_weights_and_a_wrong_load_format_are_not_served_from_the_cache(loads, tmp_path):
    """The cache stands in for reading the file: there is no entry for load_format="dummy"
    (random weights), and a load_format the file does not hold is refused as without a cache."""
    from types import SimpleNamespace

    import torch

    from ember.default_model import default_model_path

    _run(hf_overrides={"num_hidden_layers": 2})
    assert loads == [False] and len(_entries(tmp_path)) == 1
    cfg = SimpleNamespace(load_format="dummy", is_gguf=True, path=default_model_path(),
                          hf_config=SimpleNamespace())
    method = gguf_method.GGUFQuantization()
    assert snapshot_cache.entry_dir(cfg, method, object, torch.float32,
                                    torch.device("cpu")) is None
    with pytest.raises(ValueError, match="holds gguf weights"):
        _run(hf_overrides={"num_hidden_layers": 2}, load_format="safetensors")


def test_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", "off")
    _run(hf_overrides={"num_hidden_layers": 2})
    assert not any(tmp_path.iterdir())


def test_a_recipe_that_does_not_fit_is_not_used(loads, tmp_path, monkeypatch):
    """An entry whose tensors do not match the model built (here: a recipe naming a layer the
    model does not have) is skipped, never an error."""
    _run(hf_overrides={"num_hidden_layers": 2})
    real = gguf_method.GGUFQuantization.restore_snapshot

    def wrong(self, model, recipe, tensors):
        recipe["layers"]["model.layers.9.mlp.down_proj"] = recipe["layers"].popitem()[1]
        return real(self, model, recipe, tensors)

    monkeypatch.setattr(gguf_method.GGUFQuantization, "restore_snapshot", wrong)
    _run(hf_overrides={"num_hidden_layers": 2})
    assert loads == [False, False]


def test_tied_tensors_are_saved_once():
    """safetensors refuses two names for one memory: the second name is kept as an alias."""
    import torch

    shared = torch.arange(6.0).view(2, 3)
    state = {"embed.weight": shared, "head.weight": shared, "norm.weight": torch.ones(3),
             "a.weight": torch.empty(0), "b.weight": torch.empty(0)}
    tensors, aliases = snapshot_cache._unique_tensors(state)
    assert aliases == {"head.weight": "embed.weight"}
    assert set(tensors) == {"embed.weight", "norm.weight", "a.weight", "b.weight"}


def test_least_recently_used_entries_are_evicted(tmp_path):
    import time

    parent = tmp_path / "quantized-models"
    for i, name in enumerate(["old", "used", "new"]):
        entry = parent / name
        entry.mkdir(parents=True)
        (entry / "tensors.safetensors").write_bytes(b"x" * 100)
        (entry / "recipe.json").write_text("{}")
        os.utime(entry / "recipe.json", (time.time() - 100 + i, time.time() - 100 + i))
    os.utime(parent / "used" / "recipe.json")  # a load marked it used just now
    (parent / ".staging-x").mkdir()  # being written: not an entry
    snapshot_cache.evict(str(parent), keep=str(parent / "new"), max_bytes=250)
    assert sorted(os.listdir(parent)) == [".staging-x", "new", "used"]


def test_a_source_tree_without_distribution_metadata_uses_the_cache(loads, tmp_path,
                                                                      monkeypatch):
    """ember run from a source tree on PYTHONPATH (as on a machine it is copied to, not
    installed) has no package metadata: the cache key must not need it."""
    import importlib.metadata

    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    tokens, _ = _run()
    assert loads == [False] and len(_entries(tmp_path)) == 1
    assert _run()[0] == tokens and loads == [False, True]


def test_the_methods_compute_form_is_part_of_the_key(tmp_path, monkeypatch):
    """A CPU with the native kernel and one without never share an entry (each would refuse
    the other's and rewrite it); the native blocks' layout is named in it."""
    from types import SimpleNamespace

    import torch

    from ember.default_model import default_model_path
    from ember.kernels.cpu import quant_linear as native_kernel

    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    cfg = SimpleNamespace(load_format="auto", is_gguf=True, path=default_model_path(),
                          hf_config=SimpleNamespace(num_hidden_layers=2))
    method = gguf_method.GGUFQuantization()
    cpu = torch.device("cpu")
    keys = set()
    for native in (True, False):
        monkeypatch.setattr(gguf_method, "_native_kernel", lambda native=native: native)
        assert method.snapshot_variant(cpu) == (f"native-{native_kernel.LAYOUT}" if native else "")
        keys.add(snapshot_cache.entry_dir(cfg, method, object, torch.float32, cpu))
    assert len(keys) == 2 and None not in keys
