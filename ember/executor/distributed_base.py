"""What the multi-rank executors ("mp", "ray") share: the engine core's executor interface on top
of a transport that sends each step to every rank and gets the driver rank's result back.

A subclass starts its workers (`_start_workers`, which ends with `_set_infos`), sends a step
(`_send_step`), waits for one (`_wait_step`), runs an RPC on every rank (`_run_rpc`) and stops
the workers (`_stop_workers`). A worker that dies or fails makes `_fail` stop every rank and
raise; the engine core's step raises with it, which fails the requests in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.config import EngineArgs

if TYPE_CHECKING:
    from ember.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("ember")


class WorkerDiedError(RuntimeError):
    """A worker process or actor ended (or failed) while the engine ran; the engine is stopped."""


@dataclasses.dataclass
class _ControlState:
    """What EngineCoreControl reads after wake_up: what is still asleep on the workers."""

    asleep: set[str] = dataclasses.field(default_factory=set)


class PendingStep:
    """A step sent to the workers; `resolve()` waits for the driver's ModelRunnerOutput."""

    __slots__ = ("executor", "seq", "result")

    def __init__(self, executor: DistributedExecutorBase, seq: int) -> None:
        self.executor = executor
        self.seq = seq
        self.result: ModelRunnerOutput | None = None

    def resolve(self) -> ModelRunnerOutput:
        if self.result is None:
            self.result = self.executor._wait_step(self.seq)
        return self.result


class DistributedExecutorBase:
    def __init__(self, args: EngineArgs) -> None:
        from ember.platforms import resolve_platform
        from ember.plugins import load_plugins

        load_plugins()
        self.args = args
        self.tp_size = args.tensor_parallel_size
        self.pp_size = args.pipeline_parallel_size
        self.world_size = self.tp_size * self.pp_size
        self.platform = resolve_platform(args.device)
        self.control = _ControlState()
        self._dead: str | None = None
        self._closed = False
        self._seq = itertools.count()
        self._call_ids = itertools.count()
        self._step_results: dict[int, Any] = {}
        self._rpc_results: dict[int, list] = {}
        try:
            self._start_workers(args, self.world_size)
        except BaseException:
            self.shutdown()
            raise

    def _set_infos(self, infos: list[Any]) -> None:
        from ember.distributed.parallel_state import driver_rank
        from ember.registry import AttentionBackendRegistry

        driver = infos[driver_rank(self.tp_size, self.pp_size)]
        self.model_config = driver.model_config
        self.attn_backend = AttentionBackendRegistry.resolve(driver.attn_backend)
        self.num_blocks = min(info.num_blocks for info in infos)  # agreed already; min is safe
        self.max_num_batched_tokens = driver.max_num_batched_tokens
        self.peak_activation_bytes = max(info.peak_activation_bytes for info in infos)
        self.graph_capture_seconds = max(info.graph_capture_seconds for info in infos)
        self.startup_breakdown: dict[str, float] = dict(driver.startup_breakdown)
        self.worker_pids = [info.pid for info in infos]
        logger.info("%s executor: %d ranks (tensor parallel %d x pipeline %d) ready",
                    type(self).__name__, self.world_size, self.tp_size, self.pp_size)

    # ---- what the engine core calls ----------------------------------------------------------
    def launch(self, plan: SchedulerOutput) -> PendingStep:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        seq = next(self._seq)
        # The scheduler's own Request objects stay here: the workers need the plan only.
        self._send_step(seq, dataclasses.replace(plan, scheduled_requests=[]))
        return PendingStep(self, seq)

    def sleep(self, level: int = 1) -> None:
        self._run_rpc("sleep", (level,), None)
        self.control.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        asleep = self._run_rpc("wake_up", (tags,), None)
        self.control.asleep = set(asleep[0])

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._run_rpc(method, args, kwargs)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_workers()

    # ---- helpers for subclasses -------------------------------------------------------------
    @staticmethod
    def _unpack_rpc(replies: list[tuple[str, Any]]) -> list[Any]:
        for status, value in replies:
            if status == "error":
                raise value
        return [value for _, value in replies]

    def _fail(self, message: str, value_error: bool = False) -> None:
        """Stop every rank and raise (a start-up ValueError, e.g. an unsupported model, stays a
        ValueError for the caller)."""
        self._dead = message
        logger.error("%s: %s; stopping the engine's workers", type(self).__name__, message)
        self.shutdown()
        if value_error:
            raise ValueError(message.split("ValueError: ", 1)[-1])
        raise WorkerDiedError(message)

    # ---- the transport (subclasses) -----------------------------------------------------------
    def _start_workers(self, args: EngineArgs, world_size: int) -> None:
        raise NotImplementedError

    def _send_step(self, seq: int, plan: SchedulerOutput) -> None:
        raise NotImplementedError

    def _wait_step(self, seq: int) -> ModelRunnerOutput:
        raise NotImplementedError

    def _run_rpc(self, method: str | Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any] | None) -> list[Any]:
        raise NotImplementedError

    def _stop_workers(self) -> None:
        raise NotImplementedError
