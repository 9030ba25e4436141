"""The grammar-backend contract: what ember asks of a structured-outputs engine.

A backend is registered by name (ember.registry.GrammarBackendRegistry) and used in two places:

- the front end calls the classmethod `validate(spec)` when a request is added (no tokenizer,
  no engine: it must be cheap and raise ValueError naming what it cannot compile);
- the engine core builds one instance per engine, `cls(tokenizer, vocab_size, config)`, on a
  worker thread the first time a request needs it (building tokenizer tables is slow), then
  calls `compile(spec)` on worker threads (results are cached by `spec.key`, so it must be
  thread-safe and pure) and `new_grammar(compiled, stop_token_ids)` once per request.

A `Grammar` is one request's matcher state: `accept_token` after each sampled token,
`fill_bitmask` before each step that samples, `is_terminated` to finish the request.
The bitmask is xgrammar's and llguidance's format: int32 words, bit j of word i set when token
32 * i + j is allowed; the sampler applies it on the device (ember.structured_output.bitmask).

Importing this module imports neither torch nor a grammar library.
"""

from __future__ import annotations

import functools
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from ember.sampling_params import StructuredOutputsParams
    from ember.structured_output.config import StructuredOutputsConfig


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint in canonical form: equal specs compile to the same grammar.

    `kind`: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"; `value`: the
    schema as canonical JSON text, the regex, the choices as a JSON list, the grammar text, or the
    structural tag's JSON text ("" for json_object)."""

    kind: str
    value: str
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @property
    def key(self) -> tuple:
        return (self.kind, self.value, self.disable_any_whitespace,
                self.disable_additional_properties, self.whitespace_pattern)

    def json_schema(self) -> dict[str, Any]:
        """The schema of a "json" or "json_object" spec as a dict."""
        return json.loads(self.value) if self.kind == "json" else {"type": "object"}

    def choices(self) -> list[str]:
        return json.loads(self.value)

    @classmethod
    def of(cls, params: StructuredOutputsParams,
           config: StructuredOutputsConfig | None = None) -> GrammarSpec:
        """The spec of a request's params (engine-wide flags from `config` added in); a
        ValueError when the json or structural_tag text is no JSON."""
        kind = params.kind
        if kind == "json":
            schema = params.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object, got "
                                 f"{type(schema).__name__}")
            value = _canonical_json(schema)
        elif kind == "choice":
            value = json.dumps(params.choice, ensure_ascii=False)
        elif kind == "json_object":
            value = ""
        elif kind == "structural_tag":
            try:
                tag = json.loads(params.structural_tag)  # type: ignore[arg-type]
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {exc}") \
                    from None
            value = _canonical_json(tag)
        else:
            value = getattr(params, kind)
        return cls(
            kind, value,
            params.disable_any_whitespace or bool(config and config.disable_any_whitespace),
            params.disable_additional_properties
            or bool(config and config.disable_additional_properties),
            params.whitespace_pattern,
        )


@functools.cache
def _sorted_encoder() -> Any:
    import msgspec

    return msgspec.json.Encoder(order="sorted")


def _canonical_json(value: Any) -> str:
    """JSON text with sorted keys: equal values give equal text. msgspec's encoder (about a
    tenth of json.dumps' time, a request's schema being canonicalized as it is added), or
    json.dumps for what it refuses (keys that are not strings)."""
    try:
        return _sorted_encoder().encode(value).decode()
    except (TypeError, ValueError):
        return json.dumps(value, sort_keys=True, ensure_ascii=False)


class Grammar(ABC):
    """One request's matcher: which tokens may come next, advanced token by token."""

    @abstractmethod
    def accept_token(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, words] CPU tensor
        (all ones when called, unless the backend declares `fills_whole_rows`)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete: the request finishes (finish_reason "stop")."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (optional: ember replays tokens instead
        of rolling back, so a backend without rollback works)."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back")


class StructuredOutputBackend(ABC):
    """A grammar engine. Class attribute `name` is its registry name (set at registration)."""

    name: ClassVar[str] = ""
    # True when fill_bitmasks writes every word of each row it fills: the engine then leaves
    # the rows as they are before the call instead of setting them to all ones first.
    fills_whole_rows: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def validate(cls, spec: GrammarSpec) -> None:
        """In the front end: raise ValueError naming what this backend cannot compile."""

    @abstractmethod
    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig) -> None:
        """Build the tokenizer tables (once per engine, on a worker thread). `vocab_size` is the
        bitmask's width in tokens: the tokenizer's ids (a model's vocabulary padded past them is
        not: no grammar allows those ids, and the sampler disallows the logits past the end)."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """Compile a spec (on a worker thread; the result is cached and shared by requests)."""

    def accept_tokens(self, grammars: list[Grammar], tokens: list[int]) -> list[bool]:
        """Advance each grammar by its token (a step's sampled tokens, on the engine thread;
        with deferred accepts on the bitmask helper thread); whether each was allowed. A
        backend with a batched native call overrides this loop."""
        return [grammar.accept_token(token) for grammar, token in zip(grammars, tokens)]

    def advance(self, grammars: list[Grammar], tokens: list[int]) -> list[tuple[int, bool]]:
        """Advance each grammar by its token, as `accept_tokens`, and return only the rows
        that end their request, in row order, as (index, accepted): accepted False, the
        grammar refused the token; True, it took it and is complete. The default asks
        `is_terminated` of every row that took its token; a backend that knows cheaper which
        rows can have ended overrides it."""
        accepted = self.accept_tokens(grammars, tokens)
        return [(i, ok) for i, (ok, grammar) in enumerate(zip(accepted, grammars))
                if not ok or grammar.is_terminated()]

    @abstractmethod
    def new_grammar(self, compiled: Any, stop_token_ids: list[int]) -> Grammar:
        """A fresh matcher for one request; `stop_token_ids` end the grammar (the engine's eos)."""

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: torch.Tensor,
                      rows: list[int]) -> None:
        """Fill row rows[i] of `bitmask` for grammars[i] (all this backend's). Called once per
        step for all of a backend's rows, so a backend can fill them in parallel (the built-in
        ones do, on threads that release the GIL); the default fills them one by one."""
        for grammar, row in zip(grammars, rows):
            grammar.fill_bitmask(bitmask, row)
