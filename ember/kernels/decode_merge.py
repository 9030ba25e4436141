"""The split-KV half of decode attention (ember.kernels.decode_attention): how a request's keys
are cut into splits (``split_plan``, which the decode kernel follows too) and the kernel that
merges the splits' partial outputs by their log-sum-exps, one program per (request, head),
writing half-precision rows or int8_act's rows for a 4-bit o_proj.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.int8_act import store_groups
from ember.kernels.launch import next_power_of_2


@triton.jit
def split_plan(seq_len, window, num_splits, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """First key tile of a request and keys per split (a multiple of BLOCK_N, at least one)."""
    start = 0
    if SLIDING:
        start = tl.maximum(seq_len - window, 0)
    start = (start // BLOCK_N) * BLOCK_N
    span = tl.maximum(seq_len - start, 0)
    per_split = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    return start, tl.maximum(per_split, BLOCK_N)



@triton.jit(do_not_specialize=["num_splits"])  # see decode_attention's kernel; SPLITS_PAD stays
def _reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    words_ptr,
    int8_scale_ptr,
    int8_sums_ptr,
    window,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    INT8_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    start, per_split = split_plan(seq_len, window, num_splits, BLOCK_N, SLIDING)
    # Only splits that saw keys wrote anything; the rest of the workspace is stale memory.
    n_valid = tl.cdiv(tl.maximum(seq_len - start, 0), per_split)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_mask = offs_s < n_valid
    row = (req.to(tl.int64) * NUM_HEADS + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # seq_len == 0 (graph padding): output zeros
    w = tl.where(s_mask, tl.exp2(lse - m), 0.0)
    parts = tl.load(part_out_ptr + row[:, None] * HEAD_PAD + offs_d[None, :],
                    mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o = o.to(out_ptr.dtype.element_ty)
    if INT8_OUT:  # the head is one int8 group (HEAD_SIZE == int8_act.GROUP): quantized whole
        store_groups(o.to(tl.float32).reshape(HEAD_SIZE // 8, 8), head + tl.arange(0, 1),
                     NUM_HEADS, words_ptr + req.to(tl.int64) * (NUM_HEADS * HEAD_SIZE // 8),
                     int8_scale_ptr + req * NUM_HEADS, int8_sums_ptr + req * NUM_HEADS,
                     HEAD_SIZE)
    else:
        o_ptrs = out_ptr + req.to(tl.int64) * stride_ot + head * stride_oh + offs_d
        tl.store(o_ptrs, o, mask=offs_d < HEAD_SIZE)


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor,
                 out: torch.Tensor,
                 int8_out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                 **launch) -> None:  # fmt: skip
    """Merge the splits' partial outputs and log-sum-exps into ``out`` [batch, heads, head
    size], or into ``int8_out`` (int8_act's rows) where given; ``launch``: the decode
    launch's shared arguments (window, num_splits, the output's strides, the sizes, PDL)."""
    # Unused pointers (no int8 output) stand in as the workspace's.
    words, int8_scales, int8_sums = int8_out or (part_out, part_lse, part_lse)
    _reduce_kernel[(out.shape[0], out.shape[1])](
        part_out,
        part_lse,
        seq_lens,
        out,
        words.view(torch.int64) if int8_out else words,
        int8_scales,
        int8_sums,
        INT8_OUT=int8_out is not None,
        SPLITS_PAD=next_power_of_2(launch["num_splits"]),
        num_warps=4 if launch["HEAD_PAD"] >= 128 else 2,
        **launch,
    )
