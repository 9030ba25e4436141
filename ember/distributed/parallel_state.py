"""This process's place in the tensor- and pipeline-parallel layout, and its process groups.

Rank layout (vLLM's): global rank = pp_rank * tp_size + tp_rank, so the ranks of one pipeline
stage form a tensor-parallel group. Without `init_parallel_state` every getter answers as one
process (size 1, rank 0, first and last stage), so layers and the model runner ask the same
questions with one process or many.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.distributed.communicator import Communicator


@dataclass
class ParallelState:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    tp_group: Any = None  # torch.distributed process group of this stage's ranks
    world_group: Any = None  # every rank (the sampled-token broadcast)
    comm: Communicator | None = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size


_STATE = ParallelState()


def state() -> ParallelState:
    return _STATE


def get_tp_size() -> int:
    return _STATE.tp_size


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_pp_size() -> int:
    return _STATE.pp_size


def get_pp_rank() -> int:
    return _STATE.pp_rank


def get_world_size() -> int:
    return _STATE.world_size


def get_rank() -> int:
    return _STATE.rank


def is_first_stage() -> bool:
    return _STATE.pp_rank == 0


def is_last_stage() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def driver_rank(tp_size: int, pp_size: int) -> int:
    """The rank that returns the samples: tensor-parallel rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


def is_driver() -> bool:
    return _STATE.rank == driver_rank(_STATE.tp_size, _STATE.pp_size)


def get_comm() -> Communicator:
    if _STATE.comm is None:
        raise RuntimeError("the parallel state is not initialized (tensor_parallel_size 1?)")
    return _STATE.comm


def stage_layers(num_layers: int, pp_rank: int | None = None,
                 pp_size: int | None = None) -> tuple[int, int]:
    """[start, end) of the decoder layers a stage holds: an even split, the first stages taking
    one more when it does not divide (vLLM's default partition)."""
    pp_rank = _STATE.pp_rank if pp_rank is None else pp_rank
    pp_size = _STATE.pp_size if pp_size is None else pp_size
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} "
                         "layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def init_parallel_state(tp_size: int, pp_size: int, rank: int, init_method: str,
                        backend: str, communicator_cls: type[Communicator],
                        device: Any = None) -> ParallelState:
    """Join the process group (every rank calls this with the same sizes and init_method) and
    build the groups. `backend` and `communicator_cls` come from the platform."""
    import torch.distributed as dist

    global _STATE
    world = tp_size * pp_size
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank)
    tp_group = None
    # new_group must be called by every rank for every group, in the same order.
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            tp_group = group
    world_group = dist.new_group(list(range(world)))
    _STATE = ParallelState(tp_size, pp_size, rank, tp_group, world_group)
    _STATE.comm = communicator_cls(_STATE, device)
    return _STATE


def destroy_parallel_state() -> None:
    global _STATE
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        _STATE = ParallelState()


def agree_min(value: int) -> int:
    """The smallest `value` over every rank (KV blocks: each rank must hold the same count)."""
    if _STATE.world_size == 1:
        return value
    return _STATE.comm.min_over_world(value)  # type: ignore[union-attr]
