"""LogitsProcessorSet: a model runner's logits processors, and which run on which rows each step.

The set builds each processor once, on first use, from ember.registry.LogitsProcessorRegistry:
the built-ins when the set is made (so a plugin that overrides one replaces it everywhere), a
processor a request names in `extra_args` when the first such request is sampled. Each step
`prepare` asks every selected processor's `is_active` per row and hands each processor its rows;
the sampler then applies them in vLLM v1's order (see StepProcessors).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.logits_processors.interface import (
    LogitsProcessor,
    ProcessorContext,
    RowState,
)
from ember.sampling_params import SamplingParams

# Driven by their own SamplingParams fields, in the order they are applied (vLLM v1's).
BUILTIN: tuple[str, ...] = ("allowed_token_ids", "bad_words", "min_tokens", "logit_bias", "min_p")
# The field that selects each built-in: one left unset (falsy) skips its `is_active` call, so a
# plain row costs a few attribute reads per step.
_FIELD = {"allowed_token_ids": "allowed_token_ids", "bad_words": "_bad_words_token_ids",
          "min_tokens": "min_tokens", "logit_bias": "logit_bias", "min_p": "min_p"}


def resolve_processor_class(name: str) -> type[LogitsProcessor]:
    """The class registered under `name` (imports it); a TypeError if it is no LogitsProcessor."""
    from ember.registry import LogitsProcessorRegistry

    cls = LogitsProcessorRegistry.resolve(name)
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise TypeError(f"logits processor {name!r} resolves to {cls!r}, which is not a "
                        "subclass of ember.logits_processors.LogitsProcessor")
    return cls


@dataclass
class StepProcessors:
    """This step's active processors, each already given its rows.

    `before_penalties` may change the argmax: they run on every row, after the raw logprobs and
    before penalties and temperature. `after_temperature` are argmax-invariant: they run on the
    temperature-scaled logits of random rows only (greedy rows have taken their argmax)."""

    before_penalties: list[LogitsProcessor] = field(default_factory=list)
    after_temperature: list[LogitsProcessor] = field(default_factory=list)


class LogitsProcessorSet:
    """One model runner's processors: built once each, asked per row which are active."""

    def __init__(self, ctx: ProcessorContext) -> None:
        self.ctx = ctx
        self._procs: dict[str, LogitsProcessor] = {}
        self._builtin = [(name, _FIELD[name], self._get(name)) for name in BUILTIN]

    def _get(self, name: str) -> LogitsProcessor:
        proc = self._procs.get(name)
        if proc is None:
            proc = self._procs[name] = resolve_processor_class(name)(self.ctx)
        return proc

    def _active(self, params: SamplingParams,
                num_output: int) -> Iterator[tuple[str, LogitsProcessor, Any]]:
        for name, field_name, proc in self._builtin:
            if getattr(params, field_name) and proc.is_active(params, None, num_output):
                yield name, proc, None
        for name, args in (params.extra_args or {}).items():
            proc = self._get(name)
            if proc.is_active(params, args, num_output):
                yield name, proc, args

    def affects_greedy(self, params: SamplingParams, num_output: int) -> bool:
        """Whether some processor may change the argmax of this request's next token."""
        return any(not proc.argmax_invariant for _, proc, _ in self._active(params, num_output))

    def needs_output_tokens(self, params: SamplingParams, num_output: int) -> bool:
        """Whether some active processor reads the values of the generated tokens."""
        return any(proc.needs_output_tokens for _, proc, _ in self._active(params, num_output))

    def prepare(
        self,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        req_ids: Sequence[str] | None = None,
    ) -> StepProcessors:
        """Give each processor active on some row of this step its rows (row i = logits row i)."""
        rows_of: dict[str, list[RowState]] = {}
        for i, p in enumerate(params):
            out = output_token_ids[i]
            for name, _, args in self._active(p, len(out)):
                req_id = req_ids[i] if req_ids is not None else str(i)
                rows_of.setdefault(name, []).append(
                    RowState(i, req_id, p, prompt_token_ids[i], out, args))
        step = StepProcessors()
        # Built-ins first in their fixed order, then the named ones by name: one order per step.
        for name in [*BUILTIN, *sorted(set(rows_of) - set(BUILTIN))]:
            rows = rows_of.get(name)
            if not rows:
                continue
            proc = self._procs[name]
            proc.update_state(rows, len(params))
            (step.after_temperature if proc.argmax_invariant else step.before_penalties).append(proc)
        return step
