"""The BERT encoder (BertModel as sentence-transformers ships it, BertForSequenceClassification
for cross-encoders and classifiers): bidirectional attention over whole prompts, no KV cache.

Prompts arrive packed (ember.pooling.batch.PoolingBatch): every layer runs on real tokens only; on
the CPU the attention core too (one call per run of equal-length prompts, no padding), on a GPU
it sees a padded view. q, k and v are fused at load time; on the CPU in float32 the linears are
oneDNN's with the GELU and the residual adds in their epilogue (ember.models.bert_cpu). Parameter
names follow HF's, except `qkv` (HF's query, key and value).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.models import bert_cpu
from ember.pooling.batch import PoolingBatch

_QKV = {"query": 0, "key": 1, "value": 2}
_IGNORED = ("embeddings.position_ids", "pooler.dense")  # unused by BertModel's pooling


def _act(name: str):
    # In place: the intermediate activations are the largest tensor of a layer, and a second
    # one of that size costs an allocation and a pass through memory.
    if name == "gelu":
        return torch.ops.aten.gelu_
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return lambda x: torch.ops.aten.gelu_(x, approximate="tanh")
    if name == "relu":
        return F.relu_
    raise ValueError(f"BERT hidden_act {name!r} is not supported (gelu, gelu_new, relu)")


def packed_attention(device: torch.device) -> bool:
    """Attention per run of equal-length prompts (the CPU: compute-bound, no padding) rather
    than one padded call (a GPU: one launch); see PoolingBatch."""
    return device.type == "cpu"


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are supported, got "
                             f"{config.position_embedding_type!r}")
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, batch: PoolingBatch) -> torch.Tensor:
        x = (self.word_embeddings(batch.input_ids) + self.position_embeddings(batch.positions)
             + self.token_type_embeddings(batch.token_type_ids))
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_size = h // self.num_heads
        self.qkv = nn.Linear(h, 3 * h, dtype=dtype)
        self.attn_out = nn.Linear(h, h, dtype=dtype)
        self.attn_norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.intermediate = nn.Linear(h, config.intermediate_size, dtype=dtype)
        self.output = nn.Linear(config.intermediate_size, h, dtype=dtype)
        self.out_norm = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.act = _act(config.hidden_act)
        self.hidden_act = config.hidden_act
        # The CPU's float32 path: oneDNN linears with the activation / residual fused in.
        self.fused = None
        if bert_cpu.supports(config.hidden_act, dtype):
            self.fused = tuple(bert_cpu.PackedLinear(m) for m in (
                self.qkv, self.attn_out, self.intermediate, self.output))

    def forward(self, x: torch.Tensor, batch: PoolingBatch) -> torch.Tensor:
        heads, d = self.num_heads, self.head_size
        if x.device.type == "cpu" and self.fused is not None:  # bert_cpu's oneDNN linears
            qkv_, out_, inter_, output_ = self.fused
            o = batch.attend_packed(qkv_(x), heads, 1.0 / math.sqrt(d))
            x = self.attn_norm(out_.add(o, x))
            return self.out_norm(output_.add(inter_(x, self.hidden_act), x))
        qkv = self.qkv(x)
        if packed_attention(x.device):
            o = batch.attend_packed(qkv, heads, 1.0 / math.sqrt(d))
        else:  # one attention launch for the chunk
            b, n = batch.num_seqs, batch.max_len
            q, k, v = batch.pad(qkv).view(b, n, 3, heads, d).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask,
                                               scale=1.0 / math.sqrt(d))
            o = batch.unpad(o.transpose(1, 2).reshape(b, n, heads * d))
        x = self.attn_norm(self.attn_out(o).add_(x))
        return self.out_norm(self.output(self.act(self.intermediate(x))).add_(x))


class BertModel(nn.Module):
    """The encoder; `forward` returns the last hidden states of the packed tokens, [T, H]."""

    default_pooling = "cls"  # HF's; sentence-transformers' modules.json usually says "mean"
    prefix = ""

    def __init__(self, config: Any, attn_backend: Any = None,
                 dtype: torch.dtype = torch.float32) -> None:
        # attn_backend: ember's model constructor signature; BERT's attention is its own.
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.embeddings = BertEmbeddings(config, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))

    def pool_forward(self, batch: PoolingBatch) -> torch.Tensor:
        x = self.embeddings(batch)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    # ---- weight loading (HF names) ------------------------------------------------------
    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        """Our name for an HF encoder weight name (without prefix), and its qkv shard."""
        parts = name.split(".")
        if parts[0] != "encoder":
            return name, None
        i, rest = parts[2], ".".join(parts[3:])
        table = {
            "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
            "intermediate.dense": "intermediate", "output.dense": "output",
            "output.LayerNorm": "out_norm",
        }
        for hf, ours in table.items():
            if rest.startswith(hf + "."):
                return f"layers.{i}.{ours}.{rest[len(hf) + 1:]}", None
        if rest.startswith("attention.self."):
            which, leaf = parts[-2], parts[-1]
            return f"layers.{i}.qkv.{leaf}", _QKV[which]
        return name, None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unknown = []
        for hf_name, tensor in weights:
            name = hf_name
            if self.prefix and name.startswith(self.prefix):
                name = name[len(self.prefix):]
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias")
            target, shard = self._target(name)
            param = params.get(target)
            if param is None:
                if not name.startswith(_IGNORED):
                    unknown.append(hf_name)
                continue
            dst = param.data
            if shard is not None:
                size = dst.shape[0] // 3
                dst = dst.narrow(0, shard * size, size)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, the model "
                                 f"expects {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        if unknown:
            raise ValueError(f"unknown weights for {type(self).__name__}: {unknown[:10]}")
        expected = set()
        for name in params:
            if ".qkv." in name:
                expected |= {f"{name}#{s}" for s in range(3)}
            else:
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:10]}")
        return loaded


class BertForSequenceClassification(BertModel):
    """BERT + HF's pooler (dense + tanh on the [CLS] state) + a linear classifier."""

    prefix = "bert."

    def __init__(self, config: Any, attn_backend: Any = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, attn_backend, dtype)
        self.num_labels = config.num_labels
        self.pooler_dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels, dtype=dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[B, H] pooled ([CLS]) states -> [B, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler_dense(pooled)))

    @staticmethod
    def _target(name: str) -> tuple[str, int | None]:
        if name.startswith("pooler.dense."):
            return "pooler_dense." + name.split(".")[-1], None
        return BertModel._target(name)
