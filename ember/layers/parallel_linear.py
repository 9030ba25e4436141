"""Tensor-parallel linear layers (Megatron's split, vLLM's names) on ember's Linear contract.

Each is a ``Linear`` built with this rank's sizes and ``tp_rank`` / ``tp_size`` / ``tp_split``,
so every LinearMethod's weight loader takes only this rank's slice of each checkpoint tensor
(ember.layers.linear.tp_slice): no rank ever holds a whole projection.

- ColumnParallelLinear: output features split; the output stays split (the next layer is
  row-parallel). MergedColumnParallelLinear: a fused gate_up, each shard split on its own.
- QKVParallelLinear: query heads split; key/value heads split too, or, when there are more ranks
  than key/value heads, each rank holds the one head its query heads attend to (replicated
  over tp_size / num_kv_heads ranks).
- RowParallelLinear: input features split; partial outputs summed by an all-reduce (the bias
  added once, by rank 0, before it).

With one rank each behaves exactly as ``Linear``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ember.distributed import parallel_state as ps
from ember.distributed.communicator import tp_all_reduce
from ember.layers.linear import Linear, set_weight_attrs


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) does not split evenly over tensor_parallel_size="
                         f"{parts}")
    return total // parts


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 output_sizes: Sequence[int] | None = None, dtype: torch.dtype | None = None,
                 prefix: str = "", **kwargs: Any) -> None:  # fmt: skip
        tp_size = ps.get_tp_size()
        full = [out_features] if output_sizes is None else [int(s) for s in output_sizes]
        local = [divide(s, tp_size, f"{prefix or 'a layer'}'s output features") for s in full]
        super().__init__(in_features, sum(local), bias, dtype=dtype,
                         output_sizes=None if output_sizes is None else local, prefix=prefix,
                         tp_rank=ps.get_tp_rank(), tp_size=tp_size, tp_split="output", **kwargs)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused (gate and up): each rank holds its slice of each."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = True,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(in_features, sum(output_sizes), bias, output_sizes=output_sizes, **kwargs)


class QKVParallelLinear(Linear):
    """Fused q/k/v over heads; shards 0, 1, 2 are q, k, v (the model's load loop numbers them)."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = True, *, dtype: torch.dtype | None = None, prefix: str = "",
                 **kwargs: Any) -> None:  # fmt: skip
        tp_size, tp_rank = ps.get_tp_size(), ps.get_tp_rank()
        self_heads = divide(num_heads, tp_size, f"{prefix or 'attention'}: num_attention_heads")
        if num_kv_heads >= tp_size:
            kv_heads, replicas = divide(num_kv_heads, tp_size,
                                        f"{prefix or 'attention'}: num_key_value_heads"), 1
        else:
            kv_heads = 1
            replicas = divide(tp_size, num_kv_heads,
                              f"{prefix or 'attention'}: ranks per key/value head")
        sizes = [self_heads * head_size, kv_heads * head_size, kv_heads * head_size]
        super().__init__(hidden_size, sum(sizes), bias, dtype=dtype, output_sizes=sizes,
                         prefix=prefix, tp_rank=tp_rank, tp_size=tp_size, tp_split="output",
                         **kwargs)
        self.num_heads, self.num_kv_heads = self_heads, kv_heads  # this rank's
        self.total_num_kv_heads = num_kv_heads
        self.kv_replicas = replicas
        if replicas > 1:
            for name, attrs in self._weight_attrs.items():
                if attrs.get("output_dim") is not None:
                    attrs["weight_loader"] = self._replicated_kv_loader(attrs["weight_loader"])
                    set_weight_attrs(self._parameters[name], {"weight_loader":
                                                              attrs["weight_loader"]})

    def _replicated_kv_loader(self, inner):
        """k and v: this rank's one head (rank r serves query heads of kv head r // replicas),
        loaded whole; q: the method's own loader (split evenly)."""

        def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            if shard_id not in (1, 2):
                return inner(param, loaded, shard_id)
            dim = param.output_dim
            per_head = loaded.shape[dim] // self.total_num_kv_heads
            head = self.tp_rank // self.kv_replicas
            with self._unsplit():
                inner(param, loaded.narrow(dim, head * per_head, per_head), shard_id)

        return load

    @contextlib.contextmanager
    def _unsplit(self) -> Iterator[None]:
        split, self.tp_split = self.tp_split, None
        try:
            yield
        finally:
            self.tp_split = split


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype | None = None, prefix: str = "",
                 **kwargs: Any) -> None:  # fmt: skip
        tp_size = ps.get_tp_size()
        local_in = divide(in_features, tp_size, f"{prefix or 'a layer'}'s input features")
        super().__init__(local_in, out_features, bias, dtype=dtype, prefix=prefix,
                         tp_rank=ps.get_tp_rank(), tp_size=tp_size, tp_split="input", **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        return tp_all_reduce(y)
