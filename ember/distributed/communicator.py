"""Communicator: the collectives tensor and pipeline parallelism need, over torch.distributed.

A platform names its torch.distributed backend (`Platform.distributed_backend()`: gloo on the
CPU, nccl on CUDA) and its communicator class (`Platform.communicator_cls()`), so an out-of-tree
platform can bring either. Layers call the module-level helpers (`tp_all_reduce`,
`tp_all_gather`), which are the identity with one tensor-parallel rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ember.distributed import parallel_state as ps

if TYPE_CHECKING:
    from ember.distributed.parallel_state import ParallelState


class Communicator:
    """torch.distributed collectives on the groups of a ParallelState."""

    def __init__(self, state: ParallelState, device: Any = None) -> None:
        self.state = state
        self.device = device
        # Optional timer (benchmarks, eager steps only): called with the seconds each all-reduce
        # took, between two calls of `timer_sync` (the platform's synchronize on a device).
        self.on_all_reduce = None
        self.timer_sync = None

    # ---- tensor parallelism ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's tensor-parallel ranks, in place."""
        if self.on_all_reduce is None:
            dist.all_reduce(x, group=self.state.tp_group)
            return x
        import time

        sync = self.timer_sync or (lambda: None)
        sync()
        start = time.perf_counter()
        dist.all_reduce(x, group=self.state.tp_group)
        sync()
        self.on_all_reduce(time.perf_counter() - start)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the ranks' `x` along `dim`, in rank order."""
        size = self.state.tp_size
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=self.state.tp_group)
        return torch.cat(parts, dim=dim)

    # ---- pipeline parallelism --------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int) -> None:
        for t in tensors:
            dist.send(t.contiguous(), dst)

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, src: int) -> list[torch.Tensor]:
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src)
            out.append(t)
        return out

    def broadcast_from_driver(self, x: torch.Tensor, async_op: bool = False) -> Any:
        """In place: every rank gets the driver's `x` (the sampled tokens). With `async_op` it
        returns at once with a work handle; `x` is valid after its `wait()` (an earlier pipeline
        stage starts its next batch meanwhile)."""
        src = ps.driver_rank(self.state.tp_size, self.state.pp_size)
        return dist.broadcast(x, src, group=self.state.world_group, async_op=async_op)

    def min_over_world(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.state.world_group)
        return int(t.item())


def _refuse_native_capture() -> None:
    """A collective cannot be recorded as a CPU graph's native call (ember.kernels.cpu.native):
    a capture that reaches one is refused, and the steps run eagerly."""
    from ember.kernels.cpu import native

    if native.capturing():
        raise native.CaptureRefused("a tensor-parallel collective is not a native call")


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if ps.get_tp_size() == 1:
        return x
    _refuse_native_capture()
    return ps.get_comm().all_reduce(x)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if ps.get_tp_size() == 1:
        return x
    _refuse_native_capture()
    return ps.get_comm().all_gather(x, dim)
