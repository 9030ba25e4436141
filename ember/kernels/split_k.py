"""split_k_total: the K-split merge of the weight-streaming linear kernels, inside the kernel.

A linear kernel whose grid splits K (small_batch_linear, int4_gemv, fp8_gemv) has each split
store its float32 partial tile; the split that finishes a tile last (an atomic count per tile in
the device's merge counters, ember.kernels.launch) adds all the partials in split order, so the
result does not depend on which finished first, and resets the count for the next launch.
No second kernel, no host synchronization.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_k_total(acc, part_ptr, counters_ptr, tile_id, pid_k, offsets, mask, tile_numel,
                  SPLIT_K: tl.constexpr):
    """(total, last): with one split, (acc, True). Otherwise this split's partial ``acc`` is
    stored at ``part_ptr + pid_k * tile_numel + offsets``; the program that finishes tile
    ``tile_id`` last gets the sum of every split's partial and True, the others their own
    ``acc`` and False (they have nothing left to write)."""
    if SPLIT_K == 1:
        return acc, True
    tl.store(part_ptr + pid_k * tile_numel + offsets, acc, mask=mask)
    last = tl.atomic_add(counters_ptr + tile_id, 1, sem="acq_rel") == SPLIT_K - 1
    if last:
        acc = tl.zeros_like(acc)
        for split in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + split * tile_numel + offsets, mask=mask, other=0.0,
                           cache_modifier=".cg")
        tl.atomic_xchg(counters_ptr + tile_id, 0)
    return acc, last
