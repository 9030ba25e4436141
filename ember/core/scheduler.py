"""Scheduler: builds each step under a token budget, mixing decodes and prefill chunks.

There are no phases: every running request asks for the tokens it still lacks (1 for a decode, the
rest of its prompt for a prefill), capped by the step's remaining budget, so long prompts are
chunked. Running requests go first; if blocks run out, the newest running request is preempted
(its blocks freed, to be recomputed later). Waiting requests are admitted while budget, blocks and
`max_num_seqs` allow, after a prefix-cache lookup.

Under the "priority" policy (vLLM's) the waiting queue is ordered by (priority, arrival time),
lower first; the request preempted when blocks run out is the running one that ranks last, and a
waiting request that finds no blocks preempts running requests that rank below it (vLLM v0's
rule; v1 lets it wait: docs/architecture.md says why ember does not).

Structured outputs: a request whose grammar is still compiling waits aside (`compiling`) and
joins the waiting queue when its grammar is ready, so it blocks no one; each sampled token
advances its grammar, and a grammar that completes finishes the request ("stop").

Progress (`num_computed_tokens`) advances when a step is scheduled, not when it returns, so with
asynchronous scheduling the next step can be planned while this one runs: a request that will
sample gets an output placeholder, and its next decode is scheduled before the token is known (the
workers feed it from the device). Results of a request that has finished meanwhile are dropped.
"""

from __future__ import annotations

import time

