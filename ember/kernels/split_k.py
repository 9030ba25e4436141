"""split_k_total: the K-split merge of the weight-streaming linear kernels, inside the kernel.

A linear kernel whose grid splits K (small_batch_linear, int4_gemv, fp8_gemv) has each split
store its float32 partial tile; the split that finishes a tile last (an atomic count per tile in
the device's merge counters, ember.kernels.launch) adds all the partials in split order, so the
result does not depend on which finished first, and resets the count for the next launch.
No second kernel, no host synchronization. ``split_k_launch`` sizes a launch's splits and
buffers on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, merge_counters


class SplitK(NamedTuple):
    k_per_split: int  # whole steps of K
    split_k: int  # the grid's second dimension
    partials: torch.Tensor  # float32 [split_k * m * n]; ``out`` when K is not split (unused)
    counters: torch.Tensor  # the merge counters; ``out`` when K is not split (unused)


def split_k_launch(k: int, split_k: int, step: int, m: int, n: int, n_tiles: int,
                   out: torch.Tensor) -> SplitK:
    """Up to ``split_k`` splits of K in whole ``step``s, none left empty, with the partial sums'
    buffer and the merge counters their launch needs."""
    k_per_split = cdiv(cdiv(k, split_k), step) * step
    split_k = cdiv(k, k_per_split)
    if split_k == 1:
        return SplitK(k_per_split, 1, out, out)
    partials = torch.empty(split_k * m * n, dtype=torch.float32, device=out.device)
    return SplitK(k_per_split, split_k, partials, merge_counters(n_tiles, out.device))


@triton.jit
def split_k_total(acc, part_ptr, counters_ptr, tile_id, pid_k, offsets, mask, tile_numel,
                  SPLIT_K: tl.constexpr):
    """(total, last): with one split, (acc, True). Otherwise this split's partial ``acc`` is
    stored at ``part_ptr + pid_k * tile_numel + offsets``; the program that finishes tile
    ``tile_id`` last gets the sum of every split's partial and True, the others their own
    ``acc`` and False (they have nothing left to write)."""
    # One branch is compiled (SPLIT_K is a constexpr); with one split the two buffers are the
    # launch's output tensor, which an early return would still have compiled atomics on.
    if SPLIT_K == 1:
        last = True
    else:
        tl.store(part_ptr + pid_k * tile_numel + offsets, acc, mask=mask)
        last = tl.atomic_add(counters_ptr + tile_id, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            acc = tl.zeros_like(acc)
            for split in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + split * tile_numel + offsets, mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(counters_ptr + tile_id, 0)
    return acc, last
