"""OutputProcessor: engine-core outputs -> RequestOutputs (detokenize, stop strings, logprobs, n > 1).

The core sends each child sequence's new token ids and finish reason; here they are appended,
detokenized incrementally, checked for stop strings (a hit finishes the child here and asks the
caller to abort it in the core), and gathered back into one RequestOutput per parent request.

What an output holds follows the request's `output_kind` (vLLM's): CUMULATIVE gives every child's
whole text so far; DELTA only what is new since the last output (the children that changed, each
with its new text, token ids and logprobs; text that a stop string could still cut is held back,
so the deltas concatenate to exactly the cumulative result); FINAL_ONLY one output at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ember.core.messages import EngineCoreOutputs, PositionLogprobs
from ember.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ember.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ChildState:
    request_id: str
    index: int
    params: SamplingParams
    detokenizer: object | None  # IncrementalDetokenizer, or None with detokenize=False
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    # DELTA outputs: how much text, tokens and logprobs were handed out, and whether the finish was.
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False
    # The text is read only once the sequence ends (a FINAL_ONLY request without stop strings):
    # its tokens are detokenized then, in one pass, not a call a step.
    decode_at_end: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
    final_only: bool = False
    delta: bool = False


def outputs_at_end(params: SamplingParams) -> bool:
    """Whether nothing of a request is needed before it ends, so the engine core can send its
    tokens once, as it finishes (EngineCoreRequest.outputs_at_end): final outputs only, and
    nothing checked or collected per token here (stop strings, logprobs, prompt logprobs)."""
    return (params.output_kind == RequestOutputKind.FINAL_ONLY and params.logprobs is None
            and params.prompt_logprobs is None and not params.stop)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.children: dict[str, tuple[ParentState, ChildState]] = {}  # by child (core) id

    # ---- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str], child_params: list[SamplingParams],
                    arrival_time: float) -> ParentState:
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = [self._make_child(cid, i, p, prompt_token_ids)
                    for i, (cid, p) in enumerate(zip(child_ids, child_params))]
        final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        for child in children:
            child.decode_at_end = final_only and child.detokenizer is not None and \
                not child.detokenizer.stop
        parent = ParentState(request_id, prompt, prompt_token_ids, params, children,
                             RequestMetrics(arrival_time), final_only=final_only,
                             delta=params.output_kind == RequestOutputKind.DELTA)
        self.parents[request_id] = parent
        for child in children:
            self.children[child.request_id] = (parent, child)
        return parent

    def _make_child(self, request_id: str, index: int, params: SamplingParams,
                    prompt_token_ids: list[int]) -> ChildState:
        detok = None
        if params.detokenize and self.tokenizer is not None:
            from ember.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
        wants_lp = params.logprobs is not None
        return ChildState(request_id, index, params, detok, [] if wants_lp else None,
                          0.0 if wants_lp else None)

    def abort(self, request_id: str) -> list[str]:
        """Finish a parent as aborted; returns the ids of its children still running in the core
        (the caller aborts those there)."""
        parent = self.parents.get(request_id)
        if parent is None:
            return []
        live = []
        for child in parent.children:
            if not child.finished:
                child.finish_reason = "abort"
                live.append(child.request_id)
        self._drop(parent)
        return live

    def abort_requests(self, request_ids: list[str]) -> tuple[list[RequestOutput], list[str]]:
        """Abort parents: (a final "abort" output for each live one, the child ids still running
        in the core, which the caller aborts there)."""
        finals, core_ids = [], []
        for request_id in request_ids:
            parent = self.parents.get(request_id)
            core_ids += self.abort(request_id)
            if parent is not None:
                finals.append(self.make_output(parent))
        return finals, core_ids

    def has_unfinished(self) -> bool:
        return bool(self.parents)

    # ---- one step's outputs ------------------------------------------------------------
    def process(self, core_outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """Fold a step in: (the RequestOutputs to hand out, child ids a stop string ended)."""
        changed: dict[str, ParentState] = {}
        stopped: list[str] = []
        children, now = self.children, core_outputs.timestamp or time.time()
        for out in core_outputs.outputs:
            entry = children.get(out.request_id)
            if entry is None:
                continue  # aborted here while the step ran
            parent, child = entry
            if child.finished:
                continue  # a stop string ended it here; the core's abort is on its way
            if out.prompt_logprobs and child.index == 0:
                self._add_prompt_logprobs(parent, out.prompt_logprobs)
            new_ids = out.new_token_ids
            if new_ids:
                if child.first_token_time is None:
                    child.first_token_time = now
                child.last_token_time = now
                child.token_ids.extend(new_ids)
                if child.logprobs is not None:
                    for ids, values, rank in out.new_logprobs:
                        child.logprobs.append(self._logprob_dict(ids, values, rank))
                        child.cumulative_logprob += values[0]
                detok = child.detokenizer
                if detok is not None and not child.decode_at_end:
                    detok.append(new_ids)
                    stop_str = detok.stop_string_hit
                    if stop_str is not None and out.finish_reason is None:
                        child.finish_reason, child.stop_reason = "stop", stop_str
                        stopped.append(child.request_id)
            if out.first_token_time:  # an outputs-at-end sequence: the core's token times
                child.first_token_time = out.first_token_time
                child.last_token_time = out.last_token_time
            if out.finish_reason is not None and child.finish_reason is None:
                child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
            if out.num_cached_tokens >= 0:
                child.num_cached_tokens = out.num_cached_tokens
            if out.first_scheduled_time and child.first_scheduled_time is None:
                child.first_scheduled_time = out.first_scheduled_time
            child.num_preemptions = out.num_preemptions
            if not parent.final_only or child.finished:
                changed[parent.request_id] = parent
        outputs = []
        for p in changed.values():
            if p.final_only and not all(c.finished for c in p.children):
                continue
            output = self.make_output(p)
            if output.outputs or output.finished:  # a DELTA step may add nothing visible yet
                outputs.append(output)
        return outputs, stopped

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

    def _add_prompt_logprobs(self, parent: ParentState, entries: list[PositionLogprobs]) -> None:
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]  # the first prompt token has no logprob
        for ids, values, rank in entries:
            parent.prompt_logprobs.append(self._logprob_dict(ids, values, rank))

    def make_output(self, parent: ParentState) -> RequestOutput:
        outputs = []
        for child in parent.children:
            detok = child.detokenizer
            if child.decode_at_end and len(detok.token_ids) < len(child.token_ids):
                detok.append(child.token_ids[len(detok.token_ids):])  # the same calls, now
            if detok is not None and child.finished and not detok.finished:
                detok.finish()  # flush a trailing partial character
            # Cumulative and append-only: streamed deltas never need taking back.
            text = detok.stable_text if detok is not None else ""
            output = self._delta(child, text) if parent.delta else CompletionOutput(
                index=child.index,
                text=text,
                token_ids=list(child.token_ids),
                cumulative_logprob=child.cumulative_logprob,
                logprobs=child.logprobs,
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
            )
            if output is not None:
                outputs.append(output)
        parent.finished = all(c.finished for c in parent.children)
        if parent.finished:
            self._drop(parent)
        prompt_logprobs = parent.prompt_logprobs
        if parent.delta:
            # A DELTA stream carries them once, in the first output it hands out.
            if outputs or parent.finished:
                parent.prompt_logprobs = [] if prompt_logprobs is not None else None
            else:
                prompt_logprobs = None
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=parent.finished,
            prompt_logprobs=prompt_logprobs or None,
            metrics=self._update_metrics(parent),
            num_cached_tokens=parent.children[0].num_cached_tokens,
        )

    @staticmethod
    def _delta(child: ChildState, text: str) -> CompletionOutput | None:
        """What a child adds since its last DELTA output (None when nothing, finish included)."""
        if child.sent_finish:
            return None
        new_text, new_ids = text[child.sent_text:], child.token_ids[child.sent_tokens:]
        if not new_text and not new_ids and not child.finished:
            return None
        logprobs = None
        if child.logprobs is not None:
            logprobs = child.logprobs[child.sent_logprobs:]
            child.sent_logprobs = len(child.logprobs)
        child.sent_text, child.sent_tokens = len(text), len(child.token_ids)
        child.sent_finish = child.finished
        return CompletionOutput(
            index=child.index,
            text=new_text,
            token_ids=new_ids,
            cumulative_logprob=child.cumulative_logprob,  # vLLM's: the running total
            logprobs=logprobs,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )

    @staticmethod
    def _update_metrics(parent: ParentState) -> RequestMetrics:
        """The parent's times from its children's (the earliest first, the latest last)."""
        metrics, children = parent.metrics, parent.children
        if parent.finished and metrics.finished_time is None:
            metrics.finished_time = time.time()
        metrics.first_scheduled_time = min(
            (c.first_scheduled_time for c in children if c.first_scheduled_time), default=None)
        if metrics.first_scheduled_time is not None:
            metrics.time_in_queue = max(0.0, metrics.first_scheduled_time - metrics.arrival_time)
        metrics.first_token_time = min(
            (c.first_token_time for c in children if c.first_token_time), default=None)
        metrics.last_token_time = max(
            (c.last_token_time for c in children if c.last_token_time), default=None)
        metrics.num_preemptions = sum(c.num_preemptions for c in children)
        return metrics

    def _drop(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.children.pop(child.request_id, None)


def merge_delta_outputs(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """One DELTA output holding what two consecutive ones carry (vLLM's collector does this)."""
    by_index = {o.index: o for o in first.outputs}
    for new in second.outputs:
        old = by_index.get(new.index)
        if old is None:
            by_index[new.index] = new
            continue
        old.text += new.text
        old.token_ids = old.token_ids + new.token_ids
        if new.logprobs is not None:
            old.logprobs = (old.logprobs or []) + new.logprobs
        old.cumulative_logprob = new.cumulative_logprob
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    second.outputs = [by_index[i] for i in sorted(by_index)]
    second.prompt_logprobs = first.prompt_logprobs or second.prompt_logprobs
    return second
