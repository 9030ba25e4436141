"""CPU decode call-count savings of the torch path (KernelConfig(cpu_layers=False); the native
ops are tests/test_cpu_layer_ops.py) that must not change a bit: rotary on q and k as one view
of the fused qkv output, and float32 RMSNorm as one torch call."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import KernelConfig, use_kernel_config
from ember.layers import rotary
from ember.layers.rotary import RotaryEmbedding


@pytest.fixture(autouse=True)
def torch_ops():
    """Layers built in these tests keep the torch ops."""
    with use_kernel_config(KernelConfig(cpu_layers=False)):
        yield


def _qkv(t: int, hq: int, hk: int, d: int) -> tuple[torch.Tensor, ...]:
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hk, d), v


def test_joint_rotation_equals_separate_rotation_bit_for_bit():
    rope = RotaryEmbedding(64, 10000.0)
    for t in (1, 5):
        q, k, _ = _qkv(t, 9, 3, 64)
        assert rotary._adjacent_heads(q, k) is not None
        cos, sin = rope.cos_sin(torch.arange(7, 7 + t), torch.float32)
        jq, jk = rope.apply_qk(q, k, cos, sin)
        assert torch.equal(jq, rope.apply(q, cos, sin))
        assert torch.equal(jk, rope.apply(k, cos, sin))
        assert jq.shape == q.shape and jk.shape == k.shape


def test_tensors_that_are_not_neighbours_rotate_separately():
    rope = RotaryEmbedding(64, 10000.0, rotary_dim=32)  # partial rotary too
    q, k, v = _qkv(3, 4, 2, 64)
    assert rotary._adjacent_heads(q, v.view(3, 2, 64)) is None  # v does not follow q
    assert rotary._adjacent_heads(q.clone(), k) is None
    assert rotary._adjacent_heads(k, q) is None  # wrong order
    cos, sin = rope.cos_sin(torch.arange(3), torch.float32)
    jq, jk = rope.apply_qk(q, k, cos, sin)
    assert torch.equal(jq, rope.apply(q, cos, sin)) and torch.equal(jk, rope.apply(k, cos, sin))


def test_separate_allocations_that_touch_are_not_one_view():
    # Qwen3 normalises q and k into new tensors; CUDA's caching allocator may place k right
    # after q. One token's heads then look adjacent, but a joint view would overrun q's storage.
    buf = bytearray(torch.randn(1, 6, 16).numpy().tobytes())
    q = torch.frombuffer(buf, dtype=torch.float32, count=4 * 16).view(1, 4, 16)
    k = torch.frombuffer(buf, dtype=torch.float32, offset=4 * 16 * 4, count=2 * 16).view(1, 2, 16)
    assert k.data_ptr() == q.data_ptr() + q.numel() * 4
    assert rotary._adjacent_heads(q, k) is None
    rope = RotaryEmbedding(16, 10000.0)
    cos, sin = rope.cos_sin(torch.arange(1), torch.float32)
    jq, jk = rope.apply_qk(q, k, cos, sin)
    assert torch.equal(jq, rope.apply(q, cos, sin)) and torch.equal(jk, rope.apply(k, cos, sin))


def test_float32_rms_norm_is_bit_identical_to_hf_ops():
    from ember.layers.norm import RMSNorm

    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    for shape in ((1, 64), (17, 64), (3, 5, 64)):
        x = torch.randn(*shape) * 7
        hf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert torch.equal(norm(x), norm.weight * hf)
