"""UniProcExecutor: runs the engine's steps on one worker in this process.

Construction is ember.worker.builder's (platform, model, weights, KV cache, graphs, warm-up); the
executor keeps what the engine core reads (and where its start-up time went) and launches steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.config import EngineArgs

if TYPE_CHECKING:
    from ember.core.scheduler_output import GrammarBitmask, SchedulerOutput
    from ember.worker.in_flight import InFlightStep

logger = logging.getLogger("ember")


class UniProcExecutor:
    def __init__(self, args: EngineArgs) -> None:
        from ember.worker.builder import build_worker
        from ember.worker.startup_profile import format_breakdown

        built = build_worker(args)
        self.platform = built.platform
        self.model_config = built.model_config
        self.attn_backend = built.attn_backend
        self.runner = built.runner
        self.num_blocks = built.num_blocks
        self.max_num_batched_tokens = built.max_num_batched_tokens
        self.peak_activation_bytes = built.peak_activation_bytes
        self.graph_capture_seconds = built.graph_capture_seconds
        # Seconds per start-up stage and "total" (ember.worker.startup_profile's keys).
        self.startup_breakdown: dict[str, float] = built.startup_breakdown
        logger.info("executor ready in %s", format_breakdown(self.startup_breakdown))
        from ember.worker.control import WorkerControl

        self.control = WorkerControl(self.runner, args, self.num_blocks)

    def launch(self, scheduler_output: SchedulerOutput,
               before_device: Callable[[], None] | None = None) -> InFlightStep:
        """Start a step without waiting; `.resolve()` on the result gives its ModelRunnerOutput.
        ``before_device``: called between the step's host work and its device work (the step
        in flight's deferred sampling, see ModelRunner.launch)."""
        return self.runner.launch(scheduler_output, before_device)

    # The engine core may launch a step with `grammar_deferred` and give its bitmask later.
    defers_grammar_sampling = True

    def finish_sampling(self, step: InFlightStep, grammar: GrammarBitmask | None) -> None:
        """Sample a step launched with `grammar_deferred` (before the next launch)."""
        self.runner.finish_sampling(step, grammar)

    # ---- engine control (ember.worker.control) -----------------------------------------
    def sleep(self, level: int = 1) -> None:
        self.control.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.control.wake_up(tags)

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self.control.collective_rpc(method, args, kwargs)
