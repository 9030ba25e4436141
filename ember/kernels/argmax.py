"""Greedy argmax of rows of logits, over vocabulary chunks, in one kernel; optionally under a
grammar's token bitmask.

Torch reduces a row in one thread block, which for a large vocabulary at batch 1 is a visible
share of a decode step; this spreads each row over many programs and lets the last one to
finish merge them (ties go to the smallest index, as torch's do). With a bitmask (structured
outputs, greedy rows) each program reads its chunk's bits and leaves the disallowed tokens out
(as -inf), in place of unpacking the bitmask, masking a float copy of the logits and taking the
argmax in some ten torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels import fast_launch
from ember.kernels.launch import cdiv, merge_counters, next_power_of_2

CHUNK = 4096  # vocabulary entries per program


@triton.jit
def _argmax_kernel(x_ptr, part_val_ptr, part_idx_ptr, counters_ptr, out_ptr, n_cols, stride_x,
                   num_chunks, mask_ptr, mask_rows_ptr, mask_words, stride_m,
                   CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr, HAS_MASK: tl.constexpr,
                   ROWS_IN_ORDER: tl.constexpr):
    # Grid (rows, chunks): each program finds its chunk's max and first index of it; the last
    # program of a row to finish (an atomic count per row, no second kernel) picks the winner
    # (largest value, then smallest index: torch's first-occurrence rule) and resets the count.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < n_cols,
                other=float("-inf")).to(tl.float32)
    if HAS_MASK:  # mask_rows[row]: this row's bitmask row, -1 for none (every token allowed)
        if ROWS_IN_ORDER:
            mask_row = row
        else:
            mask_row = tl.load(mask_rows_ptr + row)
        if mask_row >= 0:
            word = offs // 32
            bits = tl.load(mask_ptr + mask_row.to(tl.int64) * stride_m + word,
                           mask=word < mask_words, other=0)  # past the bitmask: disallowed
            x = tl.where(((bits >> (offs % 32)) & 1) != 0, x, float("-inf"))
    part = row * num_chunks + chunk
    tl.store(part_val_ptr + part, tl.max(x, 0))
    tl.store(part_idx_ptr + part, chunk * CHUNK + tl.argmax(x, 0, tie_break_left=True))
    if tl.atomic_add(counters_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
        offs_c = tl.arange(0, CHUNKS_PAD)
        valid = offs_c < num_chunks
        vals = tl.load(part_val_ptr + row * num_chunks + offs_c, mask=valid,
                       other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(part_idx_ptr + row * num_chunks + offs_c, mask=valid, other=n_cols,
                       cache_modifier=".cg")
        best = tl.max(vals, 0)
        winner = tl.min(tl.where(valid & (vals == best), idxs, n_cols), 0)
        tl.store(out_ptr + row, winner.to(tl.int64))
        tl.atomic_xchg(counters_ptr + row, 0)


def argmax_rows(x: torch.Tensor, bitmask: torch.Tensor | None = None,
                mask_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D float tensor with unit stride along its rows. With
    ``bitmask`` (int32 [B, words], bit j of word w allowing token 32w + j) and ``mask_rows``
    (int32 [rows]: the bitmask row of each row, -1 for none), a masked row's argmax is over
    its allowed tokens only (tokens past the bitmask are disallowed), as torch's argmax of the
    logits with the others at -inf. ``mask_rows=None`` with a bitmask: row i takes bitmask row
    i (every row masked, in order: no row map to copy to the device)."""
    rows, n_cols = x.shape
    assert x.stride(-1) == 1
    has_mask = bitmask is not None
    in_order = has_mask and mask_rows is None
    if has_mask:
        assert in_order or mask_rows.shape == (rows,)
        assert not in_order or bitmask.shape[0] >= rows
        assert bitmask.dtype == torch.int32 and bitmask.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = cdiv(n_cols, CHUNK)
    part_val = torch.empty(rows * num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows * num_chunks, dtype=torch.int32, device=x.device)
    # Launched eagerly every step (greedy sampling is outside the CUDA graphs): past the first
    # launch, without triton's per-call binding (ember.kernels.fast_launch).
    fast_launch.launch(
        _argmax_kernel, (rows, num_chunks, 1),
        (x, part_val, part_idx, merge_counters(rows, x.device), out, n_cols, x.stride(0),
         num_chunks, bitmask if has_mask else out, mask_rows if mask_rows is not None else out,
         bitmask.shape[1] if has_mask else 0, bitmask.stride(0) if has_mask else 0),
        {"CHUNK": CHUNK, "CHUNKS_PAD": next_power_of_2(num_chunks), "HAS_MASK": has_mask,
         "ROWS_IN_ORDER": in_order}, num_warps=8)
    return out
