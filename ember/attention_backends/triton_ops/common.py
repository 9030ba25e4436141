"""Small pieces shared by the Triton attention kernels: score scaling and launch helpers."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Finite "minus infinity" for running maxima: a row whose keys are all masked keeps
# m = NEG_BIG, so exp2(m_old - m_new) stays 1 and never becomes NaN (inf - inf).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def scaled_scores(qk, scale, softcap, SOFTCAP: tl.constexpr):
    """Turn raw q.k dot products into base-2 logits (the kernels use exp2, cheaper than exp)."""
    if SOFTCAP:
        # softcap * tanh(x / softcap), with tanh(y) = 2 * sigmoid(2y) - 1 (no libdevice needed).
        x = qk * (scale / softcap)
        x = softcap * (2.0 * tl.sigmoid(2.0 * x) - 1.0)
        return x * 1.4426950408889634
    else:
        return qk * (scale * 1.4426950408889634)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 caches must not silently drop to tf32 (tests compare at 1e-5); 16-bit ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def head_pad(head_size: int) -> int:
    # tl.arange needs a power of two and tl.dot needs every dimension >= 16.
    return max(16, triton.next_power_of_2(head_size))


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query is not free)."""
    if device_index is None or not torch.cuda.is_available():
        # CPU tensors only run under TRITON_INTERPRET, which executes programs one at a time:
        # a small "SM count" keeps split grids (and tests) small.
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(t: torch.Tensor) -> int | None:
    if t.device.type != "cuda":
        return None
    return t.device.index if t.device.index is not None else torch.cuda.current_device()
