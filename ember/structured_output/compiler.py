"""GrammarCompiler: one process's grammar backends, compiled-grammar cache and matcher builds.

A backend is made on first use, after the tokenizer is loaded (its tables take a second or
more); compiled grammars are cached by spec (equal specs compile once and are shared; the least
recently used go past the config's `max_cache_size`); `build` makes one request's matcher.
Thread-safe: builds run on a pool. The engine core's StructuredOutputManager uses one in its
own process, or the grammar process does (ember.structured_output.grammar_process).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.interface import Grammar, GrammarSpec, StructuredOutputBackend
from ember.structured_output.validation import resolve_backend_class


class GrammarCompiler:
    def __init__(self, config: StructuredOutputsConfig, load_tokenizer: Callable[[], Any],
                 vocab_size: int, eos_width: int = 0) -> None:
        self.config = config
        self._load_tokenizer = load_tokenizer
        self.tokenizer: Any = None
        self.vocab_size = vocab_size  # bitmask width in tokens (set again with the tokenizer)
        # The model config's eos ids must fit in the bitmask even where the tokenizer does not
        # know them (a checkpoint paired with another model's tokenizer), or no grammar could end.
        self._eos_width = eos_width
        self.backends: dict[str, StructuredOutputBackend] = {}
        self._backend_lock = threading.Lock()
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._compiled_lock = threading.Lock()
        self.num_compiled = 0  # compiles done (cache misses), for tests and stats

    def backend(self, name: str) -> StructuredOutputBackend:
        with self._backend_lock:
            backend = self.backends.get(name)
            if backend is None:
                if self.tokenizer is None:
                    self.tokenizer = self._load_tokenizer()
                    self.vocab_size = self._grammar_vocab_size(self.tokenizer)
                backend = resolve_backend_class(name)(self.tokenizer, self.vocab_size,
                                                       self.config)
                self.backends[name] = backend
            return backend

    def build(self, name: str, spec: GrammarSpec, stop_ids: list[int]) -> Grammar:
        """A fresh matcher of `spec` on backend `name`, ended by `stop_ids`."""
        backend = self.backend(name)
        # A stop id past the bitmask (a request's own stop_token_ids) cannot be sampled under a
        # grammar: the sampler disallows ids past the bitmask's end, so it cannot end one either.
        stop_ids = [i for i in stop_ids if i < self.vocab_size]
        return backend.new_grammar(self._compile(backend, name, spec), stop_ids)

    def is_compiled(self, name: str, spec: GrammarSpec) -> bool:
        """Whether `spec` is compiled for backend `name` (in the cache, without error): a
        build is then only a matcher's making."""
        with self._compiled_lock:
            future = self._compiled.get((name, spec.key))
        return future is not None and future.done() and future.exception() is None

    def _grammar_vocab_size(self, tokenizer: Any) -> int:
        """The bitmask's width in tokens: the ids the tokenizer has (and the model config's eos
        ids), not the model's logits width.
        A model's vocabulary is often padded past its tokenizer's (Qwen3: 267 ids; a checkpoint
        with another model's tokenizer: 100k); no grammar allows those ids, and the sampler
        disallows the logits past the bitmask's end. Narrower also because xgrammar counts every
        id past the tokenizer as a special token and scans them all in each accept_token (about
        0.5 ns an id: 48 us a token with a 49k tokenizer in a 152k vocabulary, 2 us without)."""
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        return max(len(tokenizer), max(vocab.values(), default=-1) + 1, self._eos_width)

    def _compile(self, backend: StructuredOutputBackend, name: str, spec: GrammarSpec) -> Any:
        key = (name, spec.key)
        with self._compiled_lock:
            future = self._compiled.get(key)
            owner = future is None
            if owner:
                future = self._compiled[key] = Future()
                while len(self._compiled) > self.config.max_cache_size:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        if owner:
            try:
                future.set_result(backend.compile(spec))
                self.num_compiled += 1
            except BaseException as exc:
                with self._compiled_lock:
                    self._compiled.pop(key, None)  # a later request may try again
                future.set_exception(exc)
        return future.result()


class Advances:
    """A step's tokens for the grammars that have not seen them, grouped for the backends:
    `single[name]` = (rows, grammars, tokens) of backend `name`'s rows that take one token (the
    usual case: one backend call for them), `replays` = (row, grammar, tokens) of the rows
    behind by more (replayed token by token). The rows are the caller's numbers (bitmask rows on
    the engine's helper thread, positions in the step's message in the grammar process)."""

    __slots__ = ("single", "replays")

    def __init__(self) -> None:
        self.single: dict[str, tuple[list[int], list[Any], list[int]]] = {}
        self.replays: list[tuple[int, str, Any, list[int]]] = []

    def add(self, row: int, backend: str, grammar: Any, tokens: list[int]) -> None:
        if len(tokens) == 1:
            entry = self.single.get(backend)
            if entry is None:
                entry = self.single[backend] = ([], [], [])
            entry[0].append(row)
            entry[1].append(grammar)
            entry[2].append(tokens[0])
        else:
            self.replays.append((row, backend, grammar, tokens))

    def __bool__(self) -> bool:
        return bool(self.single or self.replays)


def advance_grammars(backends: dict[str, StructuredOutputBackend],
                     advances: Advances) -> list[tuple[int, bool]]:
    """Each row's grammar takes its tokens; returns the rows whose grammar then ends its
    request, as (row, accepted): accepted False, it refused a token; True, it is complete."""
    outcomes: list[tuple[int, bool]] = []
    for row, _, grammar, tokens in advances.replays:
        ok = all(grammar.accept_token(t) for t in tokens)
        if not ok or grammar.is_terminated():
            outcomes.append((row, ok))
    for name, (rows, grammars, tokens) in advances.single.items():
        ended = backends[name].advance(grammars, tokens)
        outcomes.extend((rows[i], ok) for i, ok in ended)
    return outcomes


def fill_grammar_rows(backends: dict[str, StructuredOutputBackend],
                      by_backend: dict[str, tuple[list[Grammar], list[int]]],
                      bitmask: Any, skip: set[int] | tuple = ()) -> None:
    """Fill each backend's rows of ``bitmask`` (an int32 [rows, words] host tensor, its
    contents undefined) from their grammars, one call per backend, leaving out ``skip``; every
    row no backend wrote whole is all ones (allows every token). Clearing only those rows
    matters: a 256-row bitmask of a 150k vocabulary is 4.9 MB to write."""
    import numpy as np

    array = bitmask.numpy()
    written = np.zeros(len(array), dtype=bool)
    for name, (grammars, row_ids) in by_backend.items():
        if skip:
            kept = [(g, r) for g, r in zip(grammars, row_ids) if r not in skip]
            if not kept:
                continue
            grammars, row_ids = [g for g, _ in kept], [r for _, r in kept]
        backend = backends[name]
        if backend.fills_whole_rows:
            written[row_ids] = True
        else:
            array[row_ids] = -1
            written[row_ids] = True
        backend.fill_bitmasks(grammars, bitmask, row_ids)
    if not written.all():
        array[~written] = -1
