"""IncrementalDetokenizer: streamed text equals a full decode, stop strings cut exactly, and the
held-back stream concatenates to the final text; through both decoders (tokenizers' DecodeStream
and the window of two decodes), and the stream for the tokenizers it serves.

Two tokenizers: the default model's (byte-level BPE, from its GGUF) and a small sentencepiece-style
one (Metaspace + byte fallback) trained here, for the leading-space and byte-fallback cases.
"""

from __future__ import annotations

import json
import random

import pytest

from ember import detokenizer
from ember.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world! Ünïcödé — naïve café 😀👍🏽 中文字符 日本語 한국어 ∑∫√ 🤖🦀",
    "  leading  spaces\n\ttabs\r\nand a 🇫🇷 flag, a family 👨‍👩‍👧 and ḁ̶̢ combining marks",
    "<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>",
]


@pytest.fixture(autouse=True, params=["stream", "window"])
def decoder(request, monkeypatch):
    """Every test through each decoder: the window alone where the stream is turned off."""
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "_decode_stream", lambda *args: None)
    return request.param


@pytest.fixture(scope="module")
def tok():
    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def spm_tok():
    """Llama-2-like: Metaspace pre-tokenizer, <0xNN> byte-fallback tokens in the vocabulary (not
    special), a decoder that strips the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def dress(backend: Tokenizer) -> Tokenizer:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + [decoders.Strip(" ", 1, 0)]
        )
        return backend

    corpus = [TEXTS[0], TEXTS[1], "The quick brown fox jumps over the lazy dog."] * 10
    trained = dress(Tokenizer(models.BPE(unk_token="<unk>")))
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(corpus, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):  # what is not in the vocabulary falls back to these
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    backend = dress(
        Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _stream(tok, ids, chunk=1, **kwargs) -> tuple[IncrementalDetokenizer, str]:
    """Feed ids `chunk` at a time; return the detokenizer and the concatenated held-back stream."""
    detok = IncrementalDetokenizer(tok, **kwargs)
    streamed = ""
    for i in range(0, len(ids), chunk):
        detok.append(ids[i : i + chunk])
        streamed += detok.output_text_delta()
        if detok.finished:
            break
    detok.finish()
    return detok, streamed + detok.output_text_delta()


def _random_text(rng: random.Random, extra: str = "") -> str:
    pool = TEXTS[0] + TEXTS[1] + extra * 5
    return "".join(rng.choice(pool) for _ in range(rng.randrange(1, 60)))


@pytest.mark.parametrize("skip", [True, False])
def test_matches_full_decode_default_tokenizer(tok, skip):
    rng = random.Random(0)
    cases = [tok(t).input_ids for t in TEXTS]
    cases += [tok(_random_text(rng)).input_ids for _ in range(150)]
    # Random ids: arbitrary byte sequences, incl. invalid and unfinished UTF-8, and specials.
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))] for _ in range(150)]
    for ids in cases:
        detok, streamed = _stream(
            tok, ids, chunk=rng.choice([1, 1, 2, 5]), skip_special_tokens=skip,
            spaces_between_special_tokens=False,
        )  # fmt: skip
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert detok.text == expected, ids
        assert streamed == expected
        assert detok.token_ids == ids


def test_matches_full_decode_sentencepiece_style(spm_tok):
    rng = random.Random(1)
    byte_ids = {i for t, i in spm_tok.get_vocab().items() if t.startswith("<0x")}
    normal_ids = [i for i in range(len(spm_tok)) if i not in byte_ids]
    # Characters the vocabulary lacks ("ŒĦ✓🐍ジ") come out as <0xNN> byte tokens.
    texts = [_random_text(rng, extra="ŒĦ✓🐍ジ") for _ in range(150)]
    cases = [spm_tok(t, add_special_tokens=False).input_ids for t in texts]
    assert sum(any(i in byte_ids for i in ids) for ids in cases) > 50
    # Random ids without lone byte tokens: ByteFallback turns a whole run of bytes that is not
    # valid UTF-8 into one U+FFFD per byte, including earlier valid ones, which no streaming
    # decoder can know in advance (vLLM has the same limit).
    cases += [[rng.choice(normal_ids) for _ in range(rng.randrange(1, 30))] for _ in range(150)]
    for ids in cases:
        for skip in (True, False):
            detok, streamed = _stream(
                spm_tok, ids, skip_special_tokens=skip, spaces_between_special_tokens=False
            )
            expected = spm_tok.decode(ids, skip_special_tokens=skip)
            assert detok.text == expected == streamed, spm_tok.convert_ids_to_tokens(ids)


def test_leading_space_kept_with_prompt_context(spm_tok):
    prompt = spm_tok("Say hello:", add_special_tokens=False).input_ids
    out = spm_tok(" Hello world", add_special_tokens=False).input_ids
    assert spm_tok.convert_ids_to_tokens(out)[0].startswith("▁")
    without = IncrementalDetokenizer(spm_tok)
    without.append(out)
    assert without.text == spm_tok.decode(out) == "Hello world"
    with_ctx = IncrementalDetokenizer(spm_tok, prompt)
    with_ctx.append(out)
    assert with_ctx.text == " Hello world"
    assert with_ctx.token_ids == out


def test_unfinished_character_is_held_then_flushed(tok):
    ids = tok("🦀").input_ids
    assert len(ids) > 1, "the crab should take several byte tokens"
    detok = IncrementalDetokenizer(tok)
    assert detok.append(ids[:-1]) == ""  # held: the character is not complete
    assert detok.append(ids[-1:]) == "🦀"
    cut = IncrementalDetokenizer(tok)
    cut.append(ids[:-1])
    assert cut.text == ""
    assert cut.finish() == tok.decode(ids[:-1])  # flushed as U+FFFD, like a full decode
    assert cut.finish() == ""  # idempotent


def test_special_tokens(tok):
    ids = tok(TEXTS[2]).input_ids
    skipped, _ = _stream(tok, ids, skip_special_tokens=True)
    assert skipped.text == "user\nHi 😀\nassistant\nParis."
    kept, _ = _stream(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert kept.text == TEXTS[2]
    spaced, streamed = _stream(tok, ids, skip_special_tokens=False)  # vLLM's default: spaced
    assert spaced.text == streamed
    assert spaced.text == (
        "<|im_start|> user\nHi 😀 <|im_end|> \n <|im_start|> assistant\nParis. <|im_end|>"
    )


# ---- stop strings ----------------------------------------------------------------------------

SENTENCE = "The capital of France is Paris. It is a beautiful city, full of art."


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["Paris", "is a", ".", "art.", "city, full"])
def test_stop_string_cut_exactly(tok, stop, include):
    ids = tok(SENTENCE).input_ids
    detok, streamed = _stream(tok, ids, stop=[stop], include_stop_str_in_output=include)
    cut = SENTENCE.index(stop) + (len(stop) if include else 0)
    assert detok.text == SENTENCE[:cut]
    assert streamed == detok.text
    assert detok.stop_string_hit == stop
    # Tokens after the one completing the stop string are not taken.
    n = len(detok.token_ids)
    assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[: n - 1])


def test_stop_string_spanning_two_tokens(tok):
    ids = tok(SENTENCE).input_ids
    stop = "tal of Fr"  # the end of " capital", all of " of", the start of " France"
    assert all(stop not in tok.decode([i]) for i in ids)
    for include in (False, True):
        detok = IncrementalDetokenizer(tok, stop=[stop], include_stop_str_in_output=include)
        pieces = []
        for i in ids:
            detok.append([i])
            pieces.append(detok.output_text_delta())
            if detok.stop_string_hit:
                break
        expected = "The capital of Fr" if include else "The capi"
        assert detok.text == expected
        assert "".join(pieces) == expected  # nothing streamed was cut away afterwards


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok(SENTENCE).input_ids
    detok, _ = _stream(tok, ids, stop=["beautiful", "France", "capital"])
    assert detok.text == "The " and detok.stop_string_hit == "capital"


def test_hold_back_and_release(tok):
    ids = tok(SENTENCE).input_ids
    stop = "not in the text"
    detok = IncrementalDetokenizer(tok, stop=[stop])
    streamed = ""
    for i in ids:
        detok.append([i])
        streamed += detok.output_text_delta()
        # Never more than what cannot start a stop string any more.
        assert len(streamed) == max(0, len(detok.text) - (len(stop) - 1))
    assert detok.stop_string_hit is None and not detok.finished
    detok.finish()
    streamed += detok.output_text_delta()
    assert streamed == detok.text == SENTENCE
    assert detok.output_text_delta() == ""


def test_no_stop_strings_means_no_hold_back(tok):
    ids = tok(SENTENCE).input_ids
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.append([i])
        assert detok.output_text_delta() is not None
        assert detok._output_offset == len(detok.text)
    assert detok.text == SENTENCE


def test_random_stop_strings_stream_consistently(tok):
    rng = random.Random(2)
    for _ in range(100):
        text = _random_text(rng) + " " + _random_text(rng)
        ids = tok(text).input_ids
        full = tok.decode(ids)
        a = rng.randrange(len(full))
        stop = full[a : a + rng.randrange(1, 6)]
        include = rng.random() < 0.5
        detok, streamed = _stream(
            tok, ids, chunk=rng.choice([1, 3]), stop=[stop], include_stop_str_in_output=include
        )
        first = full.index(stop)
        assert detok.text == full[: first + (len(stop) if include else 0)]
        assert streamed == detok.text


# ---- which decoder ---------------------------------------------------------------------------


def test_decoder_choice(tok, spm_tok, decoder, monkeypatch):
    if decoder == "window":
        pytest.skip("about the stream")
    assert IncrementalDetokenizer(tok)._stream is not None
    assert IncrementalDetokenizer(spm_tok, skip_special_tokens=False,
                                  spaces_between_special_tokens=False)._stream is not None
    # vLLM's spaces around kept special tokens, and transformers' clean-up of the decoded text,
    # are not the backend's decode: the window does them.
    assert IncrementalDetokenizer(tok, skip_special_tokens=False)._stream is None
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    assert IncrementalDetokenizer(tok)._stream is None


def test_stream_failure_hands_over_to_the_window(tok, decoder):
    if decoder == "window":
        pytest.skip("about the stream")

    class Failing:
        def __init__(self, stream, fail_at):
            self.stream, self.calls, self.fail_at = stream, 0, fail_at

        def step(self, backend, token_id):
            self.calls += 1
            if self.calls == self.fail_at:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(backend, token_id)

    prompt = tok("Say:").input_ids
    ids = tok(SENTENCE + " 🦀 done").input_ids
    expected = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    for fail_at in range(1, len(prompt) + len(ids) + 1):
        detok = IncrementalDetokenizer(tok, prompt)
        if detok._stream is not None:
            detok._stream = (Failing(*detok._stream), detok._stream[1])
        streamed = "".join(detok.append([i]) for i in ids) + detok.finish()
        assert streamed == detok.text == expected, fail_at


def test_detokenize_benchmark_runs(decoder, tmp_path):
    """ember.bench.detokenize (both decoders, fed a token a step and at the end, its own
    equality checks) at a toy size."""
    if decoder == "window":
        pytest.skip("the benchmark runs both decoders itself")
    from ember.bench import detokenize

    out = tmp_path / "detok.json"
    assert detokenize.main(["--sequences", "8", "--tokens", "16", "--rounds", "1",
                            "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["us_per_token"]) == {"stream", "stream_at_end", "window"}
