"""RayExecutor ("ray"): one Ray actor per rank, in a placement group.

`ray.init()` joins the cluster named by RAY_ADDRESS (a cluster started with `ray start`), or
starts a local instance when none is named and none is running in this process. Each actor
holds a RankWorker (ember.worker.rank_worker); ranks join torch.distributed over TCP at the
address of rank 0's node. A bundle asks for one GPU on a GPU platform, one CPU otherwise.
Registrations and the plugin table reach each actor through `ember.registry.snapshot()`.

Faults: a step waits on every rank's reply; an actor that dies makes its reply an error at
once (Ray's RayActorError), and the executor then kills every actor and raises WorkerDiedError.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ember.config import EngineArgs
from ember.executor.distributed_base import DistributedExecutorBase

if TYPE_CHECKING:
    from ember.core.scheduler_output import SchedulerOutput

logger = logging.getLogger("ember")

POLL_SECONDS = 0.2


class RankActor:
    """The body of each Ray actor (made remote in RayExecutor, so importing this module does
    not import ray)."""

    def __init__(self, registry_snapshot: dict) -> None:
        from ember.registry import restore

        restore(registry_snapshot)
        self.worker = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port (rank 0's: where every rank meets)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def build(self, args: EngineArgs, rank: int, init_method: str) -> Any:
        from ember.worker.rank_worker import RankWorker

        # Ray gives each GPU actor one visible device: index 0 in this process.
        self.worker = RankWorker(args, rank, 0, init_method)
        return self.worker.info

    def execute(self, plan: SchedulerOutput) -> Any:
        worker = self.worker
        if worker.max_concurrent_batches > 1:  # batch queue: an earlier stage returns at once
            step = worker.launch_queued(plan)
            return None if step is None else worker.finish(step)
        return worker.execute(plan)

    def rpc(self, method: Any, args: tuple, kwargs: dict | None) -> Any:
        from ember.pickling import dumps, loads

        self.worker.drain()

        method, args, kwargs = loads(method), args, kwargs
        try:
            return dumps(("ok", self.worker.rpc(method, args, kwargs)), "the rpc result")
        except Exception as exc:
            return dumps(("error", exc), "an rpc error")

    def pid(self) -> int:
        import os

        return os.getpid()


class RayExecutor(DistributedExecutorBase):
    def _start_workers(self, args: EngineArgs, world_size: int) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as exc:
            raise ValueError("distributed_executor_backend='ray' needs ray: pip install ray") from exc
        from ember.pickling import portable_args
        from ember.registry import snapshot

        args = portable_args(args)
        if not ray.is_initialized():
            ray.init()  # RAY_ADDRESS, when set, names the cluster
        self._ray = ray
        gpu = not self.platform.device_is_host()
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
        ray.get(self._pg.ready())
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RankActor)
        snap = snapshot()
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote(snap)
            for rank in range(world_size)
        ]
        ip, port = ray.get(self.actors[0].address.remote())
        init_method = f"tcp://{ip}:{port}"
        refs = [actor.build.remote(args, rank, init_method)
                for rank, actor in enumerate(self.actors)]
        infos = self._gather(refs, startup=True)
        self._pending: dict[int, list] = {}
        self._set_infos(infos)

    def _gather(self, refs: list, startup: bool = False) -> list[Any]:
        """Every rank's reply; the first failure (a dead actor, an exception) stops them all."""
        ray = self._ray
        remaining = list(refs)
        while remaining:
            done, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=POLL_SECONDS)
            failed = [(ref, exc) for ref in done if (exc := self._error(ref)) is not None]
            if not failed:
                continue
            # A rank whose peer died fails in its collective: wait a moment for the dead one,
            # so the error names it.
            late, _ = ray.wait(remaining, num_returns=len(remaining), timeout=1.0)
            failed += [(ref, exc) for ref in late if (exc := self._error(ref)) is not None]
            died = [(r, e) for r, e in failed if isinstance(e, ray.exceptions.RayActorError)]
            ref, exc = (died or failed)[0]
            rank = refs.index(ref)
            if died:
                self._fail(f"rank {rank} died (its Ray actor ended: {type(exc).__name__})")
            cause = getattr(exc, "cause", None) or exc
            self._fail(f"rank {rank} failed: {type(cause).__name__}: {cause}",
                       value_error=startup and isinstance(cause, ValueError))
        return ray.get(refs)

    def _error(self, ref) -> Exception | None:
        try:
            self._ray.get(ref)
        except Exception as exc:
            return exc
        return None

    def _send_step(self, seq: int, plan: SchedulerOutput) -> None:
        ref = self._ray.put(plan)
        self._pending[seq] = [actor.execute.remote(ref) for actor in self.actors]

    def _wait_step(self, seq: int) -> Any:
        from ember.distributed.parallel_state import driver_rank

        results = self._gather(self._pending.pop(seq))
        return results[driver_rank(self.tp_size, self.pp_size)]

    def _run_rpc(self, method: str | Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any] | None) -> list[Any]:
        from ember.pickling import dumps, loads

        payload = dumps(method, "the collective_rpc method")
        refs = [actor.rpc.remote(payload, args, kwargs) for actor in self.actors]
        return self._unpack_rpc([loads(r) for r in self._gather(refs)])

    def _stop_workers(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None:
            return
        for actor in getattr(self, "actors", []):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        if getattr(self, "_pg", None) is not None:
            try:
                ray.util.remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None
