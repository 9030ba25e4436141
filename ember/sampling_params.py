"""SamplingParams: how one request is decoded, with vLLM's field names, meanings and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class RequestOutputKind(IntEnum):
    """Which outputs a request yields: every step's cumulative state, only the new part, or only
    the final result (what offline LLM.generate needs, and the cheapest)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the text a request generates (vLLM's ``StructuredOutputsParams``): exactly
    one of `json` (a JSON schema: dict, JSON string or pydantic model class), `regex`, `choice`
    (the output is one of these strings), `grammar` (EBNF/GBNF, or Lark), `json_object=True` (any
    JSON object) or `structural_tag` (a JSON string, xgrammar's / vLLM's format). The options
    shape JSON output: `disable_any_whitespace` (compact JSON), `disable_additional_properties`
    (objects get exactly their listed properties; guidance), `whitespace_pattern` (a regex for
    the whitespace between JSON tokens; guidance). Whether the engine's grammar backend can
    compile the constraint is checked when the request is added (a ValueError naming the
    problem); ember.structured_output does the rest."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # Set by the front end's validation: the grammar backend that compiles this request, and
    # the constraint in canonical form (ember.structured_output.interface.GrammarSpec).
    _backend: str | None = field(default=None, repr=False)
    _spec: Any = field(default=None, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> StructuredOutputsParams:
        """A copy whose constraint values (the schema, the choices) are shared: ember never
        changes them, and a request's SamplingParams is copied for each request it makes
        (deep-copying a real-world schema took ~0.1 ms a request, 256 of them ~30 ms)."""
        import copy

        clone = copy.copy(self)
        memo[id(self)] = clone
        return clone

    def __post_init__(self) -> None:
        json_value = self.json
        if isinstance(json_value, type) and hasattr(json_value, "model_json_schema"):
            self.json = json_value.model_json_schema()  # a pydantic model class
        elif json_value is not None and not isinstance(json_value, (str, dict)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (a dict, a JSON "
                             f"string or a pydantic model class), got {type(json_value).__name__}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or any(
                    not isinstance(c, str) for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}")
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"StructuredOutputsParams.{name} must be a string, "
                                 f"got {type(value).__name__}")
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of json, regex, choice, grammar, "
                f"json_object=True or structural_tag; got {', '.join(given) or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar", "json_object" or
        "structural_tag"."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Decoding parameters of one request; invalid values raise ValueError naming the field.

    Meanings follow vLLM: temperature 0 is greedy; top_k 0 or -1 disables top-k; top_p 1 disables
    nucleus sampling; min_p 0 disables min-p; presence/frequency penalties act on generated tokens
    (OpenAI's definition), repetition_penalty on prompt and generated tokens (CTRL's definition).
    logit_bias (token id -> bias, clamped to [-100, 100]), allowed_token_ids and bad_words are
    applied by the built-in logits processors; extra_args selects registered ones by name
    ({name: args}); the engine checks token ids against the vocabulary. structured_outputs
    constrains the output to a JSON schema, regex, choice or grammar (StructuredOutputsParams).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Keep only the prompt's last k tokens (-1: max_model_len); None keeps the whole prompt.
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Logits processor name -> its arguments (vLLM: args for custom processors and plugins).
    extra_args: dict[str, Any] | None = None
    # vLLM V1 refuses per-request callables too; a registered processor replaces them.
    logits_processors: Any = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine from bad_words and the tokenizer (vLLM's update_from_tokenizer).
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Filled by the engine: the tokenizer's eos ids and the request's own stop ids, combined.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._normalize_logit_bias()
        self._validate()
        self._validate_logits_processing()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other sampling knobs have no effect, normalise them like vLLM does.
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, -1, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1 (disable), 0 (disable) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be greater than zero")
        bad_max = not isinstance(self.max_tokens, int) or self.max_tokens < 1
        if self.max_tokens is not None and bad_max:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}")
        # -1: the whole vocabulary (vLLM's; the engine's max_logprobs must allow it).
        if self.logprobs is not None and self.logprobs < -1:
            raise bad("logprobs", "must be non-negative, or -1 for the whole vocabulary")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise bad("prompt_logprobs", "must be non-negative, or -1 for the whole vocabulary")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must contain only non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must contain only non-negative integers")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k == 0 or k < -1):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1 or -1 (max_model_len)")
        if self.stop and not self.detokenize:
            raise ValueError("SamplingParams.stop strings need detokenize=True")

    def _normalize_logit_bias(self) -> None:
        # vLLM's: keys may be strings of ids (JSON objects), biases are clamped to [-100, 100].
        if self.logit_bias is None:
            return
        rule = "must map token ids to finite numbers"
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"SamplingParams.logit_bias {rule}, got {self.logit_bias!r}")
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            token = _token_id(key)
            finite = isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value)
            if token is None or not finite:
                raise ValueError(f"SamplingParams.logit_bias {rule}, got {key!r}: {value!r}")
            bias[token] = min(100.0, max(-100.0, float(value)))
        self.logit_bias = bias

    def _validate_logits_processing(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed or \
                    any(_token_id(t) is None or isinstance(t, str) for t in allowed):
                raise ValueError("SamplingParams.allowed_token_ids must be a non-empty list of "
                                 f"token ids, got {allowed!r}")
            self.allowed_token_ids = list(allowed)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or any(not isinstance(w, str) for w in words):
                raise ValueError(f"SamplingParams.bad_words must be a list of strings, got {words!r}")
            self.bad_words = list(words)
        if self.extra_args is not None and (
            not isinstance(self.extra_args, dict)
            or any(not isinstance(k, str) for k in self.extra_args)
        ):
            raise ValueError("SamplingParams.extra_args must be a dict from logits processor "
                             f"names to their arguments, got {self.extra_args!r}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            if not isinstance(so, dict):
                raise ValueError("SamplingParams.structured_outputs must be a "
                                 f"StructuredOutputsParams, got {type(so).__name__}")
            self.structured_outputs = StructuredOutputsParams(**so)
        if self.logits_processors:
            raise ValueError(
                "SamplingParams.logits_processors (per-request callables) is not supported, as "
                "in vLLM V1: register a LogitsProcessor (ember.registry.LogitsProcessorRegistry) "
                "and select it with extra_args={name: args}")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with this one (a request's params are cloned
        for each request it makes). Immutable values are shared as they are: deep-copying
        every field took most of adding a request."""
        import copy

        clone = copy.copy(self)
        memo: dict = {}
        for name, value in vars(self).items():
            if not isinstance(value, _IMMUTABLE):
                setattr(clone, name, copy.deepcopy(value, memo))
        return clone


_IMMUTABLE = (type(None), bool, int, float, str, bytes, IntEnum)


def _token_id(value: Any) -> int | None:
    """A token id given as an int or a string of digits (JSON object keys); None otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def __getattr__(name: str) -> Any:
    # vLLM's import path for BeamSearchParams; it lives with the beam search.
    if name == "BeamSearchParams":
        from ember.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
