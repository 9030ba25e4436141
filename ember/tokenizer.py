"""Load the tokenizer of a model: an HF directory (AutoTokenizer) or a GGUF file (vocabulary,
merges, special tokens and chat template read from its metadata by transformers). Never online.

Why not just ``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` for GGUF: for architectures
outside transformers' new GGUF reader (llama among them) it first builds the model config with
``gguf.GGUFReader``, which takes 5-10 s on the default model just to parse the vocabulary array.
We read the architecture with our own parser (~0.2 s), pick the tokenizer class as AutoTokenizer
would for that model type, and let that class read the GGUF (~1.3 s). The result is the same object
AutoTokenizer gives (vocabulary, merges, special tokens, chat template; tests check it). GGUF
tokenizers are also cached per process (keyed by the file's size and mtime) as pickled bytes and
handed out unpickled (~0.08 s), so two engines never share a mutable tokenizer, and on disk
(ember.tokenizer_cache: a later process reads those bytes).
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_CACHE_SIZE = 4
# Pickled bytes, or the tokenizer itself where it does not pickle (handed out as deep copies).
_cache: dict[tuple, bytes | PreTrainedTokenizerBase] = {}
_cache_lock = threading.Lock()


def resolve_gguf_path(model: str, gguf_file: str | None = None) -> str | None:
    """The GGUF file named by (model, gguf_file), or None when the model is not a GGUF checkpoint.

    Accepted: model="x.gguf"; model=dir with gguf_file=name inside it; gguf_file=a full path."""
    if gguf_file is not None:
        if os.path.isabs(gguf_file):
            return gguf_file
        joined = os.path.join(model, gguf_file)
        return joined if os.path.isfile(joined) or not os.path.isfile(gguf_file) else gguf_file
    if model.lower().endswith(".gguf") and not os.path.isdir(model):
        return model
    return None


def load_tokenizer(
    model: str,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    *,
    cache: bool = True,
) -> PreTrainedTokenizerBase:
    """The tokenizer for `model` (an HF directory, cached hub id, or GGUF file), loaded offline."""
    model = os.fspath(model)
    gguf_path = resolve_gguf_path(model, gguf_file)
    if gguf_path is None:
        return _load_hf(model, trust_remote_code)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if not cache:
        return _load_gguf(gguf_path)
    st = os.stat(gguf_path)
    key = (os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is None:
        from ember import tokenizer_cache

        cached = tokenizer_cache.load_pickled(gguf_path)
        if cached is None:
            tokenizer = tokenizer_cache.load(gguf_path)
            converted = tokenizer is None
            if converted:
                tokenizer = _load_gguf(gguf_path)
            cached = _pickled(tokenizer)
            pickled = cached if isinstance(cached, bytes) else None
            if converted or pickled is not None:  # (an entry without bytes gets them)
                tokenizer_cache.save(gguf_path, tokenizer, pickled)
        with _cache_lock:
            while len(_cache) >= _CACHE_SIZE:
                _cache.pop(next(iter(_cache)))
            _cache[key] = cached
    return pickle.loads(cached) if isinstance(cached, bytes) else copy.deepcopy(cached)


def _pickled(tokenizer: PreTrainedTokenizerBase) -> bytes | PreTrainedTokenizerBase:
    """The tokenizer's pickled bytes, or the tokenizer where it does not pickle."""
    try:
        return pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # a tokenizer class of a plugin, say: deep copies then
        return tokenizer


def _load_hf(model: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        # local_files_only: a directory, or a hub id already in the local cache; never a download.
        return AutoTokenizer.from_pretrained(
            model, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except OSError as e:
        raise OSError(
            f"Cannot load a tokenizer from {model!r} offline: ember reads only local directories, "
            f"GGUF files and models already in the Hugging Face cache ({e})"
        ) from e


def _load_gguf(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer, TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    from ember.models.loader.gguf import hf_model_type, read_gguf_header

    header = read_gguf_header(path)  # a damaged file fails here with a clear ValueError
    if "tokenizer.ggml.model" not in header.metadata:
        raise ValueError(
            f"GGUF file {path!r} carries no tokenizer (no tokenizer.ggml.* metadata): "
            "pass a tokenizer directory explicitly"
        )
    directory, name = os.path.split(os.path.abspath(path))
    model_type = hf_model_type(header.architecture)
    if model_type is None:
        # An architecture we do not map: transformers may still know its tokenizer, at the
        # price of its slow metadata parse.
        return AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    # AutoTokenizer's own choice for a GGUF without tokenizer_config.json: the class registered
    # for the model type, else the generic tokenizers-backed class.
    class_name = TOKENIZER_MAPPING_NAMES.get(model_type)
    tokenizer_cls = (tokenizer_class_from_name(class_name) if class_name else None) or (
        TokenizersBackend
    )
    return tokenizer_cls.from_pretrained(directory, gguf_file=name, local_files_only=True)
