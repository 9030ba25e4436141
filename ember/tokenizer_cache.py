"""A disk cache of the tokenizers ember converts from GGUF files.

Converting a GGUF vocabulary into a transformers tokenizer takes ~1.5 s on the default model
(transformers builds the BPE model from the metadata arrays); loading the same tokenizer saved
with ``save_pretrained`` takes ~0.15 s. The first load of a file saves the converted tokenizer
under ``EMBER_CACHE_DIR`` (ember.envs.cache_dir), keyed by the file's path, size and mtime and
the transformers version; later loads, in any process, read that directory. A cache that cannot
be written or read is skipped (the conversion runs as before), never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING

from ember import envs
from ember.disk_cache import write_entry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("ember")
_MARKER = "ember_tokenizer_cache.json"  # written last: a directory without it is incomplete


def entry_dir(gguf_path: str) -> str | None:
    """This file's cache directory (which may not exist yet), or None when caching is off."""
    from importlib.metadata import version

    root = envs.cache_dir()
    if root is None:
        return None
    st = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{version('transformers')}"
    return os.path.join(root, "gguf-tokenizers", hashlib.sha256(key.encode()).hexdigest()[:32])


def load(gguf_path: str) -> PreTrainedTokenizerBase | None:
    """The cached tokenizer of this GGUF file, or None when there is none (or it is unusable)."""
    directory = entry_dir(gguf_path)
    if directory is None or not os.path.isfile(os.path.join(directory, _MARKER)):
        return None
    try:
        import transformers

        with open(os.path.join(directory, _MARKER)) as f:
            meta = json.load(f)
        # The class by its top-level name: imports its own module only, where transformers'
        # tokenizer_class_from_name imports the auto mappings (~0.6 s).
        tokenizer_cls = getattr(transformers, meta["class"], None)
        if tokenizer_cls is None:
            return None
        tokenizer = tokenizer_cls.from_pretrained(directory, local_files_only=True)
        tokenizer.name_or_path = meta["name_or_path"]  # where it came from, not the cache
        return tokenizer
    except Exception as e:  # a damaged entry: convert again (and overwrite it)
        logger.debug("tokenizer cache entry %s unusable (%s)", directory, e)
        return None


def save(gguf_path: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """Save a freshly converted tokenizer for later loads (best effort)."""
    directory = entry_dir(gguf_path)
    if directory is None:
        return

    def fill(staging: str) -> None:
        tokenizer.save_pretrained(staging)
        with open(os.path.join(staging, _MARKER), "w") as f:  # last: the entry is complete
            json.dump({"class": type(tokenizer).__name__, "gguf": os.path.realpath(gguf_path),
                       "name_or_path": tokenizer.name_or_path}, f)

    write_entry(directory, fill, "tokenizer cache")
