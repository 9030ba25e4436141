"""l2_prefetch: read weights into the GPU's L2 cache ahead of the layer that uses them.

Decoding one sequence, the GPU's memory sits idle through the short kernels between the big
weight reads (rotary, attention over a short context and its split merge: several
microseconds a layer). A weight read then, on a stream beside the layer's
(ember.layers.weight_prefetch), is in L2 when its layer runs. This kernel issues one
``prefetch.global.L2::evict_last`` per 128-byte line of up to MAX_TENSORS tensors (evict-last:
the weight streams of the layers in between should not push the lines out first). No PDL: it
runs beside the stream's chain, not in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, compiled_for_gpu

LINE = 128  # bytes a prefetch brings
LINES_PER_PROGRAM = 4096  # 32 a thread at four warps
MAX_TENSORS = 6


@triton.jit
def _pick(i, p0, p1, p2, p3, p4, p5, n0, n1, n2, n3, n4, n5):
    """(pointer, lines) of tensor i."""
    base, lines = p0, n0
    if i == 1:
        base, lines = p1, n1
    elif i == 2:
        base, lines = p2, n2
    elif i == 3:
        base, lines = p3, n3
    elif i == 4:
        base, lines = p4, n4
    elif i == 5:
        base, lines = p5, n5
    return base, lines


@triton.jit
def _l2_prefetch_kernel(p0, p1, p2, p3, p4, p5, n0, n1, n2, n3, n4, n5,
                        LINES: tl.constexpr, LINE_BYTES: tl.constexpr):
    # Grid (line blocks, tensors): program (j, i) prefetches tensor i's lines j * LINES on.
    base, lines = _pick(tl.program_id(1), p0, p1, p2, p3, p4, p5, n0, n1, n2, n3, n4, n5)
    if tl.program_id(0) * LINES < lines:
        offs = tl.program_id(0) * LINES + tl.arange(0, LINES)
        ptrs = tl.where(offs < lines, base + offs.to(tl.int64) * LINE_BYTES, base)
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(tensors: list[torch.Tensor]) -> None:
    """Prefetch contiguous CUDA tensors into L2 (one launch per MAX_TENSORS, on the current
    stream; a hint, no result). Without a compiled GPU kernel, nothing."""
    assert tensors and all(t.is_contiguous() for t in tensors)
    if not compiled_for_gpu(tensors[0]):
        return
    for start in range(0, len(tensors), MAX_TENSORS):
        _launch(tensors[start:start + MAX_TENSORS])


def _launch(tensors: list[torch.Tensor]) -> None:
    views = [t.view(-1).view(torch.uint8) for t in tensors]
    lines = [cdiv(v.numel(), LINE) for v in views]
    views += [views[0]] * (MAX_TENSORS - len(views))
    lines += [0] * (MAX_TENSORS - len(lines))
    _l2_prefetch_kernel[(cdiv(max(lines), LINES_PER_PROGRAM), len(tensors))](
        *views, *lines, LINES=LINES_PER_PROGRAM, LINE_BYTES=LINE, num_warps=4)
