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
  under async scheduling that is while the step's forward runs (ember.core.engine_core).

With a grammar process (`use_process`, ember.structured_output.grammar_process) the grammars
live there: accepts are always deferred, and each fill is one message to it (the tokens the
grammars have not seen, the rows to fill into a shared buffer) answered when the engine thread
takes the result.

Preemption keeps a request's generated tokens (it is recomputed, not rolled back), so its grammar
state stays valid; should a grammar ever be behind the request's tokens, the missing tokens are
replayed before its mask is filled.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ember.core.request import Request, RequestStatus
from ember.core.scheduler_output import GrammarBitmask, SchedulerOutput
from ember.structured_output.compiler import (
    Advances,
    GrammarCompiler,
    advance_grammars,
    fill_grammar_rows,
)
from ember.structured_output.config import StructuredOutputsConfig
from ember.structured_output.grammar_process import GrammarBuildError
from ember.structured_output.interface import Grammar, GrammarSpec
from ember.structured_output.reasoning_gate import ANSWER, REASONING, UNDECIDED, ReasoningGate
from ember.structured_output.switch_interval import ShortSwitchInterval
from ember.structured_output.validation import select_backend

logger = logging.getLogger("ember")

# The GIL switch interval while a bitmask is filled on the helper thread (see fill_async).
FILL_SWITCH_INTERVAL_S = 0.0002


class StructuredOutputRequest:
    """A request's grammar: its spec, the build in progress, then the matcher."""

    __slots__ = ("spec", "backend", "future", "grammar", "num_accepted", "error", "state",
                 "start", "ended")

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


