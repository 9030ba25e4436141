"""PoolingRunner: builds a pooling model and turns a batch of prompts into one vector each.

A model for pooling has `pool_forward(PoolingBatch) -> [T, H]` (ember.models.bert, and the
decoders of ember.models.pooling_decoders), `default_pooling`, and, for classifiers,
`classify(pooled) -> logits` and `num_labels`. Prompts of a step are sorted by length and run in
chunks, so the padded attention core wastes little on short prompts next to long ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.pooling.batch import PoolingBatch
from ember.pooling.config import PoolerConfig
from ember.pooling.params import PoolingParams

CHUNK_TOKENS = 4096  # padded tokens per forward (B * max_len)
CHUNK_SEQS = 128


def pooling_model_class(arch: str) -> type:
    from ember.models.llama import LlamaForCausalLM
    from ember.models.pooling_decoders import embedding_class
    from ember.registry import ModelRegistry

    cls = ModelRegistry.resolve(arch)
    if hasattr(cls, "pool_forward"):
        return cls
    if isinstance(cls, type) and issubclass(cls, LlamaForCausalLM):
        return embedding_class(cls)
    raise ValueError(f"{arch} cannot run as a pooling model: its class has no pool_forward")


def _decoder_base() -> type:
    from ember.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


class PoolingRunner:
    def __init__(self, model_config, device: torch.device, progress: bool | None = None) -> None:
        from ember.models.loader.formats import load_weights
        from ember.models.pooling_decoders import CausalNoCacheBackend

        self.device = device
        self.dtype = getattr(torch, model_config.dtype)
        cls = pooling_model_class(model_config.architecture)
        if model_config.is_gguf and not issubclass(cls, _decoder_base()):
            raise ValueError(f"{model_config.architecture} from a GGUF file cannot run as a "
                             "pooling model: GGUF pooling covers the decoders (last-token "
                             "embeddings)")
        # The format's loader: safetensors (local or hub), GGUF (dequantized) or dummy.
        self.model = load_weights(model_config, cls, CausalNoCacheBackend, self.dtype, device,
                                  progress)
        hf = model_config.hf_config
        self.pooler_config = PoolerConfig.from_checkpoint(model_config.path, hf,
                                                          self.model.default_pooling)
        from ember.registry import PoolerRegistry

        self.pooler = PoolerRegistry.resolve(self.pooler_config.pooling_type)
        self.num_labels = getattr(self.model, "num_labels", None)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], params: list[PoolingParams]) -> list[torch.Tensor]:
        """One float32 CPU tensor per prompt, in order."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[torch.Tensor | None] = [None] * len(prompts)
        start = 0
        while start < len(order):
            end = start + 1
            while (end < len(order) and end - start < CHUNK_SEQS
                   and (end - start + 1) * len(prompts[order[end]]) <= CHUNK_TOKENS):
                end += 1
            chunk = order[start:end]
            outs = self._run_chunk([prompts[i] for i in chunk], [params[i] for i in chunk])
            for i, out in zip(chunk, outs):
                results[i] = out
            start = end
        return results  # type: ignore[return-value]

    def _run_chunk(self, prompts: list[list[int]], params: list[PoolingParams]) -> list[torch.Tensor]:
        batch = PoolingBatch.build(prompts, [p.pair_start for p in params], self.device)
        hidden = self.model.pool_forward(batch)
        pooled = self.pooler(hidden, batch)
        classify = getattr(self.model, "classify", None)
        if classify is not None:
            pooled = classify(pooled)
        pooled = pooled.float().cpu()
        return [self._head(row, p, classify is not None) for row, p in zip(pooled, params)]

    def _head(self, row: torch.Tensor, params: PoolingParams, is_classifier: bool) -> torch.Tensor:
        if is_classifier:  # classify / score / encode on a classifier: logits -> probabilities
            if params.use_activation is False:
                return row
            return torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, dim=-1)
        if params.dimensions is not None:
            row = row[: params.dimensions]
        normalize = self.pooler_config.normalize if params.normalize is None else params.normalize
        return F.normalize(row, dim=-1) if normalize else row
