"""A word-level tokenizer for dummy-weight models, whose config directories hold no tokenizer.

`ember serve` needs a tokenizer to stream text, and a benchmark must run the real config (its
vocabulary size sets the embedding and LM-head cost). So we write a model directory holding the
config and a tokenizer whose vocabulary is the words ``w0 .. w{N-1}`` (N = the config's
``vocab_size``, id i is ``wi``) plus one ``<unk>`` at id N, split on whitespace: every id the model
can produce decodes to a word, every such word encodes back to its id, and text made of other words
encodes to ``<unk>``, which the server rejects as out of the vocabulary instead of feeding it to the
model. No special tokens are registered (a skipped special token would stream an empty chunk), so
EOS comes from the config alone.

The same directory serves `ember bench serve` and `ember bench throughput --model DIR`, so offline
and served runs see the same model. Command line:

    python -m ember.bench.word_tokenizer CONFIG_DIR OUT_DIR     # prints OUT_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

UNK_TOKEN = "<unk>"
# Files besides config.json that describe the model and are worth keeping in the copy.
_MODEL_FILES = ("config.json", "generation_config.json")
# Any of these in a model directory means it already has a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def has_tokenizer(model_dir: str) -> bool:
    return any(os.path.exists(os.path.join(model_dir, name)) for name in _TOKENIZER_FILES)


def word_of(token_id: int) -> str:
    return f"w{token_id}"


def build_word_tokenizer(vocab_size: int):
    """A `PreTrainedTokenizerFast` over ``w0 .. w{vocab_size-1}`` and ``<unk>`` (id vocab_size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word_of(i): i for i in range(vocab_size)}
    vocab[UNK_TOKEN] = vocab_size
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Words joined by one space: decoding a window of ids and then a longer one gives the
    # longer text as an extension of the shorter, which incremental detokenization relies on.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK_TOKEN,
                                   clean_up_tokenization_spaces=False)


def write_word_tokenizer_model(config_dir: str, out_dir: str | None = None) -> str:
    """Copy the model files of `config_dir` into `out_dir` (a new temporary directory when None)
    and save a word-level tokenizer of the config's vocabulary size beside them; returns out_dir.
    Weights are not copied: the directory is meant for ``--load-format dummy``."""
    with open(os.path.join(config_dir, "config.json")) as f:
        config = json.load(f)
    vocab_size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not vocab_size:
        raise ValueError(f"{config_dir}/config.json has no vocab_size")
    if out_dir is None:
        name = os.path.basename(os.path.normpath(config_dir))
        out_dir = tempfile.mkdtemp(prefix=f"ember-words-{name}-")
    os.makedirs(out_dir, exist_ok=True)
    for name in _MODEL_FILES:
        source = os.path.join(config_dir, name)
        if os.path.exists(source):
            shutil.copyfile(source, os.path.join(out_dir, name))
    build_word_tokenizer(int(vocab_size)).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(write_word_tokenizer_model(argv[0], argv[1] if len(argv) == 2 else None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
