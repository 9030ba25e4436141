"""A disk cache of the tokenizers ember converts from GGUF files.

Converting a GGUF vocabulary into a transformers tokenizer takes ~1.5 s on the default model
(transformers builds the BPE model from the metadata arrays); loading the same tokenizer saved
with ``save_pretrained`` takes ~0.3 s, and unpickling it ~0.08 s. The first load of a file saves
the converted tokenizer under ``EMBER_CACHE_DIR`` (ember.envs.cache_dir), keyed by the file's
path, size and mtime and the transformers version: ``save_pretrained``'s files and the pickled
object (``tokenizer.pkl``, read only by the same transformers and tokenizers versions, else the
files are); later loads, in any process, read that directory. A cache that cannot be written or
read is skipped (the conversion runs as before), never an error. The pickle is ember's own
output in the user's own cache directory, trusted as the packed-model cache is.
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


_PICKLE = "tokenizer.pkl"


def _versions() -> str:
    from importlib.metadata import version

    return f"transformers {version('transformers')}, tokenizers {version('tokenizers')}"


def _entry(gguf_path: str) -> tuple[str, dict] | None:
    """This file's complete cache entry: (its directory, its marker's contents), or None."""
    directory = entry_dir(gguf_path)
    if directory is None:
        return None
    try:
        with open(os.path.join(directory, _MARKER)) as f:
            return directory, json.load(f)
    except (OSError, ValueError):  # none yet, or a damaged marker
        return None


def load_pickled(gguf_path: str) -> bytes | None:
    """The cached tokenizer of this GGUF file as pickled bytes (pickle.loads gives it), or None
    when there are none for these library versions."""
    entry = _entry(gguf_path)
    if entry is None or entry[1].get("pickled_with") != _versions():
        return None
    try:
        with open(os.path.join(entry[0], _PICKLE), "rb") as f:
            return f.read()
    except OSError:
        return None


def load(gguf_path: str) -> PreTrainedTokenizerBase | None:
    """The cached tokenizer of this GGUF file, or None when there is none (or it is unusable)."""
    entry = _entry(gguf_path)
    if entry is None:
        return None
    directory, meta = entry
    try:
        import transformers

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


def save(gguf_path: str, tokenizer: PreTrainedTokenizerBase, pickled: bytes | None = None,
         ) -> None:
    """Save a freshly converted tokenizer for later loads (best effort), with its pickled bytes
    where there are some."""
    directory = entry_dir(gguf_path)
    if directory is None:
        return

    def fill(staging: str) -> None:
        tokenizer.save_pretrained(staging)
        meta = {"class": type(tokenizer).__name__, "gguf": os.path.realpath(gguf_path),
                "name_or_path": tokenizer.name_or_path}
        if pickled is not None:
            with open(os.path.join(staging, _PICKLE), "wb") as f:
                f.write(pickled)
            meta["pickled_with"] = _versions()
        with open(os.path.join(staging, _MARKER), "w") as f:  # last: the entry is complete
            json.dump(meta, f)

    write_entry(directory, fill, "tokenizer cache")
