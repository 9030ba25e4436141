"""RankWorker: one rank of a multi-process engine (tensor / pipeline parallel), whatever starts it.

The `mp` executor runs one in each spawned process and the `ray` executor one in each actor; both
hand it the same things: the engine's args, this rank's place, and the address every rank joins
torch.distributed at. It binds the device, joins the groups (the platform names the backend and
the communicator), builds the worker as the in-process executor does (ember.worker.builder), and
then runs each step the engine core broadcasts. Only the driver rank (tensor-parallel rank 0 of
the last pipeline stage) returns the step's ModelRunnerOutput; the others return None.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.config import EngineArgs

if TYPE_CHECKING:
    from ember.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from ember.worker.in_flight import InFlightStep

logger = logging.getLogger("ember")


@dataclasses.dataclass
class RankInfo:
    """What the executor learns from a rank once it is built (the driver's is authoritative)."""

    rank: int
    pid: int
    model_config: Any
    attn_backend: str
    num_blocks: int
    max_num_batched_tokens: int
    peak_activation_bytes: int
    graph_capture_seconds: float
    startup_breakdown: dict[str, float]


class RankWorker:
    def __init__(self, args: EngineArgs, rank: int, local_rank: int, init_method: str) -> None:
        import os

        from ember.distributed.parallel_state import init_parallel_state, is_driver
        from ember.platforms import resolve_platform
        from ember.plugins import load_plugins
        from ember.worker.builder import build_worker
        from ember.worker.control import WorkerControl
        from ember.worker.startup_profile import format_breakdown

        load_plugins()  # a no-op after registry.restore (the executor's snapshot)
        self.rank = rank
        platform = resolve_platform(args.device)
        # build_worker resolves the platform again and gets this (now bound) instance.
        platform.set_device_for_rank(local_rank)
        if platform.device_is_host():
            # Ranks on one host share its cores: each takes its part (torch would take all,
            # and the ranks would then slow each other down, waiting in every collective).
            import torch

            world = args.tensor_parallel_size * args.pipeline_parallel_size
            torch.set_num_threads(max(1, min(torch.get_num_threads(),
                                             (os.cpu_count() or 1) // world)))
        init_parallel_state(args.tensor_parallel_size, args.pipeline_parallel_size, rank,
                            init_method, platform.distributed_backend(),
                            platform.communicator_cls(), platform.device())
        built = build_worker(args)
        self.is_driver = is_driver()
        from ember.distributed.parallel_state import is_last_stage

        # Pipeline parallel batch queue: up to this many batches in flight. A rank of an earlier
        # stage keeps its launched steps here (with their request ids) and resolves one only
        # when a later batch needs its tokens, so it runs batch k+1 while the last stage runs k.
        self.max_concurrent_batches = args.concurrent_batches()
        self.is_last_stage = is_last_stage()
        self.queued: collections.deque[tuple[InFlightStep, set[str]]] = collections.deque()
        if self.max_concurrent_batches > 1:
            built.runner.overlap_stages = True
        self.async_scheduling = (platform.async_scheduling_default
                                 if args.async_scheduling is None else args.async_scheduling)
        self.runner = built.runner
        self.control = WorkerControl(self.runner, args, built.num_blocks)
        self.info = RankInfo(rank, os.getpid(), built.model_config, built.attn_backend.name,
                             built.num_blocks, built.max_num_batched_tokens,
                             built.peak_activation_bytes, built.graph_capture_seconds,
                             built.startup_breakdown)
        logger.debug("rank %d ready in %s", rank, format_breakdown(built.startup_breakdown))

    def launch(self, plan: SchedulerOutput) -> InFlightStep:
        return self.runner.launch(plan)

    def finish(self, step: InFlightStep) -> ModelRunnerOutput | None:
        """Wait for a launched step; its output on the driver, None elsewhere."""
        result = step.resolve()
        return result if self.is_driver else None

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.finish(self.launch(plan))

    def launch_queued(self, plan: SchedulerOutput) -> InFlightStep | None:
        """Batch queue: launch a step; the last stage's step is returned (finish it at once),
        an earlier stage's is queued (None). Queued steps that share a request with this plan
        are resolved first, with every step before them: this request's tokens are inputs now,
        and the engine core schedules a request only after its previous batch returned, so
        those steps are done on the last stage already."""
        queued = self.queued
        req_ids = plan.num_scheduled_tokens.keys()
        needed = len(queued) - self.max_concurrent_batches + 1  # keep the queue bounded
        for i, (_, ids) in enumerate(queued):
            if not ids.isdisjoint(req_ids):
                needed = i + 1
        for _ in range(needed):
            queued.popleft()[0].resolve()
        step = self.launch(plan)
        if self.is_last_stage:
            return step
        queued.append((step, set(req_ids)))
        return None

    def drain(self) -> None:
        """Resolve every queued step (before an RPC, or closing)."""
        while self.queued:
            self.queued.popleft()[0].resolve()

    def rpc(self, method: str | Callable[..., Any], args: tuple = (),
            kwargs: dict[str, Any] | None = None) -> Any:
        """Engine control on this rank: sleep, wake_up (returning what is still asleep), or a
        collective_rpc call (its one result)."""
        if method == "sleep":
            return self.control.sleep(*args)
        if method == "wake_up":
            self.control.wake_up(*args)
            return sorted(self.control.asleep)
        return self.control.collective_rpc(method, args, kwargs)[0]

    def close(self) -> None:
        from ember.distributed.parallel_state import destroy_parallel_state

        destroy_parallel_state()
