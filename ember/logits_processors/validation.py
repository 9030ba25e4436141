"""Front-end checks of a request's sampling parameters against the model (vocabulary, tokenizer,
max_logprobs) and the logits-processor registry; errors are ValueErrors naming the field.

SamplingParams checks what it can alone (types, ranges); this module checks what needs the
engine: token ids inside the vocabulary, bad_words turned into token ids (vLLM's
`update_from_tokenizer`), `extra_args` naming registered processors, and the logprob caps.
"""

from __future__ import annotations

from typing import Any

from ember.sampling_params import SamplingParams


def validate_request_params(params: SamplingParams, *, vocab_size: int, max_logprobs: int,
                            tokenizer: Any, structured_outputs_config: Any = None) -> None:
    """Check `params` for a model with `vocab_size` tokens; fills params._bad_words_token_ids
    and, for structured outputs, the grammar backend that will compile the request."""
    check_logprobs(params, max_logprobs, vocab_size)
    if params.logit_bias:
        _check_in_vocab("logit_bias", list(params.logit_bias), vocab_size)
    if params.allowed_token_ids is not None:
        _check_in_vocab("allowed_token_ids", params.allowed_token_ids, vocab_size)
    if params.bad_words:
        params._bad_words_token_ids = bad_words_token_ids(params.bad_words, tokenizer, vocab_size)
    check_extra_args(params, vocab_size)
    if params.structured_outputs is not None:
        from ember.structured_output.validation import validate_structured_outputs

        validate_structured_outputs(params, structured_outputs_config, tokenizer)


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """vLLM's max_logprobs: logprobs and prompt_logprobs may not exceed it (-1: no cap but the
    vocabulary's size). A request's -1 asks for the whole vocabulary: it becomes vocab_size."""
    cap = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        wanted = vocab_size if value == -1 else value
        if wanted is not None and wanted > cap:
            why = (f"the vocabulary size {vocab_size}" if cap == vocab_size
                   else f"max_logprobs={max_logprobs} (an engine argument: LLM(max_logprobs=...))")
            raise ValueError(f"SamplingParams.{name}={value} is more than {why} allows")
        setattr(params, name, wanted)


def _check_in_vocab(name: str, token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.{name} has token ids outside the vocabulary "
                         f"[0, {vocab_size}): {bad[:5]}")


def bad_words_token_ids(words: list[str], tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word (leading spaces stripped) alone, and with one
    leading space when that gives a different first token in as many tokens (a word inside a
    text; a tokenizer that adds a prefix space makes both the same)."""
    if tokenizer is None:
        raise ValueError("SamplingParams.bad_words needs a tokenizer (skip_tokenizer_init=True "
                         "was set)")
    sequences: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words entry {word!r} gives no tokens")
        sequences.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    _check_in_vocab("bad_words", [t for seq in sequences for t in seq], vocab_size)
    return sequences


def check_extra_args(params: SamplingParams, vocab_size: int) -> None:
    """Every extra_args key must name a registered logits processor (the built-ins are set by
    their own fields); each processor checks its arguments."""
    if not params.extra_args:
        return
    from ember.logits_processors.pipeline import BUILTIN, resolve_processor_class
    from ember.registry import LogitsProcessorRegistry

    named = list(params.extra_args)
    builtin = [n for n in named if n in BUILTIN]
    if builtin:
        raise ValueError(f"SamplingParams.extra_args names the built-in logits processor(s) "
                         f"{', '.join(map(repr, builtin))}: set the SamplingParams field(s) "
                         "of that name instead")
    unknown = [n for n in named if n not in LogitsProcessorRegistry]
    if unknown:
        custom = sorted(set(LogitsProcessorRegistry.names()) - set(BUILTIN))
        raise ValueError(
            f"SamplingParams.extra_args names unknown logits processor(s) "
            f"{', '.join(map(repr, unknown))}; registered: {', '.join(custom) or '(none)'} "
            "(ember.registry.LogitsProcessorRegistry.register_logits_processor adds one)")
    for name in named:
        resolve_processor_class(name).validate_params(params, params.extra_args[name], vocab_size)
