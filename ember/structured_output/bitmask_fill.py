"""The step's grammar bitmask, the fill side of StructuredOutputManager (a base class of it).

`sampling_rows(plan)` chooses the scheduled requests that sample under a grammar this step;
`fill(requests)` / `fill_async(requests)` give their int32 bitmask rows (xgrammar's / llguidance's
layout), each backend filling its rows in one call: on a helper thread that overlaps the engine
thread's work (tokens a grammar has not seen are replayed first, or, with deferred accepts,
advanced in one batched backend call), or in the grammar process (one message a step: the
tokens sampled since the last, then each row's grammar key; the rows are written into a shared
page-locked buffer, the answer taken by `PendingProcessFill.result`). The grammars found
complete or refusing a token are recorded for `take_finished`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ember.core.request import Request, RequestStatus
from ember.core.scheduler_output import GrammarBitmask, SchedulerOutput
from ember.structured_output.compiler import Advances, advance_grammars, fill_grammar_rows
from ember.structured_output.reasoning_gate import REASONING, UNDECIDED

if TYPE_CHECKING:
    from ember.structured_output.compiler import GrammarCompiler
    from ember.structured_output.reasoning_gate import ReasoningGate
    from ember.structured_output.switch_interval import ShortSwitchInterval

logger = logging.getLogger("ember")

# The GIL switch interval while a bitmask is filled on the helper thread (see fill_async).
FILL_SWITCH_INTERVAL_S = 0.0002


class BitmaskFilling:
    """The bitmask's rows and their fill; the state is StructuredOutputManager's."""

    _compiler: GrammarCompiler
    _process: Any
    _gate: ReasoningGate | None
    _switch_interval: ShortSwitchInterval
    _fill_thread: ThreadPoolExecutor | None
    _finished: list[tuple[Request, RequestStatus]]
    _accepts: tuple[list[int], list[int]]
    _by_key: Any
    _allocate_host: Callable[[int], Any] | None
    _host_buffers: list[Any]
    _host_next: int
    defer_accepts: bool
    last_fill: tuple[float, float]
    last_fill_phases: dict[str, float]
    vocab_size: int

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
            return self._fill_in_process(requests, self._next_host_buffer())
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

    def _record_ended_keys(self, keys: list[tuple[int, bool]]) -> None:
        """The grammar process's (key, accepted) of the grammars that ended: their requests
        are recorded for take_finished (those still alive and not ending already)."""
        outcomes, requests = [], {}
        for i, (key, ok) in enumerate(keys):
            request = self._by_key.get(key)
            if request is not None and request.structured_output.ended is None:
                outcomes.append((i, ok))
                requests[i] = request
        self._record_endings(outcomes, requests)

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

        if undecided:  # the first token may also open a reasoning block
            self._gate.allow_start(bitmask.numpy(), undecided)  # type: ignore[union-attr]
        return GrammarBitmask([r.request_id for r in constrained], bitmask)

    def _fill_in_process(self, requests: list[Request], slot: int | None) -> PendingProcessFill:
        """Send a fill to the grammar process (the tokens sampled since the last one, then a
        row for each of `requests`); its result is taken when asked for."""
        process = self._process
        assert slot is not None and process is not None
        accepts, self._accepts = self._accepts, ([], [])
        seq, bitmask = process.fill(accepts, requests, slot, self._bitmask_shape(requests))
        return PendingProcessFill(self, seq, requests, bitmask)


class PendingProcessFill:
    """A fill sent to the grammar process; `result()` (on the engine thread) waits for its
    answer and gives the bitmask, as fill_async's future does."""

    def __init__(self, manager: BitmaskFilling, seq: int, requests: list[Request],
                 bitmask: Any) -> None:
        self._manager = manager
        self._seq = seq
        self._requests = requests
        self._bitmask = bitmask
        self._result: GrammarBitmask | None = None

    def result(self) -> GrammarBitmask:
        if self._result is None:
            manager = self._manager
            outcomes, start, end, phases = manager._process.reply(self._seq)
            if outcomes:  # the keys whose grammar ended, by their requests
                manager._record_ended_keys(outcomes)
            manager.last_fill = (start, end)
            manager.last_fill_phases = phases
            self._result = GrammarBitmask([r.request_id for r in self._requests],
                                          self._bitmask)
        return self._result
