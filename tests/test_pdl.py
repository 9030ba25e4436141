"""Programmatic dependent launch (ember.kernels.launch.pdl_options): a kernel may start before
the one ahead of it has finished, so each must wait before it reads that one's output. Long
chains of dependent kernels, eager and replayed from a CUDA graph, must give the bits they give
with PDL off; a missing wait would read stale inputs. Off the GPU PDL is never asked for."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before a kernel module is imported: @triton.jit reads it then.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ember.kernels import KernelConfig, kernel_config, use_kernel_config  # noqa: E402
from ember.kernels.launch import pdl_options  # noqa: E402


def test_no_pdl_on_the_cpu():
    assert kernel_config().pdl  # on by default, yet never on the CPU
    assert pdl_options(torch.zeros(1)) == {"PDL": False}


def _chain(x, weights, norm_weight, residual, l2_prefetch):
    """A decode-step-like chain: linear (its tuned tiles, with this L2 prefetch), fused add +
    RMSNorm, SiLU-and-mul, each reading the previous kernel's output."""
    from ember.kernels.rms_norm import fused_add_rms_norm
    from ember.kernels.silu_and_mul import silu_and_mul
    from ember.kernels.small_batch_linear import small_batch_linear, small_batch_linear_config

    def linear(x, w):
        config = small_batch_linear_config(*w.shape, w.device)._replace(l2_prefetch=l2_prefetch)
        return small_batch_linear(x, w, config=config)

    for w_up, w_down in weights:
        h = silu_and_mul(linear(x, w_up))
        x, residual = fused_add_rms_norm(linear(h, w_down), residual, norm_weight, 1e-6)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("l2_prefetch", [0, 1024])
def test_gpu_pdl_chain_equals_plain_launches(l2_prefetch):
    gen = torch.Generator().manual_seed(0)
    hidden, inter, layers = 1024, 2048, 24

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().cuda()

    weights = [(rand(2 * inter, hidden, scale=hidden**-0.5), rand(hidden, inter, scale=inter**-0.5))
               for _ in range(layers)]
    norm_weight = rand(hidden)
    x, residual = rand(1, hidden), rand(1, hidden)
    with use_kernel_config(KernelConfig(pdl=False)):
        want = _chain(x, weights, norm_weight, residual, l2_prefetch)
    assert pdl_options(x)["PDL"], "the H200 is sm90: PDL must be on"
    assert torch.equal(_chain(x, weights, norm_weight, residual, l2_prefetch), want)
    static_x = x.clone()
    _chain(static_x, weights, norm_weight, residual, l2_prefetch)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, weights, norm_weight, residual, l2_prefetch)
    for _ in range(3):
        static_x.zero_()  # the graph must read the new input, after this kernel
        static_x.copy_(x)
        graph.replay()
        assert torch.equal(out, want)
