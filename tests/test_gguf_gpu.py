"""The Triton GGUF dequantize-matmul on a CUDA GPU: every supported type, decode and prefill row
counts, half precision, against x @ dequantized.T; and the gguf method's fused mixed-type layer
on the device through the conformance kit (blocks decoded on the host, parts moved)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.quantization.gguf_blocks import SUPPORTED, Q, decode_blocks

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _affine(qtype, n, k, rng):
    from test_gguf_quant import _blocks

    weight = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return decode_blocks(torch.from_numpy(_blocks(qtype, weight, rng)), qtype, (n, k))


@needs_cuda
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_dequantized_reference(qtype, dtype):
    from ember.kernels.gguf_matmul import gguf_matmul, pack_nibbles

    rng = np.random.default_rng(0)
    n, k = 4096, 4096
    ac = _affine(qtype, n, k, rng)
    codes = (pack_nibbles(ac.codes) if ac.bits == 4 else ac.codes).cuda()
    mn = None if ac.min is None else ac.min.cuda()
    ref_w = ac.dequantize().cuda()
    for m in (1, 7, 64, 300):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        got = gguf_matmul(x, codes, ac.scale.cuda(), mn, offset=ac.offset, group=ac.group,
                          bits=ac.bits, n=n, k=k)
        want = x.float() @ ref_w.T
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert got.dtype == dtype and err < 2e-2, (qtype.name, m, err)


@needs_cuda
def test_fused_mixed_layer_on_cuda():
    """A q/k/v-like layer of three shards (Q4_K, Q6_K, Q8_0) built on the device: each shard
    loads from its host blocks and the layer equals x @ dequantized.T + b."""
    from ember.layers.linear import Linear, bind_weight_loaders, linear_method_provider
    from ember.quantization.base import linear_method_provider_for
    from ember.quantization.gguf import GGUFQuantization

    rng = np.random.default_rng(1)
    sizes, k = [512, 256, 256], 1024
    with linear_method_provider(linear_method_provider_for(GGUFQuantization())):
        layer = Linear(k, sum(sizes), True, dtype=torch.bfloat16, output_sizes=sizes,
                       device="cuda", prefix="model.layers.0.self_attn.qkv_proj")
    param = bind_weight_loaders(torch.nn.ModuleDict({"p": layer}))["p.weight"]
    ref = []
    for shard, (qtype, rows) in enumerate(zip((Q.Q4_K, Q.Q6_K, Q.Q8_0), sizes)):
        from test_gguf_quant import _blocks

        raw = torch.from_numpy(_blocks(qtype, rng.standard_normal((rows, k)).astype(np.float32)
                                       * 0.05, rng))
        raw.gguf_qtype, raw.gguf_shape = qtype, (rows, k)
        param.weight_loader(param, raw, shard)
        ref.append(decode_blocks(raw, qtype, (rows, k)).dequantize())
    bias = torch.randn(sum(sizes), device="cuda", dtype=torch.bfloat16)
    layer.bias.data.copy_(bias)
    layer.quant_method.process_weights_after_loading(layer)
    assert [p.kind for p in layer.gguf_parts] == ["triton"] * 3
    w = torch.cat(ref).cuda()
    for m in (1, 40):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ w.T + bias.float()
        err = ((layer(x).float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, (m, err)
