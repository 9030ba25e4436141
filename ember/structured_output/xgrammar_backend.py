"""The `xgrammar` grammar backend (the default): JSON schema, regex, choice, EBNF/GBNF or Lark
grammars and structural tags, compiled by xgrammar against the engine's tokenizer.

xgrammar drops some JSON-schema keywords without a word (the output could then break the
schema), so `validate` refuses them by name first; under backend "auto" such a schema goes to
guidance instead.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.interface import Grammar, GrammarSpec, StructuredOutputBackend

# String formats xgrammar's JSON-schema converter turns into grammar rules.
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
# Keyword -> why it is refused (xgrammar would ignore it).
_IGNORED = {
    "multipleOf": "numbers with multipleOf",
    "uniqueItems": "arrays with uniqueItems",
    "contains": "arrays with contains",
    "minContains": "arrays with minContains",
    "maxContains": "arrays with maxContains",
    "patternProperties": "patternProperties",
    "propertyNames": "propertyNames",
    "dependentSchemas": "dependentSchemas",
    "if": "if/then/else",
    "not": "not",
}


def unsupported_json_feature(schema: Any, path: str = "#") -> str | None:
    """The first schema feature xgrammar cannot enforce, as "<what> at <path>", or None."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unsupported_json_feature(item, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    for key, what in _IGNORED.items():
        if key in schema and not (key == "uniqueItems" and schema[key] is False):
            return f"{what} at {path}"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in _FORMATS:
        return f"string format {fmt!r} at {path}"
    if ("pattern" in schema or "format" in schema) and (
            "minLength" in schema or "maxLength" in schema):
        return f"a string pattern or format combined with minLength/maxLength at {path}"
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples"):
            continue  # values, not schemas
        if isinstance(value, (dict, list)):
            found = unsupported_json_feature(value, f"{path}/{key}")
            if found:
                return found
    return None


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """GBNF/EBNF rules are defined with "::="; Lark's with ":"."""
    return not re.search(r"^\s*[\w-]+\s*::=", grammar, re.MULTILINE)


def build_grammar(spec: GrammarSpec) -> Any:
    """The xgrammar Grammar of a spec (parses it; raises on what xgrammar refuses)."""
    import xgrammar as xgr

    kind = spec.kind
    if spec.whitespace_pattern is not None and kind in ("json", "json_object"):
        raise ValueError("whitespace_pattern is not supported by xgrammar (use backend "
                         "'guidance', or disable_any_whitespace)")
    if kind in ("json", "json_object"):
        schema = spec.json_schema()
        if kind == "json":
            problem = unsupported_json_feature(schema)
            if problem:
                raise ValueError(f"the JSON schema uses {problem}, which xgrammar does not "
                                 "enforce")
        return xgr.Grammar.from_json_schema(json.dumps(schema),
                                            any_whitespace=not spec.disable_any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(spec.choices()))
    if kind == "grammar":
        return (xgr.Grammar.from_lark(spec.value) if is_lark(spec.value)
                else xgr.Grammar.from_ebnf(spec.value))
    if kind == "structural_tag":
        tag = json.loads(spec.value)
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's older format
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]),
                                           end=s["end"]) for s in tag["structures"]]
            return xgr.Grammar.from_structural_tag(items, tag["triggers"])
        return xgr.Grammar.from_structural_tag(spec.value)
    raise ValueError(f"xgrammar: unknown structured output kind {kind!r}")


