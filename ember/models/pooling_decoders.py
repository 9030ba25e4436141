"""Decoders used for pooling: the Llama family run causally over whole prompts without a KV
cache (`CausalNoCacheBackend`), and `*ForSequenceClassification` (a `score` head on the pooled
last token, HF's reward / classifier / reranker layout).

The decoder classes of ember.models are reused unchanged; only the attention backend differs, so
pooling never touches the generate path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata
from ember.layers.attention import ForwardContext
from ember.models.llama import LlamaForCausalLM
from ember.models.qwen2 import Qwen2ForCausalLM
from ember.models.qwen3 import Qwen3ForCausalLM
from ember.pooling.batch import PoolingBatch


class _CausalNoCacheImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        batch: PoolingBatch = metadata.backend_data  # type: ignore[assignment]
        b, n = batch.num_seqs, batch.max_len
        group = self.num_heads // self.num_kv_heads
        q = batch.pad(query).transpose(1, 2)  # [B, heads, n, d]
        k = batch.pad(key).transpose(1, 2).repeat_interleave(group, dim=1)
        v = batch.pad(value).transpose(1, 2).repeat_interleave(group, dim=1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if self.sliding_window is not None:
            causal &= torch.ones_like(causal).triu(-(self.sliding_window - 1))
        mask = causal if batch.key_mask is None else causal & batch.key_mask
        # Right padding: real queries never see padded keys, which lie in their future.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return batch.unpad(o.transpose(1, 2).reshape(b, n, -1))


class CausalNoCacheBackend(AttentionBackend):
    name = "causal_no_cache"

    @classmethod
    def impl_cls(cls):
        return _CausalNoCacheImpl


def _metadata(batch: PoolingBatch) -> AttentionMetadata:
    empty = torch.empty(0, dtype=torch.int64)
    return AttentionMetadata(
        num_actual_tokens=int(batch.input_ids.shape[0]), slot_mapping=empty,
        query_start_loc=empty, seq_lens=empty, block_table=empty, max_query_len=batch.max_len,
        max_seq_len=batch.max_len, query_start_loc_cpu=[], seq_lens_cpu=batch.lengths,
        backend_data=batch)


class _PoolingDecoderMixin:
    """forward(batch) -> [T, H] last hidden states, the causal LM's decoder stack."""

    default_pooling = "last"

    def pool_forward(self, batch: PoolingBatch) -> torch.Tensor:
        ctx = ForwardContext(_metadata(batch), [None] * self.num_layers)  # type: ignore[list-item]
        return self.model(batch.input_ids, batch.positions, ctx)  # type: ignore[attr-defined]

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)  # type: ignore[attr-defined]


def _build(cls, config: Any, dtype: torch.dtype):
    return cls(config, CausalNoCacheBackend, dtype)


def embedding_class(base: type) -> type:
    """`base` (a decoder class) as an embedding model: same weights, no lm_head use."""
    return type(f"{base.__name__}ForEmbedding", (_PoolingDecoderMixin, base), {})


def _seq_cls_class(base: type) -> type:
    class ForSequenceClassification(_PoolingDecoderMixin, base):
        def __init__(self, config: Any, attn_backend=CausalNoCacheBackend,
                     dtype: torch.dtype = torch.float32) -> None:
            super().__init__(config, attn_backend, dtype)
            if hasattr(self, "lm_head"):
                del self.lm_head
            self.tie_word_embeddings = True  # no lm_head to load
            self.num_labels = int(config.num_labels)
            self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False, dtype=dtype)

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            return self.score(pooled)

    ForSequenceClassification.__name__ = base.__name__.replace("ForCausalLM",
                                                               "ForSequenceClassification")
    ForSequenceClassification.__qualname__ = ForSequenceClassification.__name__
    return ForSequenceClassification


LlamaForSequenceClassification = _seq_cls_class(LlamaForCausalLM)
Qwen2ForSequenceClassification = _seq_cls_class(Qwen2ForCausalLM)
Qwen3ForSequenceClassification = _seq_cls_class(Qwen3ForCausalLM)
