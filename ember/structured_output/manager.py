"""StructuredOutputManager: the engine core's side of structured outputs.

- `add(request)`: the request's grammar is built on a thread pool (the backend first, once per
  engine: tokenizer tables take a second or more; then the compiled grammar, cached by the spec so
  equal specs compile once, shared; then the request's own matcher). The scheduler keeps the
  request aside until `ready(request)` (it never blocks the loop or other requests).
- `accept_many([(request, token), ...])`: a step's sampled tokens (the scheduler's
  update_from_output), each backend's in one call; returns the requests finished: the grammar
  is complete (status FINISHED_STOPPED) or refused the token (FINISHED_ABORTED, logged; it
  cannot happen with the mask applied). `accept(request, token)` is the same for one token.
  Under async scheduling (`defer_accepts`) it only records the token: the next fill advances
  the grammars in one batched backend call on its helper thread, and `take_finished()` gives
  the requests it found complete or refusing, which the engine core ends.
- `sampling_rows(plan)` / `fill(requests)`: the int32 bitmask rows (xgrammar's / llguidance's
  layout) of the scheduled requests that sample this step under a grammar, for the sampler. The
  rows are chosen when the step is planned and filled once the tokens before it are folded in:
  under async scheduling that is while the step's forward runs (ember.core.engine_core). That
  side lives in ember.structured_output.bitmask_fill (a base class of the manager).

With a grammar process (`use_process`, ember.structured_output.grammar_process) the grammars
and all their state (the tokens taken, the reasoning gate) live there: accept_many only records
each token with its grammar's key, and each fill is one message to it (those tokens, then the
key of each row to fill into a shared buffer) answered when the engine thread takes the result.

Preemption keeps a request's generated tokens (it is recomputed, not rolled back), so its grammar
state stays valid; should a grammar ever be behind the request's tokens, the missing tokens are
replayed before its mask is filled.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ember.core.request import Request, RequestStatus
from ember.structured_output.bitmask_fill import FILL_SWITCH_INTERVAL_S, BitmaskFilling
from ember.structured_output.compiler import GrammarCompiler
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.grammar_process import GrammarBuildError
from ember.structured_output.interface import Grammar, GrammarSpec
from ember.structured_output.reasoning_gate import ANSWER, ReasoningGate
from ember.structured_output.switch_interval import ShortSwitchInterval
from ember.structured_output.validation import select_backend

logger = logging.getLogger("ember")


class StructuredOutputRequest:
    """A request's grammar: its spec, the build in progress, then the matcher."""

    __slots__ = ("spec", "backend", "future", "grammar", "num_accepted", "error", "state",
                 "start", "ended", "build_key")

    def __init__(self, spec: GrammarSpec, backend: str) -> None:
        self.spec = spec
        self.backend = backend
        self.future: Future | None = None
        self.grammar: Grammar | None = None
        self.num_accepted = 0  # output tokens the grammar has consumed (from `start` on)
        self.error: str | None = None
        # With a reasoning parser (ember.structured_output.reasoning_gate): ANSWER once the
        # answer started, at output index `start`; before that the output is not constrained.
        self.state = ANSWER
        self.start = 0
        # Deferred accepts: the status a fill found the grammar ending the request with (it
        # is complete, or refused a token), until the engine core ends it.
        self.ended: RequestStatus | None = None
        # (backend, spec, stop ids): what its build depends on besides the prompt.
        self.build_key: tuple = ()


