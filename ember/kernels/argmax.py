"""Greedy argmax of a few rows of logits, over vocabulary chunks, in one kernel.

Torch reduces a row in one thread block, which for a large vocabulary at batch 1 is a visible
share of a decode step; this spreads each row over many programs and lets the last one to
finish merge them (ties go to the smallest index, as torch's do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, merge_counters, next_power_of_2

CHUNK = 4096  # vocabulary entries per program


@triton.jit
def _argmax_kernel(x_ptr, part_val_ptr, part_idx_ptr, counters_ptr, out_ptr, n_cols, stride_x,
                   num_chunks, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    # Grid (rows, chunks): each program finds its chunk's max and first index of it; the last
    # program of a row to finish (an atomic count per row, no second kernel) picks the winner
    # (largest value, then smallest index: torch's first-occurrence rule) and resets the count.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < n_cols,
                other=float("-inf")).to(tl.float32)
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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D float tensor with unit stride along its rows."""
    rows, n_cols = x.shape
    assert x.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = cdiv(n_cols, CHUNK)
    part_val = torch.empty(rows * num_chunks, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(rows * num_chunks, dtype=torch.int32, device=x.device)
    _argmax_kernel[(rows, num_chunks)](
        x, part_val, part_idx, merge_counters(rows, x.device), out, n_cols, x.stride(0), num_chunks,
        CHUNK=CHUNK, CHUNKS_PAD=next_power_of_2(num_chunks), num_warps=8,
    )
    return out
