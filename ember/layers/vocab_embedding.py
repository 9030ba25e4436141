"""Vocabulary-parallel embedding and LM head.

Each tensor-parallel rank holds ceil(vocab / tp_size) rows of the table (the last rank's tail is
zero padding). The embedding looks up the ids that fall in its rows, zeroes the others and sums
over ranks (all-reduce: exactly one rank contributes each row, so the sum is exact); the LM head
computes its slice of the logits and gathers the slices. The weight loader keeps only this
rank's rows of the checkpoint tensor. With one rank both are plain lookups / matmuls on a
[vocab, hidden] ``weight``, named as nn.Embedding's; on the CPU in float32 the lookup is a native
call (ember.kernels.cpu.layer_ops), which a captured CPU decode graph replays.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed import parallel_state as ps
from ember.distributed.communicator import tp_all_gather, tp_all_reduce
from ember.kernels.cpu import layer_ops
from ember.layers.linear import compute_logits, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 dtype: torch.dtype | None = None, prefix: str = "") -> None:  # fmt: skip
        super().__init__()
        self.tp_size, self.tp_rank = ps.get_tp_size(), ps.get_tp_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows = -(-num_embeddings // self.tp_size)
        self.start = min(self.tp_rank * self.rows, num_embeddings)
        self.end = min(self.start + self.rows, num_embeddings)
        self.prefix = prefix
        self.use_cpu_ops = layer_ops.configured()
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self._set_attrs()

    def _set_attrs(self) -> None:
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.load_weight})

    def _apply(self, fn: Any, recurse: bool = True) -> VocabParallelEmbedding:  # type: ignore[override]
        super()._apply(fn, recurse)  # to_empty builds a new Parameter: give it its loader back
        self._set_attrs()
        return self

    def load_weight(self, param: torch.Tensor, loaded: torch.Tensor,
                    shard_id: int | None = None) -> None:  # fmt: skip
        name = getattr(param, "_ember_name", self.prefix or "embedding")
        if shard_id is not None:
            raise ValueError(f"weight {name!r}: shard {shard_id} of an unsharded parameter")
        full = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded.shape) != full:
            raise ValueError(f"weight {name!r} has shape {tuple(loaded.shape)}, the model "
                             f"expects {full}")
        mine = self.end - self.start
        param.data[:mine].copy_(loaded[self.start:self.end])
        param.data[mine:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            weight = self.weight
            if (self.use_cpu_ops and layer_ops.takes(weight) and input_ids.dim() == 1
                    and input_ids.dtype == torch.int64 and input_ids.is_contiguous()
                    and weight.is_contiguous()):
                return layer_ops.embedding(input_ids, weight)
            return F.embedding(input_ids, weight)
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(inside, input_ids - self.start, torch.zeros_like(input_ids))
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return tp_all_reduce(out)

    def extra_repr(self) -> str:
        tp = f", rows {self.start}:{self.end} of tp={self.tp_size}" if self.tp_size > 1 else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{tp}"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded over the vocabulary like the embedding."""


def parallel_logits(head: VocabParallelEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """float32 [tokens, vocab] logits: this rank's slice from the head (or the tied embedding),
    gathered over the tensor-parallel ranks and trimmed of the padding rows."""
    logits = compute_logits(head, hidden)
    if head.tp_size == 1:
        return logits
    return tp_all_gather(logits, dim=-1)[..., : head.num_embeddings]
