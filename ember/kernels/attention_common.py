"""Pieces shared inside the attention kernels: score scaling and the finite running maximum."""

from __future__ import annotations

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
