"""Programmatic dependent launch (fused_ops.pdl_options): a kernel may start before the one
ahead of it has finished, so each must wait before it reads that one's output. Long chains of
dependent kernels, eager and replayed from a CUDA graph, must give the bits they give with PDL
off; a missing wait would read stale inputs. Off the GPU PDL is never asked for."""

from __future__ import annotations

import pytest
import torch

from ember.layers import fused_ops, linear


def test_no_pdl_on_the_cpu(monkeypatch):
    monkeypatch.setenv("EMBER_PDL", "1")
    assert fused_ops.pdl_options(torch.zeros(1)) == {"PDL": False}


def _chain(x, weights, norm_weight, residual):
    """A decode-step-like chain: linear, fused add + RMSNorm, SiLU-and-mul, each reading the
    previous kernel's output."""
    for w_up, w_down in weights:
        h = fused_ops.silu_and_mul(linear.small_batch_linear(x, w_up))
        x, residual = fused_ops.fused_add_rms_norm(linear.small_batch_linear(h, w_down),
                                                   residual, norm_weight, 1e-6)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("l2_prefetch", [0, 1024])
def test_gpu_pdl_chain_equals_plain_launches(monkeypatch, l2_prefetch):
    gen = torch.Generator().manual_seed(0)
    hidden, inter, layers = 1024, 2048, 24

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()

    weights = [(rand(2 * inter, hidden, scale=hidden**-0.5), rand(hidden, inter, scale=inter**-0.5))
               for _ in range(layers)]
    norm_weight = rand(hidden)
    x, residual = rand(1, hidden), rand(1, hidden)
    monkeypatch.setenv("EMBER_GEMV_L2_PREFETCH", str(l2_prefetch))
    monkeypatch.setenv("EMBER_PDL", "0")
    want = _chain(x, weights, norm_weight, residual)
    monkeypatch.setenv("EMBER_PDL", "1")
    assert fused_ops.pdl_options(x)["PDL"], "the H200 is sm90: PDL must be on"
    assert torch.equal(_chain(x, weights, norm_weight, residual), want)
    static_x = x.clone()
    _chain(static_x, weights, norm_weight, residual)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, weights, norm_weight, residual)
    for _ in range(3):
        static_x.zero_()  # the graph must read the new input, after this kernel
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(out, want)