from ember.core.kv_cache_manager import KVCacheManager
from ember.core.request import Request, RequestStatus
from ember.core.request_queue import PriorityQueue, make_waiting_queue
from ember.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        async_scheduling: bool = False,
        policy: str = "fcfs",
        structured_output=None,
        max_concurrent_batches: int = 1,
    ) -> None:
        self.kv = kv_cache_manager
        self.policy = policy
        self.async_scheduling = async_scheduling
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(policy)
        self.running: list[Request] = []
        # Structured outputs (ember.structured_output.manager): requests whose grammar is being
        # built, and those ended outside a step's fold-in (a failed build: "abort"; a grammar
        # found complete or refusing a token as the bitmask was filled: finish_by_grammar); the
        # engine core reports the latter with its next outputs.
        self.structured_output = structured_output
        self.compiling: list[Request] = []
        self.ended: list[Request] = []
        self._finished_ids: set[str] = set()  # to tell the workers at the next step
        self._known_to_workers: dict[str, int] = {}  # req id -> blocks the workers know of
        # Workers keep a preempted request's state (its generator) until it finishes.
        self._worker_states: set[str] = set()
        self.num_preemptions = 0
        # Pipeline parallel batch queue: several batches in flight, a request in at most one of
        # them (its next token is then known when it is scheduled again).
        self.max_concurrent_batches = max_concurrent_batches
        self.in_flight_ids: set[str] = set()

    # ---- request lifecycle -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        so = request.structured_output
        if so is not None and so.grammar is None:  # (set at once when built before)
            self.compiling.append(request)  # joins `waiting` when its grammar is built
            return
        self.waiting.append(request)

    def _admit_compiled(self) -> None:
        """Move requests whose grammar is built into the waiting queue (in arrival order)."""
        still = []
        structured = self.structured_output
        structured.take_builds()  # once a pass, not once a request (a pipe poll each)
        for request in self.compiling:
            if not structured.ready(request, poll=False):
                still.append(request)
            elif request.structured_output.error is not None:
                request.status = RequestStatus.FINISHED_ABORTED
                self._free(request)
                self.ended.append(request)
            else:
                self.waiting.append(request)
        self.compiling = still

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string): free their blocks now."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            self._remove(request)
            request.status = status
            self._free(request)

    def finish_by_grammar(self, request: Request, status: RequestStatus) -> None:
        """End a request whose grammar, advanced as its bitmask was filled (deferred accepts:
        ember.structured_output.manager), completed (``FINISHED_STOPPED``) or refused its
        token (``FINISHED_ABORTED``): as update_from_output would have, a step later; its
        token sampled meanwhile is dropped."""
        if request.is_finished() or self.requests.get(request.request_id) is not request:
            return
        self._remove(request)
        request.status = status
        self._free(request)
        self.ended.append(request)

    def _remove(self, request: Request) -> None:
        try:
            self.running.remove(request)
        except ValueError:  # waiting, or preempted while its last step was in flight
            if request in self.compiling:
                self.compiling.remove(request)
            else:
                self.waiting.remove(request)

    def _free(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        self._known_to_workers.pop(request.request_id, None)
        if request.request_id in self._worker_states:
            self._finished_ids.add(request.request_id)
            self._worker_states.discard(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.compiling)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.compiling)

    # ---- one step ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.compiling:
            self._admit_compiled()
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.max_num_batched_tokens
        preempted_now = False
        scheduled: list[Request] = []
        batch_queue = self.max_concurrent_batches > 1
        in_flight, max_seqs = self.in_flight_ids, self.max_num_seqs
        if batch_queue:
            # A batch takes its share of the requests, so the next batch (scheduled while this
            # one runs on the first stage) has requests left to run on it.
            wanted = min(len(self.running) + len(self.waiting), self.max_num_seqs)
            max_seqs = -(-wanted // self.max_concurrent_batches)

        idx = 0
        running, max_model_len = self.running, self.max_model_len
        # The hottest loop of the host side (every running request, every step): attributes
        # are read directly rather than through Request's properties.
        while idx < len(running) and budget > 0:
            request = running[idx]
            if batch_queue and (request.request_id in in_flight or len(scheduled) >= max_seqs):
                idx += 1  # in a batch in flight, or this batch has its share
                continue
            pending = request.num_output_placeholders
            if pending and (len(request.output_token_ids) + pending
                            >= request.sampling_params.max_tokens):
                idx += 1  # its last token is already in flight: it finishes when that returns
                continue
            computed = request.num_computed_tokens
            num_new = min(len(request.all_token_ids) + pending - computed, budget,
                          max_model_len - computed)
            if num_new <= 0:
                idx += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                if self.policy == "fcfs":
                    victim = running.pop()  # the newest request loses its blocks
                else:
                    victim = max(running, key=PriorityQueue.key)  # the lowest-ranked one does
                    if running.index(victim) < idx:
                        idx -= 1  # scheduled earlier in this step: take its tokens back
                    running.remove(victim)
                    budget += self._unschedule(victim, out, scheduled)
                self._preempt(victim, out)
                preempted_now = True
                if victim is request:
                    break
            else:
                scheduled.append(request)
                out.num_scheduled_tokens[request.request_id] = num_new
                budget -= num_new
                idx += 1
                continue
            if self.policy == "fcfs":
                break  # the request itself was preempted; everything after it is gone too
            # priority: it ranked last; those after it rank above it and may still fit

        while (
            self.waiting
            and budget > 0
            and not preempted_now
            and len(self.running) < self.max_num_seqs
            and len(scheduled) < max_seqs
        ):
            request = self.waiting[0]
            if batch_queue and request.request_id in in_flight:
                break  # preempted while its batch is in flight: it waits for that batch
            hits, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            admitted = self.kv.allocate_slots(request, num_new, hits)
            while not admitted and self.policy == "priority":
                victim = self._lower_ranked_running(request)
                if victim is None:
                    break
                self.running.remove(victim)
                budget += self._unschedule(victim, out, scheduled)
                self._preempt(victim, out)
                admitted = self.kv.allocate_slots(request, num_new, hits)
            if not admitted:
                break
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            self.running.append(request)
            scheduled.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new

        known_blocks, blocks_of = self._known_to_workers, self.kv.req_to_blocks
        num_scheduled, async_scheduling = out.num_scheduled_tokens, self.async_scheduling
        for request in scheduled:
            req_id = request.request_id
            known = known_blocks.get(req_id)
            if known is None or len(blocks_of[req_id]) != known:
                self._describe(request, out)
            request.num_computed_tokens += num_scheduled[req_id]
            if async_scheduling and request.num_computed_tokens == (
                len(request.all_token_ids) + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # its sampled token is known after the step
        out.scheduled_requests = scheduled
        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        if batch_queue:
            if out.is_empty:  # not launched: the workers hear of these with the next batch
                self._finished_ids |= out.finished_req_ids
            in_flight.update(num_scheduled)
        return out

    def _lower_ranked_running(self, request: Request) -> Request | None:
        """The running request ranked last, if it ranks below `request` (priority policy)."""
        if not self.running:
            return None
        victim = max(self.running, key=PriorityQueue.key)
        return victim if PriorityQueue.key(victim) > PriorityQueue.key(request) else None

    @staticmethod
    def _unschedule(request: Request, out: SchedulerOutput, scheduled: list[Request]) -> int:
        """Drop a request from this step's plan; returns the tokens it had been given."""
        if request in scheduled:
            scheduled.remove(request)
        return out.num_scheduled_tokens.get(request.request_id, 0)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.num_scheduled_tokens.pop(request.request_id, None)
        if request.request_id in self._known_to_workers:
            out.preempted_req_ids.add(request.request_id)
            self._known_to_workers.pop(request.request_id, None)

    def _describe(self, request: Request, out: SchedulerOutput) -> None:
        req_id = request.request_id
        known = self._known_to_workers.get(req_id)
        num_blocks = self.kv.num_blocks_of(req_id)
        if known is not None:
            # Workers count progress themselves; they only need to hear of new blocks.
            if num_blocks != known:
                self._known_to_workers[req_id] = num_blocks
                out.cached_requests.append(
                    CachedRequestData(req_id, self.kv.block_ids(req_id, known),
                                      request.num_computed_tokens)
                )
        else:
            self._known_to_workers[req_id] = num_blocks
            self._worker_states.add(req_id)
            block_ids = self.kv.block_ids(req_id)
            out.new_requests.append(
                NewRequestData(
                    req_id,
                    request.prompt_token_ids,
                    list(request.output_token_ids),
                    request.sampling_params,
                    block_ids,
                    request.num_computed_tokens,
                )
            )

    # ---- results -----------------------------------------------------------------------
    @staticmethod
    def grammar_tokens(out: SchedulerOutput, result: ModelRunnerOutput,
                       ) -> list[tuple[Request, int]]:
        """The step's tokens for a grammar process, in order: those of the requests under a
        grammar that update_from_output will append them to (not finished meanwhile). The
        engine core hands them over before the update (see update_from_output)."""
        sampled, finished = result.sampled_token_ids, RequestStatus.FINISHED_STOPPED
        return [(request, sampled[request.request_id]) for request in out.scheduled_requests
                if request.structured_output is not None and request.status < finished
                and request.request_id in sampled]

    def update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests; returns those with news.
        With a grammar process the grammars' tokens are not handled here: the engine core
        hands the process grammar_tokens(out, result) first, and no request ends by its grammar
        here, so the stop checks need not wait for the process."""
        now = time.time()
        touched: list[Request] = []
        constrained: list[tuple[Request, int]] = []  # requests whose grammar takes the token
        in_process = self.structured_output is not None and \
            self.structured_output.uses_process
        sampled, max_model_len = result.sampled_token_ids, self.max_model_len
        in_flight = self.in_flight_ids
        for request in out.scheduled_requests:
            req_id = request.request_id
            if in_flight:
                in_flight.discard(req_id)
            if request.status >= RequestStatus.FINISHED_STOPPED:  # aborted/stopped meanwhile
                continue
            token = sampled.get(req_id)
            if token is None:
                if req_id in result.prompt_logprobs:
                    touched.append(request)
                continue
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            request.append_output_token(token)
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if request.structured_output is not None and not in_process:
                constrained.append((request, token))  # ended after the step's grammar advance
            elif request.check_stop(max_model_len):
                self._remove(request)
                self._free(request)
            touched.append(request)
        if constrained:
            ended = {id(r) for r in self.structured_output.accept_many(constrained)}
            for request, _ in constrained:
                if id(request) in ended or request.check_stop(max_model_len):
                    self._remove(request)
                    self._free(request)
        return touched