class StructuredOutputManager:
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
        on."""
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
            process = self._start_process()
            if self.config.reasoning_parser and not self.config.enable_in_reasoning:
                # The reasoning gate stays here (it needs the tokenizer: loaded on the pool).
                so.future = self._submit(self._build_remote, process, so, stop_ids,
                                         request.prompt_token_ids)
            else:
                so.future = process.add(backend, spec, stop_ids)
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

    def _build_remote(self, process: Any, so: StructuredOutputRequest, stop_ids: list[int],
                      prompt_token_ids: list[int]) -> Any:
        self._start_gate(so, prompt_token_ids, self._load_tokenizer)
        return process.add(so.backend, so.spec, stop_ids)  # a future: see ready()

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

    def ready(self, request: Request) -> bool:
        """Whether the grammar is built (or failed: then `error` is set)."""
        so = request.structured_output
        if so.grammar is not None or so.error is not None:
            return True
        if self._process is not None:
            self._process.pump()  # builds answered since
        if not so.future.done():
            return False
        try:
            grammar = so.future.result()
            if isinstance(grammar, Future):  # the gate is set; the process builds the grammar
                so.future = grammar
                return self.ready(request)
            so.grammar = grammar
        except Exception as exc:  # validated in the front end, so a backend's own failure
            so.error = (str(exc) if isinstance(exc, GrammarBuildError)
                        else f"{type(exc).__name__}: {exc}")
            logger.error("request %s: the %s grammar backend failed to build its grammar: %s",
                         request.request_id, so.backend, so.error)
        so.future = None
        return True

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
        appended to its request): each backend takes its rows in one call (xgrammar's: one
        native call for the rows). Returns the requests the grammar finished: complete (status
        FINISHED_STOPPED) or refusing the token (FINISHED_ABORTED, logged; it cannot happen
        with the mask applied)."""
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
        if so.state != ANSWER:  # reasoning (or its first token): the grammar waits
            was, so.state = so.state, self._gate.next_state(so.state, token)  # type: ignore[union-attr]
            if so.state != ANSWER:
                return False
            so.start = len(request.output_token_ids) - (1 if was == UNDECIDED else 0)
            if was != UNDECIDED:
                return False  # the end tag: the answer starts with the next token
        return not self.defer_accepts  # else the next fill advances the grammar (see __init__)

    def sampling_rows(self, plan: SchedulerOutput) -> list[Request]:
        """The requests of `plan` that sample under a grammar: scheduled up to their last known
        token, or past it (async scheduling: the token before is still in flight, and the mask
        is filled once it is folded in)."""
        return [r for r in plan.scheduled_requests if r.structured_output is not None
                and r.num_computed_tokens >= r.num_tokens
                and r.structured_output.grammar is not None]

    def grammar_bitmask(self, plan: SchedulerOutput) -> GrammarBitmask | None:
        """The bitmask rows of the requests that sample under a grammar in `plan` (every token
        before this step must be folded in)."""
        rows = self.sampling_rows(plan)
        return self.fill(rows) if rows else None

    def fill(self, requests: list[Request]) -> GrammarBitmask:
        """The bitmask of those of `requests` that sample under their grammar now (row i for
        req_ids[i]), from their grammars' current states; each backend fills its rows in one
        call (in parallel where it can). Left out, so unmasked: requests finished by the token
        folded in last (their sample is dropped), still reasoning, or with a complete grammar."""
        if self._process is not None:
            return self.fill_async(requests).result()
        return self._fill_rows(self._rows(requests), self._next_host_buffer())

    def _next_host_buffer(self) -> int | None:
        """The host buffer slot the next fill writes into (chosen on the engine thread), or
        None for a fresh array."""
        if not self._host_buffers:
            return None
        slot = self._host_next
        self._host_next = (slot + 1) % len(self._host_buffers)
        return slot

    def fill_async(self, requests: list[Request]) -> Future:
        """fill() with the backends' native fill running on while this thread goes on (the
        built-in backends release the GIL inside it). The rows are chosen here (tokens not yet
        seen replayed), so no grammar may advance before the result is taken.

        A thread that needs the GIL while another runs Python gets it only after the switch
        interval (5 ms by default), longer than the work it would overlap. So the interval is
        short until the result is set: the helper starts its fill, and comes back from it,
        within 0.2 ms whatever this thread runs. (Waiting here until the helper had started
        instead cost this thread 0.5 ms a call in thread wake-ups and GIL hand-overs; without
        the short interval the helper, back from the native fill, could wait for the GIL until
        this thread blocked on the result: 0.6-0.7 ms in a CPU experiment, 5-17 us with it.)
        """
        if self._process is not None:
            return self._fill_in_process(self._rows(requests), self._next_host_buffer())
        if self._fill_thread is None:
            self._fill_thread = ThreadPoolExecutor(1, thread_name_prefix="ember-bitmask")
        rows = self._rows(requests)
        self._switch_interval.begin()
        try:
            future = self._fill_thread.submit(self._fill_rows, rows, self._next_host_buffer())
        except BaseException:
            self._switch_interval.end()
            raise
        # Run by the helper just after the result is set (or here, if it is set already).
        future.add_done_callback(lambda _done: self._switch_interval.end())
        return future

    def take_finished(self) -> list[tuple[Request, RequestStatus]]:
        """The requests (and the status to end them with) whose grammar the fills since the
        last call found complete or refusing its token (deferred accepts); the engine core
        ends them (Scheduler.finish_by_grammar)."""
        finished, self._finished = self._finished, []
        return finished

    def _rows(self, requests: list[Request]) -> tuple:
        """(the requests with a bitmask row, each backend's grammars and rows, the rows whose
        first token may open a reasoning block, and with deferred accepts the tokens the
        grammars are to take first with their rows' requests: (Advances, {row: request}))."""
        constrained: list[Request] = []
        by_backend: dict[str, tuple[list, list[int]]] = {}
        undecided = []
        advances = Advances()  # deferred accepts
        advanced: dict[int, Request] = {}  # their rows' requests
        for request in requests:
            so = request.structured_output
            if (request.status >= RequestStatus.FINISHED_STOPPED or so.state == REASONING
                    or so.ended is not None):
                continue
            outputs = request.output_token_ids
            grammar = so.grammar
            behind = len(outputs) - so.start - so.num_accepted
            if behind > 0 and self.defer_accepts:  # advanced by the fill (_advance)
                advances.add(len(constrained), so.backend, grammar, outputs[-behind:])
                advanced[len(constrained)] = request
                so.num_accepted += behind
            elif behind > 0:  # replay what it has not seen
                for token in outputs[-behind:]:
                    grammar.accept_token(token)
                so.num_accepted += behind
                if grammar.is_terminated():
                    continue
            # (else it is not complete: accept() finished the request when it completed)
            row = len(constrained)
            constrained.append(request)
            if so.state == UNDECIDED:
                undecided.append(row)
            entry = by_backend.get(so.backend)
            if entry is None:
                entry = by_backend[so.backend] = ([], [])
            entry[0].append(grammar)
            entry[1].append(row)
        return constrained, by_backend, undecided, (advances, advanced)

    def _advance(self, advances: tuple[Advances, dict[int, Request]]) -> set[int]:
        """Deferred accepts: each row's grammar takes its tokens; returns the rows whose grammar
        then ends the request (complete, or refusing a token: recorded for take_finished)."""
        grouped, requests = advances
        return self._record_endings(advance_grammars(self._compiler.backends, grouped), requests)

    def _record_endings(self, outcomes: list[tuple[int, bool]],
                        requests: dict[int, Request]) -> set[int]:
        """Mark the requests of the rows whose grammar ended (row, accepted) for take_finished;
        returns those rows."""
        for row, ok in outcomes:
            request = requests[row]
            so = request.structured_output
            if not ok:
                logger.error("request %s: the grammar refused a sampled token; aborting it",
                             request.request_id)
                so.ended = RequestStatus.FINISHED_ABORTED
            else:
                so.ended = RequestStatus.FINISHED_STOPPED
            self._finished.append((request, so.ended))
        return {row for row, _ in outcomes}

    def _bitmask_shape(self, constrained: list[Request]) -> tuple[int, int]:
        return (len(constrained), (self.vocab_size + 31) // 32)

    def _fill_rows(self, rows: tuple, slot: int | None = None) -> GrammarBitmask:
        import numpy as np
        import torch

        constrained, by_backend, undecided, advances = rows
        # Deferred accepts first (their rows left unmasked if the request ends: its sample is
        # dropped).
        ended = self._advance(advances) if advances[0] else ()
        # Made here, on fill_async's helper thread (numpy fills it without the GIL). numpy, not
        # torch.full: a torch op on the host wakes its thread pool, whose spinning threads then
        # compete with the grammar backends' fill threads (4x slower on an H200 host with 16
        # cores).
        shape = self._bitmask_shape(constrained)
        if slot is None:
            bitmask = torch.from_numpy(np.empty(shape, dtype=np.int32))
        else:
            buffer = self._host_buffers[slot]
            numel = shape[0] * shape[1]
            if buffer is None or buffer.numel() < numel:
                buffer = self._host_buffers[slot] = self._allocate_host(  # type: ignore[misc]
                    max(numel, 2 * (0 if buffer is None else buffer.numel())))
            bitmask = buffer[:numel].view(shape)  # fill_grammar_rows sets every row
        start = time.perf_counter()
        fill_grammar_rows(self._compiler.backends, by_backend, bitmask, ended)
        self.last_fill = (start, time.perf_counter())
        return self._finish_bitmask(constrained, undecided, bitmask)

    def _finish_bitmask(self, constrained: list[Request], undecided: list[int],
                        bitmask: Any) -> GrammarBitmask:
        import numpy as np

        if undecided:  # the first token may also open a reasoning block
            start_id = self._gate.start_id  # type: ignore[union-attr]
            word, bit = divmod(start_id, 32)
            bitmask.numpy()[undecided, word] |= np.array(1 << bit, dtype=np.int64).astype(
                np.int32)
        return GrammarBitmask([r.request_id for r in constrained], bitmask)

    def _fill_in_process(self, rows: tuple, slot: int | None) -> PendingProcessFill:
        """Send a fill to the grammar process; its result is taken when asked for."""
        constrained, by_backend, undecided, advances = rows
        process = self._process
        assert slot is not None and process is not None
        grouped, advanced = advances
        seq, bitmask = process.fill(grouped, by_backend, slot, self._bitmask_shape(constrained))
        return PendingProcessFill(self, seq, constrained, undecided, bitmask, advanced)

    def shutdown(self) -> None:
        if self._process is not None:
            self._process.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
            self._fill_thread = None


class PendingProcessFill:
    """A fill sent to the grammar process; `result()` (on the engine thread) waits for its
    answer and gives the bitmask, as fill_async's future does."""

    def __init__(self, manager: StructuredOutputManager, seq: int, constrained: list[Request],
                 undecided: list[int], bitmask: Any, advanced: dict[int, Request]) -> None:
        self._manager = manager
        self._seq = seq
        self._constrained = constrained
        self._undecided = undecided
        self._bitmask = bitmask
        self._advanced = advanced
        self._result: GrammarBitmask | None = None

    def result(self) -> GrammarBitmask:
        if self._result is None:
            manager = self._manager
            outcomes, start, end, phases = manager._process.reply(self._seq)
            manager._record_endings(outcomes, self._advanced)
            manager.last_fill = (start, end)
            manager.last_fill_phases = phases
            self._result = manager._finish_bitmask(self._constrained, self._undecided,
                                                   self._bitmask)
        return self._result
