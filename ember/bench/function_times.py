"""Per-call host time of named functions, kept apart by a label the caller sets (a benchmark's
constrained and unconstrained rounds, say): wrappers installed for a `with` block, so a
benchmark can say which functions a step's extra host time is in without a sampling profiler.
A wrapper costs about a microsecond a call; calls while no label is set are not counted.
"""

from __future__ import annotations

import collections
import functools
import importlib
import time
from typing import Any

# The engine thread's per-step functions of the structured-output path, and their peers.
ENGINE_STEP_FUNCTIONS = [
    "ember.core.engine_core:EngineCore.step", "ember.core.engine_core:EngineCore._fold_in",
    "ember.core.engine_core:EngineCore._launch_deferred_sampling",
    "ember.core.engine_core:EngineCore.add_request",
    "ember.core.scheduler:Scheduler.schedule", "ember.core.scheduler:Scheduler.update_from_output",
    "ember.structured_output.bitmask_fill:BitmaskFilling.sampling_rows",
    "ember.structured_output.bitmask_fill:BitmaskFilling.fill_async",
    "ember.structured_output.bitmask_fill:PendingProcessFill.result",
    "ember.structured_output.grammar_process:GrammarProcess.fill",
    "ember.structured_output.grammar_process:GrammarProcess.reply",
    "ember.structured_output.grammar_process:GrammarProcess._send",
    "ember.structured_output.manager:StructuredOutputManager.accept_many",
    "ember.structured_output.manager:StructuredOutputManager.add",
    "ember.worker.model_runner:ModelRunner.launch",
    "ember.worker.model_runner:ModelRunner.finish_sampling",
    "ember.worker.model_runner:ModelRunner._sample",
    "ember.worker.model_runner:ModelRunner._sampling_logits",
    "ember.worker.model_runner:ModelRunner._fill_placeholders",
    "ember.worker.model_runner:ModelRunner._update_states",
    "ember.worker.step_sampling:greedy_argmax",
    "ember.worker.grammar_mask:GrammarMasks.masked_argmax",
    "ember.kernels.argmax:argmax_rows",
    "ember.worker.in_flight:InFlightStep.reserve",
    "ember.worker.in_flight:InFlightStep.attach_samples",
    "ember.worker.in_flight:InFlightStep.resolve",
    "ember.worker.graph_runner:GraphRunner.stage_inputs",
    "ember.worker.graph_runner:GraphRunner.replay",
]


class FunctionTimes:
    """``with FunctionTimes(targets) as times: times.label = "x"; ...``; then
    ``times.summary()``: {label: {target: {"calls", "us_per_call", "total_ms"}}}. A target is
    "module:function" or "module:Class.method" (the module attribute is what is wrapped, so a
    function another module imported by name is named there)."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = targets
        self.label: str | None = None
        self._seconds: dict[str, dict[str, float]] = collections.defaultdict(
            lambda: collections.defaultdict(float))
        self._calls: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> FunctionTimes:
        for target in self.targets:
            module_name, _, path = target.partition(":")
            owner: Any = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            setattr(owner, name, self._wrap(original, target))
            self._undo.append((owner, name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def _wrap(self, function: Any, target: str) -> Any:
        seconds, calls = self._seconds, self._calls

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                label = self.label
                if label is not None:
                    seconds[label][target] += time.perf_counter() - start
                    calls[label][target] += 1

        return timed

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        return {label: {target: {"calls": self._calls[label][target],
                                 "us_per_call": round(1e6 * s / self._calls[label][target], 1),
                                 "total_ms": round(1e3 * s, 1)}
                        for target, s in sorted(by.items(), key=lambda kv: -kv[1])}
                for label, by in self._seconds.items()}
