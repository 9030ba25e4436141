"""The encoder's CPU path against plain references: attention on runs of equal-length prompts
(PoolingBatch.attend_packed) against per-prompt scaled_dot_product_attention; the BERT layer's
oneDNN linears (activation and residual in the matmul's epilogue) against ATen's, for each
hidden_act, including a weight written after the first forward (repacked); and the layer's
padded-attention branch (what a GPU runs) against the packed one.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ember.models import bert, bert_cpu
from ember.models.bert import BertLayer
from ember.pooling.batch import PoolingBatch

LENGTHS = [1, 3, 3, 3, 7, 7, 12, 30]  # sorted, as the runner hands them over; runs of equal ones


def _batch(lengths: list[int], vocab: int = 50) -> PoolingBatch:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    return PoolingBatch.build(prompts, [None] * len(prompts), torch.device("cpu"))


def test_attend_packed_equals_attention_per_prompt():
    heads, d = 4, 8
    batch = _batch(LENGTHS)
    assert batch.runs == [(0, 1, 1), (1, 3, 3), (10, 2, 7), (24, 1, 12), (36, 1, 30)]
    torch.manual_seed(0)
    qkv = torch.randn(sum(LENGTHS), 3 * heads * d)
    got = batch.attend_packed(qkv, heads, 1 / math.sqrt(d))
    start = 0
    for n in LENGTHS:
        q, k, v = qkv[start:start + n].view(n, 3, heads, d).permute(1, 2, 0, 3)
        want = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, heads * d)
        torch.testing.assert_close(got[start:start + n], want, rtol=1e-5, atol=1e-6)
        start += n


@pytest.mark.skipif(not bert_cpu.AVAILABLE, reason="torch built without oneDNN")
@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu"])
def test_onednn_layer_equals_aten_layer(act):
    config = SimpleNamespace(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                             layer_norm_eps=1e-12, hidden_act=act)
    torch.manual_seed(0)
    layer = BertLayer(config, torch.float32)
    assert layer.fused is not None
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    batch = _batch(LENGTHS)
    x = torch.randn(sum(LENGTHS), 32)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            fused = layer(x, batch)
            packed, layer.fused = layer.fused, None  # the ATen linears
            try:
                plain = layer(x, batch)
            finally:
                layer.fused = packed
        return fused, plain

    fused, plain = both()
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=2e-5)
    with torch.no_grad():  # weights written after the first forward: the packing follows
        layer.intermediate.weight.mul_(-1)
    fused2, plain2 = both()
    torch.testing.assert_close(fused2, plain2, rtol=1e-5, atol=2e-5)
    assert not torch.allclose(fused2, fused)


def test_padded_branch_equals_packed_branch(monkeypatch):
    """The GPU's branch (pad, masked attention, unpad) run on the CPU gives the same layer."""
    config = SimpleNamespace(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                             layer_norm_eps=1e-12, hidden_act="gelu")
    torch.manual_seed(1)
    layer = BertLayer(config, torch.float32)
    layer.fused = None
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    batch = _batch(LENGTHS)
    x = torch.randn(sum(LENGTHS), 32)
    pads = []
    pad = PoolingBatch.pad
    monkeypatch.setattr(PoolingBatch, "pad", lambda self, t: pads.append(1) or pad(self, t))
    with torch.inference_mode():
        packed = layer(x, batch)
        assert not pads
        monkeypatch.setattr(bert, "packed_attention", lambda device: False)
        padded = layer(x, batch)
    assert pads  # the padded branch ran
    torch.testing.assert_close(padded, packed, rtol=1e-5, atol=2e-5)