class StructuredOutputManager(BitmaskFilling):
    def __init__(self, config: StructuredOutputsConfig, load_tokenizer: Callable[[], Any],
                 vocab_size: int, model_eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self._load_tokenizer = load_tokenizer
        self._eos_width = max(model_eos_token_ids, default=-1) + 1
        self._compiler = GrammarCompiler(config, load_tokenizer, vocab_size, self._eos_width)
        self._gate_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._fill_thread: ThreadPoolExecutor | None = None  # fill_async's
        self._done = threading.Condition()  # notified when a build finishes
        self.in_use = False  # some request had structured outputs (else steps skip the bitmask)
        self._gate: ReasoningGate | None = None  # built with the first grammar, if configured
        # perf_counter at the start and end of the last fill's backend calls, and with the
        # grammar process its other phases in seconds (step timing).
        self.last_fill = (0.0, 0.0)
        self.last_fill_phases: dict[str, float] = {}
        self._switch_interval = ShortSwitchInterval(FILL_SWITCH_INTERVAL_S)  # see fill_async
        # Deferred accepts (set by the engine core under deferred sampling, and always with a
        # grammar process): accept() only records a token, and the next fill advances the
        # grammars first, in one batched backend call a step (StructuredOutputBackend.advance,
        # which xgrammar runs mostly in native code: it does not release the GIL throughout,
        # docs/benchmarks.md) on fill_async's helper thread or in the grammar process instead
        # of on the engine thread. A grammar the fill finds complete or refusing its token is
        # reported by take_finished() for the engine core to end.
        self.defer_accepts = False
        self._finished: list[tuple[Request, RequestStatus]] = []
        # Host buffers the bitmasks are filled into, used in turn (use_host_buffers).
        self._allocate_host: Callable[[int], Any] | None = None
        self._host_buffers: list[Any] = []
        self._host_next = 0
        # The grammar process (use_process): its arguments until the first grammar starts it.
        self._process: Any = None
        self._process_args: dict[str, Any] | None = None
        # With it: the tokens sampled since the last fill, as (keys, tokens) in order, and each
        # live key's request (the process names the keys whose grammar ended).
        self._accepts: tuple[list[int], list[int]] = ([], [])
        self._by_key: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        # The build keys the grammar process built without error, most recent last: a request
        # with one of them is scheduled at once (its grammar comes from the process's cache,
        # built before the request's first fill there), not after a round trip per request,
        # which split a batch of cached grammars into waves of prefills.
        self._built_before: collections.OrderedDict[tuple, None] = collections.OrderedDict()

    @property
    def vocab_size(self) -> int:
        """The bitmask's width in tokens (the tokenizer's, once it is loaded)."""
        if self._process is not None:
            return self._process.vocab_size
        return self._compiler.vocab_size

    @property
    def num_compiled(self) -> int:
        """Compiles done (cache misses), for tests and stats."""
        if self._process is not None:
            return self._process.num_compiled
        return self._compiler.num_compiled

    @property
    def uses_process(self) -> bool:
        return self._process_args is not None

    def use_host_buffers(self, allocate: Callable[[int], Any], count: int) -> None:
        """Fill bitmasks into ``count`` int32 host buffers from ``allocate(numel)`` (1-D torch
        tensors, grown as needed), used in turn: page-locked ones let the runner copy a bitmask
        to the device as it is, where it copied it into its own page-locked buffer on the
        engine thread first (~0.8 MB a step at 134 rows of a 49k vocabulary). A buffer is
        reused ``count`` fills later: by then the step that read it must have been resolved
        (the engine core sizes ``count`` to the steps it keeps in flight)."""
        self._allocate_host = allocate
        self._host_buffers = [None] * count
        self._host_next = 0

    def use_process(self, count: int,
                    pin: Callable[[Any], Callable[[], None] | None] | None = None,
                    spin_seconds: float = 0.0) -> None:
        """Keep the grammars in a process of their own (started with the first grammar),
        filling ``count`` shared host buffers in turn (reused as use_host_buffers' are),
        each page-locked here by ``pin`` (a platform's pin_host_memory); each side polls for
        up to ``spin_seconds`` before it blocks on the other. Accepts are deferred from then
        on: accept_many only records each grammar's key and token, and the next fill sends
        them; the process keeps the grammars' state (reasoning gate included)."""
        self._process_args = {"buffers": count, "pin": pin, "spin_seconds": spin_seconds}
        self._host_buffers = [None] * count
        self._host_next = 0
        self.defer_accepts = True

    def _start_process(self) -> Any:
        from ember.structured_output.grammar_process import GrammarProcess

        if self._process is None:
            self._process = GrammarProcess(self.config, self._load_tokenizer,
                                           self._compiler.vocab_size, self._eos_width,
                                           **self._process_args)  # type: ignore[arg-type]
            self._process.on_quiet_failure = self._quiet_build_failed
        return self._process

    # ---- building ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Start building `request`'s grammar (its params were validated by the front end)."""
        params = request.sampling_params.structured_outputs
        spec = params._spec  # the front end's (not across a process boundary: msgspec's dict)
        if not isinstance(spec, GrammarSpec):
            spec = GrammarSpec.of(params, self.config)
        backend = params._backend or select_backend(spec, self.config.backend)
        so = StructuredOutputRequest(spec, backend)
        self.in_use = True
        stop_ids = sorted(request.eos_token_ids | request.sampling_params.all_stop_token_ids)
        request.structured_output = so
        if self.uses_process:
            import numpy as np

            # The process keeps the reasoning gate too: the prompt says where the answer starts.
            gated = self.config.reasoning_parser and not self.config.enable_in_reasoning
            so.build_key = (backend, spec.key, tuple(stop_ids))
            at_once = so.build_key in self._built_before
            so.future, handle = self._start_process().add(
                backend, spec, stop_ids,
                np.array(request.prompt_token_ids, np.int32) if gated else None, at_once)
            if at_once:  # no answer unless it fails (_quiet_build_failed)
                self._built_before.move_to_end(so.build_key)
                so.grammar = handle
                self._by_key[handle.key] = request
            return
        if self._compiler.is_compiled(backend, spec):
            # Compiled before: the matcher is made here, so the request is scheduled at once
            # (through the pool, a batch of cached grammars was admitted in waves).
            try:
                so.grammar = self._build(so, stop_ids, request.prompt_token_ids)
            except Exception as exc:
                self._build_failed(request, exc)
            return
        so.future = self._submit(self._build, so, stop_ids, request.prompt_token_ids)
        so.future.add_done_callback(self._notify)

    def _submit(self, function: Callable, *args: Any) -> Future:
        if self._pool is None:
            workers = max(1, min(4, (os.cpu_count() or 2) - 1))
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ember-grammar")
        return self._pool.submit(function, *args)

    def _notify(self, _future: Future) -> None:
        with self._done:
            self._done.notify_all()

    def _build(self, so: StructuredOutputRequest, stop_ids: list[int],
               prompt_token_ids: list[int]) -> Grammar:
        self._compiler.backend(so.backend)  # the tokenizer first (the gate needs it)
        self._start_gate(so, prompt_token_ids, lambda: self._compiler.tokenizer)
        return self._compiler.build(so.backend, so.spec, stop_ids)

    def _start_gate(self, so: StructuredOutputRequest, prompt_token_ids: list[int],
                    tokenizer: Callable[[], Any]) -> None:
        """With a reasoning parser (and grammars not applied while reasoning): the reasoning
        gate (built once) and the request's first state."""
        if not self.config.reasoning_parser or self.config.enable_in_reasoning:
            return
        with self._gate_lock:
            if self._gate is None:
                self._gate = ReasoningGate(self.config.reasoning_parser, tokenizer())
        so.state = self._gate.initial_state(prompt_token_ids)

    def take_builds(self) -> None:
        """Take the builds the grammar process has answered since (all of them, at once): a
        caller asking `ready` of many requests calls this first, then ready(poll=False)."""
        if self._process is not None:
            self._process.pump()

    def ready(self, request: Request, poll: bool = True) -> bool:
        """Whether the grammar is built (or failed: then `error` is set); ``poll`` first takes
        the builds answered since (take_builds)."""
        so = request.structured_output
        if so.grammar is not None or so.error is not None:
            return True
        if poll and not so.future.done():
            self.take_builds()
        if not so.future.done():
            return False
        try:
            so.grammar = so.future.result()
            if self._process is not None:  # the process's answers name the key
                self._by_key[so.grammar.key] = request
                self._remember_build(so.build_key)
        except Exception as exc:  # validated in the front end, so a backend's own failure
            self._build_failed(request, exc)
        so.future = None
        return True

    def _build_failed(self, request: Request, exc: BaseException) -> None:
        so = request.structured_output
        so.error = (str(exc) if isinstance(exc, GrammarBuildError)
                    else f"{type(exc).__name__}: {exc}")
        logger.error("request %s: the %s grammar backend failed to build its grammar: %s",
                     request.request_id, so.backend, so.error)

    def _remember_build(self, build_key: tuple) -> None:
        built = self._built_before
        built[build_key] = None
        built.move_to_end(build_key)
        # No more than the process's compile cache holds: a key remembered here is then
        # mostly still compiled there (both in the order of use), so its quiet build is a
        # matcher's making, not a compile that a step waits for.
        if len(built) > self.config.max_cache_size:
            built.popitem(last=False)

    def _quiet_build_failed(self, key: int, error: str) -> None:
        """The grammar process failed the build of a request scheduled at once (see
        `_built_before`; a build that succeeded before, so not the spec's fault): the request
        ends."""
        request = self._by_key.get(key)
        if request is None or request.structured_output.ended is not None:
            return
        so = request.structured_output
        self._build_failed(request, GrammarBuildError(error))
        so.ended = RequestStatus.FINISHED_ABORTED
        self._finished.append((request, so.ended))

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for some grammar build to finish (nothing else to do)."""
        if self._process is not None:
            self._process.pump(timeout)
            return
        with self._done:
            self._done.wait(timeout)

    # ---- stepping ----------------------------------------------------------------------
    def accept(self, request: Request, token: int) -> bool:
        """Advance the grammar by a sampled token; True when the request is finished by it."""
        return bool(self.accept_many([(request, token)]))

    def accept_many(self, sampled: list[tuple[Request, int]]) -> list[Request]:
        """Advance each request's grammar by its sampled token (a step's tokens, after each is
        appended to its request; with a grammar process only recorded, before that, for the
        next fill: Scheduler.grammar_tokens): each backend takes its rows in one call
        (xgrammar's: one native call for the rows). Returns the requests the grammar
        finished: complete (status FINISHED_STOPPED) or refusing the token (FINISHED_ABORTED,
        logged; it cannot happen with the mask applied)."""
        if self._process is not None:  # the next fill sends them (see use_process)
            keys, tokens = self._accepts
            keys += [request.structured_output.grammar.key for request, _ in sampled]
            tokens += [token for _, token in sampled]
            return []
        by_backend: dict[str, list[tuple[Request, int]]] = {}
        for request, token in sampled:
            if self._takes_token(request, token):
                by_backend.setdefault(request.structured_output.backend, []).append(
                    (request, token))
        finished: list[Request] = []
        for name, rows in by_backend.items():
            ended = self._compiler.backends[name].advance(
                [request.structured_output.grammar for request, _ in rows], [t for _, t in rows])
            for request, _ in rows:
                request.structured_output.num_accepted += 1
            for i, accepted in ended:
                request, token = rows[i]
                if accepted:
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    logger.error("request %s: the grammar refused sampled token %d; aborting it",
                                 request.request_id, token)
                    request.status = RequestStatus.FINISHED_ABORTED
                finished.append(request)
        return finished

    def _takes_token(self, request: Request, token: int) -> bool:
        """Whether the grammar is to advance by ``token`` now: not while the output is still
        reasoning (the reasoning gate moves on instead), nor under deferred accepts."""
        so = request.structured_output
        if so.state != ANSWER:  # reasoning (or its first token): the gate moves on
            was = so.state
            so.state, takes = self._gate.advance(was, token)  # type: ignore[union-attr]
            if so.state == ANSWER:  # the answer starts here (its first token) or next
                so.start = len(request.output_token_ids) - (1 if takes else 0)
            if not takes:
                return False
        return not self.defer_accepts  # else the next fill advances the grammar (see __init__)

    def take_finished(self) -> list[tuple[Request, RequestStatus]]:
        """The requests (and the status to end them with) whose grammar the fills since the
        last call found complete or refusing its token (deferred accepts); the engine core
        ends them (Scheduler.finish_by_grammar)."""
        finished, self._finished = self._finished, []
        return finished

    def shutdown(self) -> None:
        if self._process is not None:
            self._process.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
            self._fill_thread = None
