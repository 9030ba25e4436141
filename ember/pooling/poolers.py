"""Poolers: one vector per prompt from the packed last hidden states [T, H].

Each is a plain function `(hidden, batch) -> [B, H]`, registered by name in
ember.registry.PoolerRegistry ("cls", "mean", "last" built in; plugins add more with the
`ember_register_poolers` hook), so a checkpoint's pooling mode resolves like any other plugin.
"""

from __future__ import annotations

import torch

from ember.pooling.batch import PoolingBatch


def cls_pool(hidden: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
    """The first token's state ([CLS] for BERT)."""
    return hidden.index_select(0, batch.starts)


def last_pool(hidden: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
    """The last token's state (decoders: the only one that has seen the whole prompt)."""
    return hidden.index_select(0, batch.starts + batch.lengths_t - 1)


def mean_pool(hidden: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
    """The mean over each prompt's tokens (sentence-transformers' pooling_mode_mean_tokens)."""
    # One matmul with a [B, T] averaging matrix: faster than a scatter-add on the CPU.
    tokens = torch.arange(hidden.shape[0], device=hidden.device)
    start = batch.starts[:, None]
    inside = (tokens[None, :] >= start) & (tokens[None, :] < start + batch.lengths_t[:, None])
    weights = inside.to(hidden.dtype) / batch.lengths_t.to(hidden.dtype)[:, None]
    return weights @ hidden