class XgrammarGrammar(Grammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        # The matcher's own methods, bound: one Python frame less on the per-token path.
        self.accept_token = matcher.accept_token  # type: ignore[method-assign]
        self.is_terminated = matcher.is_terminated  # type: ignore[method-assign]
        # A matcher (made without terminate_without_stop_token) ends only by accepting one of
        # these: the other rows of a step need no is_terminated call.
        self.stop_ids = frozenset(matcher.stop_token_ids)

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"
    fills_whole_rows = True  # its native fill writes the whole row

    @classmethod
    def validate(cls, spec: GrammarSpec) -> None:
        try:
            build_grammar(spec)
        except ValueError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError with its parser's message
            raise ValueError(f"xgrammar cannot compile the {spec.kind}: {_message(exc)}") from None

    def __init__(self, tokenizer: Any, vocab_size: int, config: StructuredOutputsConfig) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # ember caches compiled grammars itself (ember.structured_output.manager).
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        # Fills a step's bitmask rows on xgrammar's own threads (the GIL is released).
        self.batch = xgr.BatchGrammarMatcher(max_threads=_fill_threads())
        self._stop_ids: frozenset[int] = frozenset()  # every grammar's stop ids, ever
        self._stop_ids_lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> Any:
        return self.compiler.compile_grammar(build_grammar(spec))

    def new_grammar(self, compiled: Any, stop_token_ids: list[int]) -> Grammar:
        import xgrammar as xgr

        grammar = XgrammarGrammar(xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(stop_token_ids) or None))
        if not grammar.stop_ids <= self._stop_ids:
            with self._stop_ids_lock:  # builds run on several threads
                self._stop_ids = self._stop_ids | grammar.stop_ids  # (advance reads the old)
        return grammar

    def accept_tokens(self, grammars: list[Grammar], tokens: list[int]) -> list[bool]:
        # One native call for the step's rows (it holds the GIL for much of its time, so it is
        # not split over threads: that was slower on 2 vCPUs, 0.451 against 0.383 ms for 256
        # rows, and on the H200's 16-core host, the step's update 2.7 against 0.6 ms).
        refused = _batch_accept(grammars, tokens)  # type: ignore[arg-type]
        return [i not in refused for i in range(len(tokens))]

    def advance(self, grammars: list[Grammar], tokens: list[int]) -> list[tuple[int, bool]]:
        refused = _batch_accept(grammars, tokens)  # type: ignore[arg-type]
        # Only a row whose token is some grammar's stop id can have ended by accepting it:
        # one pass over the tokens in a comprehension, not a Python loop over the rows.
        stops = self._stop_ids
        candidates = [i for i, token in enumerate(tokens) if token in stops]
        if refused:
            candidates = sorted({*candidates, *refused})
        ended = []
        for i in candidates:
            grammar = grammars[i]
            if i in refused:
                ended.append((i, False))
            elif tokens[i] in grammar.stop_ids and grammar.is_terminated():  # type: ignore[attr-defined]
                ended.append((i, True))
        return ended

    def fill_bitmasks(self, grammars: list[Grammar], bitmask: Any, rows: list[int]) -> None:
        if len(grammars) == 1:
            grammars[0].fill_bitmask(bitmask, rows[0])
            return
        self.batch.batch_fill_next_token_bitmask(
            [g.matcher for g in grammars], bitmask, rows)  # type: ignore[attr-defined]


def _batch_accept(grammars: list[XgrammarGrammar], tokens: list[int]) -> set[int]:
    """Advance each grammar by its token in one native call; the rows that refused theirs.

    xgrammar's public `batch_accept_token` returns a Python list it builds from the native
    result element by element (~0.9 us a row through tvm_ffi: three quarters of the call at 256
    rows). The native call's result is searched for a refusal instead, in one native `in`, and
    read row by row only when there is one (rare: the mask lets through only tokens the grammar
    takes)."""
    import xgrammar as xgr

    native = _native_batch_accept()
    if native is not None:
        try:
            result = native([g.matcher._handle for g in grammars], tokens, False)
        except (AttributeError, TypeError):  # another xgrammar: its public call from now on
            _NATIVE[0] = None
        else:
            if 0 not in result and False not in result:
                return set()
            return {i for i in range(len(result)) if not result[i]}
    accepted = xgr.BatchGrammarMatcher.batch_accept_token(  # type: ignore[attr-defined]
        [g.matcher for g in grammars], tokens)
    return {i for i, ok in enumerate(accepted) if not ok}


_NATIVE: list[Any] = []  # [the native batch accept, or None], found on first use


def _native_batch_accept() -> Any:
    if not _NATIVE:
        try:
            from xgrammar.base import _core

            _NATIVE.append(_core.BatchGrammarMatcher.batch_accept_token)
        except (ImportError, AttributeError):
            _NATIVE.append(None)
    return _NATIVE[0]


def _fill_threads() -> int:
    """Threads for filling bitmasks: EMBER_GRAMMAR_THREADS, or the cores less one for the engine
    loop, at most 4: more only wait on one another at a step's few hundred rows (256 rows on
    the H200's 16-core host: 0.58-0.68 ms a fill on 4 threads, 0.75 on 2, 0.83-2.4 on 8, 3.0
    on 15; docs/benchmarks.md)."""
    import os

    from ember import envs

    return envs.grammar_threads() or max(1, min(4, (os.cpu_count() or 2) - 1))


def _message(exc: Exception) -> str:
    # xgrammar's messages start with "[time] /path/file.cc:line: "; keep what follows.
    text = str(exc).strip()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text) or type(exc).__name__
