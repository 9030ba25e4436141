"""OutputProcessor: turns engine progress into RequestOutputs (detokenize, stop strings, n > 1).

A user request with n > 1 is served as n child sequences; this module gathers them back into
one RequestOutput with n CompletionOutputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ember.core.request import Request
from ember.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ember.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChildState:
    request: Request
    detokenizer: object | None  # IncrementalDetokenizer, or None with detokenize=False
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    # Nothing to do for it until it finishes: final-only output, no text, no logprobs.
    quiet: bool = False


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    extra: dict = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.child_states: dict[str, tuple[ParentState, ChildState]] = {}  # by child id

    def add(self, parent: ParentState) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.child_states[child.request.request_id] = (parent, child)

    def make_child(self, request: Request) -> ChildState:
        params = request.sampling_params
        detok = None
        if params.detokenize and self.tokenizer is not None:
            from ember.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        wants_lp = params.logprobs is not None
        quiet = (params.output_kind == RequestOutputKind.FINAL_ONLY and detok is None
                 and not wants_lp)
        return ChildState(request, detok, [] if wants_lp else None, 0.0 if wants_lp else None,
                          quiet)

    def _decode_token(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _logprob_dict(self, ids: list[int], values: list[float], rank: int) -> dict[int, Logprob]:
        # The first entry is the sampled/actual token; the rest are the top-k in rank order.
        entries = {ids[0]: Logprob(values[0], rank, self._decode_token(ids[0]))}
        for r, (tok, val) in enumerate(zip(ids[1:], values[1:]), start=1):
            entries.setdefault(tok, Logprob(val, r, self._decode_token(tok)))
        return entries

    def process(self, touched: list[Request], runner_out, stop_cb) -> list[RequestOutput]:
        """Fold one step's results in; `stop_cb(child_ids)` ends children that hit a stop string."""
        changed: dict[str, ParentState] = {}
        stopped: list[str] = []
        child_states, prompt_logprobs = self.child_states, runner_out.prompt_logprobs
        for request in touched:
            entry = child_states.get(request.request_id)
            if entry is None:
                continue
            parent, child = entry
            if child.quiet and not prompt_logprobs and not request.is_finished():
                continue  # the common case of offline generate: nothing to report yet
            if request.request_id in prompt_logprobs and request.index == 0:
                self._add_prompt_logprobs(parent, runner_out.prompt_logprobs[request.request_id])
            token = runner_out.sampled_token_ids.get(request.request_id)
            hit_stop = False
            if token is not None:
                if child.logprobs is not None and request.request_id in runner_out.logprobs:
                    ids, values, rank = runner_out.logprobs[request.request_id]
                    child.logprobs.append(self._logprob_dict(ids, values, rank))
                    child.cumulative_logprob += values[0]
                if child.detokenizer is not None:
                    child.detokenizer.append([token])
                    stop_str = child.detokenizer.stop_string_hit
                    if stop_str is not None and not request.is_finished():
                        request.stop_reason = stop_str  # stop_cb sets the status, frees blocks
                        stopped.append(request.request_id)
                        hit_stop = True
            # Final-only parents (offline generate) need an output only when a child ends.
            if (
                parent.params.output_kind != RequestOutputKind.FINAL_ONLY
                or hit_stop
                or request.is_finished()
            ):
                changed[parent.request_id] = parent
        if stopped:
            stop_cb(stopped)
        return [
            self.make_output(p)
            for p in changed.values()
            if p.params.output_kind != RequestOutputKind.FINAL_ONLY
            or all(c.request.is_finished() for c in p.children)
        ]

    def _add_prompt_logprobs(self, parent: ParentState, entries) -> None:
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]  # the first prompt token has no logprob
        for ids, values, rank in entries:
            parent.prompt_logprobs.append(self._logprob_dict(ids, values, rank))

    def make_output(self, parent: ParentState) -> RequestOutput:
        outputs = []
        for child in parent.children:
            request = child.request
            detok = child.detokenizer
            if detok is not None and request.is_finished() and not detok.finished:
                detok.finish()  # flush a trailing partial character
            outputs.append(
                CompletionOutput(
                    index=request.index,
                    # Cumulative and append-only: streamed deltas never need taking back.
                    text=detok.stable_text if detok is not None else "",
                    token_ids=list(request.output_token_ids),
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=child.logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        parent.finished = all(c.request.is_finished() for c in parent.children)
        if parent.finished:
            parent.metrics.finished_time = time.time()
            self._drop(parent)
        first = [c.request.metrics.first_token_time for c in parent.children]
        last = [c.request.metrics.last_token_time for c in parent.children]
        parent.metrics.first_token_time = min((t for t in first if t), default=None)
        parent.metrics.last_token_time = max((t for t in last if t), default=None)
        parent.metrics.num_preemptions = sum(c.request.metrics.num_preemptions for c in parent.children)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=parent.finished,
            prompt_logprobs=parent.prompt_logprobs,
            metrics=parent.metrics,
            num_cached_tokens=max(parent.children[0].request.num_cached_tokens, 0),
        )

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_states.pop(child.request.request_id, None)

    def abort(self, request_id: str) -> list[str]:
        """Forget a parent; returns its children's ids so the scheduler can free them."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        self._drop(parent)
        return [c.request.request_id for c in parent.children]
