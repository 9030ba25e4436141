"""LLMEngine's engine-control and statistics methods (vLLM's names), mixed into LLMEngine.

Each reaches the engine core through `call_core`, so it works with the core in this process and
in its own. Functions for the workers (collective_rpc, apply_model) are passed as they are in
process and pickled across (ember.pickling: cloudpickle when installed, else module-level
functions only, with an error that says so); an exception raised on the worker is raised here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.engine.metrics import Metric
    from ember.sampling_params import SamplingParams


class EngineControlMixin:
    """Needs: args, client, model_config, output_processor, call_core (LLMEngine's)."""

    _sleep_level: int = 0
    stats_tracker = None  # an EngineStatsTracker when disable_log_stats=False
    stat_logger = None  # a LoggingStatLogger when disable_log_stats=False

    # ---- defaults ------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation-config values (generation_config="auto";
        plain SamplingParams() with "vllm" or when the model gives none)."""
        from ember.sampling_params import SamplingParams

        return SamplingParams(**self.model_config.default_sampling)  # type: ignore[attr-defined]

    # ---- control -------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False when blocks are in use (nothing changes)."""
        return bool(self.call_core("reset_prefix_cache"))  # type: ignore[attr-defined]

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: level 1 drops the KV cache and moves weights to host memory,
        level 2 drops the weights too (wake_up reloads them). Needs no running requests."""
        from ember.core.engine_control import check_sleep_mode

        check_sleep_mode(self.args, level)  # type: ignore[attr-defined]
        if self.output_processor.has_unfinished():  # type: ignore[attr-defined]
            raise RuntimeError("cannot sleep while requests run: wait for them or abort them")
        self.call_core("sleep", level)  # type: ignore[attr-defined]
        self._sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reload what sleep dropped (tags: "weights", "kv_cache"; both when None)."""
        self.call_core("wake_up", tags)  # type: ignore[attr-defined]
        if not self.is_sleeping():
            self._sleep_level = 0

    def is_sleeping(self) -> bool:
        return bool(self.call_core("is_sleeping"))  # type: ignore[attr-defined]

    def check_awake(self) -> None:
        if self._sleep_level:
            raise RuntimeError("the engine is sleeping: call wake_up() before adding requests")

    # ---- workers -------------------------------------------------------------------------
    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run `method` on every worker: a callable as `method(worker, *args, **kwargs)`, a
        string as the worker's method of that name. Returns one result per worker."""
        client = self.client  # type: ignore[attr-defined]
        if not client.multiprocess:
            return client.core.collective_rpc(method, tuple(args), kwargs)
        from ember.pickling import dumps, loads

        payload = dumps((method, tuple(args), kwargs), f"collective_rpc({method!r})")
        reply = client.call_utility("collective_rpc_pickled", payload,
                                    timeout=timeout if timeout is not None else 300.0)
        status, value = loads(reply)
        if status == "error":
            raise value
        return value

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """`func(model)` on every worker; one result per worker."""
        return self.collective_rpc("apply_model", args=(func,))

    # ---- statistics ----------------------------------------------------------------------
    def get_metrics(self) -> list[Metric]:
        """Counters, gauges and histograms of the engine (ember.engine.metrics lists them).
        Needs disable_log_stats=False, as vLLM's."""
        tracker = self.stats_tracker
        if tracker is None:
            raise ValueError("get_metrics needs stats: create the engine with "
                             "disable_log_stats=False")
        from ember.core.messages import SchedulerStats

        sched = self.call_core("scheduler_stats")  # type: ignore[attr-defined]
        if isinstance(sched, (list, dict)):  # from another process: plain msgpack data
            import msgspec

            sched = msgspec.convert(sched, SchedulerStats)
        return tracker.metrics(sched)

    def _init_stats(self) -> None:
        """Called by LLMEngine.__init__: stats are tracked only with disable_log_stats=False."""
        if self.args.disable_log_stats:  # type: ignore[attr-defined]
            return
        from ember.engine.metrics import EngineStatsTracker
        from ember.engine.stat_logging import LoggingStatLogger

        self.stats_tracker = EngineStatsTracker(self.model_config.path)  # type: ignore[attr-defined]
        self.stat_logger = LoggingStatLogger()

    def _log_stats(self) -> None:
        """After each step: count its tokens, and log a line when the interval has passed."""
        tracker, stat_logger = self.stats_tracker, self.stat_logger
        if tracker is None or stat_logger is None:
            return
        stat_logger.record(*tracker.take_new_tokens())
        now = time.monotonic()
        if now - stat_logger.last_log < stat_logger.interval:
            return
        client = self.client  # type: ignore[attr-defined]
        # In process the core's numbers are free to read; across, the latest it sent.
        sched = client.core.scheduler_stats() if not client.multiprocess else tracker.scheduler_stats
        stat_logger.log(sched, now)


class AsyncEngineControlMixin:
    """AsyncLLM's share of engine control (vLLM's AsyncLLM has these): coroutines over
    `call_core`. While the core sleeps, requests sent to it wait for wake_up."""

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_core("reset_prefix_cache"))  # type: ignore[attr-defined]

    async def sleep(self, level: int = 1) -> None:
        from ember.core.engine_control import check_sleep_mode

        check_sleep_mode(self.args, level)  # type: ignore[attr-defined]
        if self.output_processor.parents:  # type: ignore[attr-defined]
            raise RuntimeError("cannot sleep while requests run: wait for them or abort them")
        await self.call_core("sleep", level)  # type: ignore[attr-defined]

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call_core("wake_up", tags)  # type: ignore[attr-defined]

    async def is_sleeping(self) -> bool:
        return bool(await self.call_core("is_sleeping"))  # type: ignore[attr-defined]

    async def collective_rpc(self, method: str | Callable[..., Any],
                             timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """LLMEngine.collective_rpc from asyncio code (the function always crosses pickled)."""
        import asyncio

        from ember.pickling import dumps, loads

        payload = dumps((method, tuple(args), kwargs), f"collective_rpc({method!r})")
        reply = await asyncio.wait_for(
            self.call_core("collective_rpc_pickled", payload), timeout)  # type: ignore[attr-defined]
        status, value = loads(reply)
        if status == "error":
            raise value
        return value
