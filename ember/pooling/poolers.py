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
    seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=hidden.device),
                                  batch.lengths_t, output_size=hidden.shape[0])
    sums = hidden.new_zeros((batch.num_seqs, hidden.shape[1])).index_add_(0, seq, hidden)
    return sums / batch.lengths_t.to(hidden.dtype)[:, None]
