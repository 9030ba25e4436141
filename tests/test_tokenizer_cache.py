"""The disk cache of GGUF tokenizers (ember.tokenizer_cache): a later load reads the saved
tokenizer instead of converting the GGUF vocabulary, and gives the same tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from ember import tokenizer as tokenizer_mod
from ember import tokenizer_cache
from ember.default_model import default_model_path

TEXTS = ["Hello world", "  leading spaces and\ttabs\n", "naïve café 東京 🙂", "<|im_start|>x",
         "def f(x):\n    return x ** 2  # code", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    tokenizer_mod._cache.clear()  # the per-process cache would hide the disk
    yield tmp_path
    tokenizer_mod._cache.clear()


def _same(a, b) -> None:
    assert type(a) is type(b) and len(a) == len(b) and a.name_or_path == b.name_or_path
    for text in TEXTS:
        ids = a(text)["input_ids"]
        assert b(text)["input_ids"] == ids
        assert b.decode(ids) == a.decode(ids)
    assert (b.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
            == a.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(b, name) == getattr(a, name), name
    assert b.all_special_ids == a.all_special_ids


def test_second_load_reads_the_saved_tokenizer(cache_root, monkeypatch):
    path = default_model_path()
    converted = tokenizer_mod.load_tokenizer(path)
    entry = tokenizer_cache.entry_dir(path)
    assert entry.startswith(str(cache_root)) and os.path.isfile(
        os.path.join(entry, "ember_tokenizer_cache.json"))
    tokenizer_mod._cache.clear()

    def no_conversion(_path):
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(tokenizer_mod, "_load_gguf", no_conversion)
    _same(converted, tokenizer_mod.load_tokenizer(path))


def test_damaged_entry_is_converted_again_and_replaced(cache_root):
    path = default_model_path()
    reference = tokenizer_mod.load_tokenizer(path, cache=False)
    entry = tokenizer_cache.entry_dir(path)
    os.makedirs(entry)
    with open(os.path.join(entry, "ember_tokenizer_cache.json"), "w") as f:
        json.dump({"class": "NoSuchTokenizer", "name_or_path": "x"}, f)
    _same(reference, tokenizer_mod.load_tokenizer(path))
    with open(os.path.join(entry, "ember_tokenizer_cache.json")) as f:
        assert json.load(f)["class"] == type(reference).__name__


def test_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", "off")
    tokenizer_mod._cache.clear()
    try:
        assert tokenizer_cache.entry_dir(default_model_path()) is None
        tokenizer_mod.load_tokenizer(default_model_path())
    finally:
        tokenizer_mod._cache.clear()
    assert not any(tmp_path.iterdir())


def test_later_loads_unpickle_and_an_entry_without_the_pickle_gets_it(cache_root, monkeypatch):
    """The entry holds the pickled tokenizer (read by the same library versions only); an entry
    written without it (or by other versions) is read through save_pretrained's files and
    rewritten with it; every load hands out its own tokenizer, the same as converted."""
    path = default_model_path()
    converted = tokenizer_mod.load_tokenizer(path, cache=False)
    first = tokenizer_mod.load_tokenizer(path)
    entry = tokenizer_cache.entry_dir(path)
    assert os.path.isfile(os.path.join(entry, "tokenizer.pkl"))
    tokenizer_mod._cache.clear()
    monkeypatch.setattr(tokenizer_mod, "_load_gguf", lambda _path: pytest.fail("converted"))
    unpickled = tokenizer_mod.load_tokenizer(path)
    again = tokenizer_mod.load_tokenizer(path)
    assert unpickled is not again and unpickled is not first
    for loaded in (first, unpickled, again):
        _same(converted, loaded)
    # Other library versions: the files are read, and the entry gets bytes of these versions.
    marker = os.path.join(entry, "ember_tokenizer_cache.json")
    with open(marker) as f:
        meta = json.load(f)
    meta["pickled_with"] = "transformers 0.0, tokenizers 0.0"
    with open(marker, "w") as f:
        json.dump(meta, f)
    tokenizer_mod._cache.clear()
    assert tokenizer_cache.load_pickled(path) is None
    _same(converted, tokenizer_mod.load_tokenizer(path))
    assert tokenizer_cache.load_pickled(path) is not None
