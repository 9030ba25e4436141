"""StructuredOutputManager: the engine core's side of structured outputs.

- `add(request)`: the request's grammar is built on a thread pool (the backend first, once per
  engine: tokenizer tables take a second or more; then the compiled grammar, cached by the spec so
  equal specs compile once, shared; then the request's own matcher). The scheduler keeps the
  request aside until `ready(request)` (it never blocks the loop or other requests).
- `accept(request, token)`: after each sampled token (the scheduler's update_from_output);
  returns True when the request is finished: the grammar is complete (status FINISHED_STOPPED)
  or refused the token (FINISHED_ABORTED, logged; it cannot happen with the mask applied).
- `grammar_bitmask(plan)`: the int32 bitmask rows for the scheduled requests that sample this
  step under a grammar (xgrammar's / llguidance's layout), for the sampler.

Preemption keeps a request's generated tokens (it is recomputed, not rolled back), so its grammar
state stays valid; should a grammar ever be behind the request's tokens, the missing tokens are
replayed before its mask is filled.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ember.core.request import Request, RequestStatus
from ember.core.scheduler_output import GrammarBitmask, SchedulerOutput
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.interface import Grammar, GrammarSpec, StructuredOutputBackend
from ember.structured_output.validation import resolve_backend_class, select_backend

logger = logging.getLogger("ember")


class StructuredOutputRequest:
    """A request's grammar: its spec, the build in progress, then the matcher."""

    __slots__ = ("spec", "backend", "future", "grammar", "num_accepted", "error")

    def __init__(self, spec: GrammarSpec, backend: str) -> None:
        self.spec = spec
        self.backend = backend
        self.future: Future | None = None
        self.grammar: Grammar | None = None
        self.num_accepted = 0  # output tokens the grammar has consumed
        self.error: str | None = None


class StructuredOutputManager:
    def __init__(self, config: StructuredOutputsConfig, load_tokenizer: Callable[[], Any],
                 vocab_size: int) -> None:
        self.config = config
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self.vocab_size = vocab_size  # bitmask width in tokens (set again with the tokenizer)
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._backend_lock = threading.Lock()
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._compiled_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._done = threading.Condition()  # notified when a build finishes
        self.num_compiled = 0  # compiles done (cache misses), for tests and stats
        self.in_use = False  # some request had structured outputs (else steps skip the bitmask)

    # ---- building ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Start building `request`'s grammar (its params were validated by the front end)."""
        params = request.sampling_params.structured_outputs
        spec = GrammarSpec.of(params, self.config)
        backend = params._backend or select_backend(spec, self.config.backend)
        so = StructuredOutputRequest(spec, backend)
        self.in_use = True
        if self._pool is None:
            workers = max(1, min(4, (os.cpu_count() or 2) - 1))
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ember-grammar")
        stop_ids = sorted(request.eos_token_ids | request.sampling_params.all_stop_token_ids)
        so.future = self._pool.submit(self._build, so, stop_ids)
        so.future.add_done_callback(self._notify)
        request.structured_output = so

    def _notify(self, _future: Future) -> None:
        with self._done:
            self._done.notify_all()

    def _build(self, so: StructuredOutputRequest, stop_ids: list[int]) -> Grammar:
        backend = self._backend(so.backend)
        return backend.new_grammar(self._compile(backend, so.backend, so.spec), stop_ids)

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._backend_lock:
            backend = self._backends.get(name)
            if backend is None:
                if self._tokenizer is None:
                    self._tokenizer = self._load_tokenizer()
                    self.vocab_size = max(self.vocab_size, len(self._tokenizer))
                backend = resolve_backend_class(name)(self._tokenizer, self.vocab_size,
                                                       self.config)
                self._backends[name] = backend
            return backend

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

    def ready(self, request: Request) -> bool:
        """Whether the grammar is built (or failed: then `error` is set)."""
        so = request.structured_output
        if so.grammar is not None or so.error is not None:
            return True
        if not so.future.done():
            return False
        try:
            so.grammar = so.future.result()
        except Exception as exc:  # validated in the front end, so a backend's own failure
            so.error = f"{type(exc).__name__}: {exc}"
            logger.error("request %s: the %s grammar backend failed to build its grammar: %s",
                         request.request_id, so.backend, so.error)
        so.future = None
        return True

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for some grammar build to finish (nothing else to do)."""
        with self._done:
            self._done.wait(timeout)

    # ---- stepping ----------------------------------------------------------------------
    def accept(self, request: Request, token: int) -> bool:
        """Advance the grammar by a sampled token; True when the request is finished by it."""
        so = request.structured_output
        grammar = so.grammar
        so.num_accepted += 1
        if not grammar.accept_token(token):
            logger.error("request %s: the grammar refused sampled token %d; aborting it",
                         request.request_id, token)
            request.status = RequestStatus.FINISHED_ABORTED
            return True
        if grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def grammar_bitmask(self, plan: SchedulerOutput) -> GrammarBitmask | None:
        """The bitmask rows of the requests that sample under a grammar in `plan`."""
        # Scheduled up to its last known token: it samples. (A grammar request never has a token
        # in flight when it is scheduled: the engine core folds that step in first.)
        rows = [r for r in plan.scheduled_requests if r.structured_output is not None
                and r.num_computed_tokens >= r.num_tokens
                and r.structured_output.grammar is not None]
        if not rows:
            return None
        import torch

        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        for i, request in enumerate(rows):
            so = request.structured_output
            outputs = request.output_token_ids
            while so.num_accepted < len(outputs):  # replay what the grammar has not seen
                so.grammar.accept_token(outputs[so.num_accepted])
                so.num_accepted += 1
            if not so.grammar.is_terminated():
                so.grammar.fill_bitmask(bitmask, i)
        return GrammarBitmask([r.request_id for r in rows], bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
