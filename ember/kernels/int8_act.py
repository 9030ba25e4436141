"""int8 activations for the 4-bit layers' integer GEMV (ember.kernels.w4a8_gemv): each row
quantized to int8 with one scale per GROUP (128) columns, stored in the 4-bit packs' row order.

Why: at one to four rows a 4-bit layer is a read of its weight, and multiplying in bfloat16 on
the CUDA cores costs ~3.4 instructions a weight (ember.kernels.int4_tile), more than an SM
issues at the HBM's rate. With x in int8, one ``dp4a`` multiplies four weights, so a pack's
eight products take a mask, a shift, a mask and two dp4a (llama.cpp's GPU vector kernels
quantize activations to 8 bits for the same reason).

The layout, for the consumer's sake: a pack (ember.quantization.int4_common) holds rows 2s and
2s + 1 at bits 4s and 16 + 4s, so its nibbles masked with 0x0F0F0F0F are, byte by byte, rows
0, 4, 1, 5 and shifted by 4 rows 2, 6, 3, 7. Every 8 columns of x are stored in that order,
[0, 4, 1, 5, 2, 6, 3, 7], and a pack's two int32 words of x line up with its bytes.

Per row and group: ``scale`` = amax / 127 (values round half away from zero to [-127, 127]),
and ``sums`` = scale * sum(q), float32, the zero points' term of the dot: sum x (q_w - z) =
sum x q_w - z * sum x. Producers (RMSNorm, SiLU-and-mul) write this form when the layer after
them asks (``Linear.quantized_input_dtype``); ``quantize_int8`` writes it from a half tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.launch import cdiv, pdl_options

GROUP = 128  # columns per scale
PACKS_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 stored at position PACKS_ORDER.index(j)
GROUPS_PER_PROGRAM = 8  # the int8 writers' programs (quantize, RMSNorm, SiLU): 1,024 columns


@triton.jit
def group_tile(group0, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """(columns [GROUPS * GROUP / 8, 8], groups [GROUPS]) of the GROUPS groups from ``group0``:
    a row's groups as 8-column runs, the shape ``store_groups`` takes. Two dimensions, not
    three: a tile loaded this way puts each group's runs in one warp's lanes, so the groups'
    reductions in ``store_groups`` are shuffles (a [GROUPS, GROUP / 8, 8] load spreads them over
    warps: a shared-memory round and two barriers each)."""
    groups = group0 + tl.arange(0, GROUPS)
    runs = group0 * (GROUP // 8) + tl.arange(0, GROUPS * (GROUP // 8))
    return runs[:, None] * 8 + tl.arange(0, 8)[None, :], groups


@triton.jit
def store_groups(y, groups, n_groups, words_row, scale_row, sums_row, GROUP: tl.constexpr):
    """Quantize float32 ``y`` [G * GROUP / 8, 8] (``group_tile``'s groups ``groups`` of one row)
    and store the int8 values, 8 columns as one int64 word in the packs' order, at the row's
    words (int64), and each group's scale and sum; groups from ``n_groups`` on are not
    stored."""
    y = y.reshape(groups.shape[0], GROUP // 8, 8)
    amax = tl.max(tl.max(tl.abs(y), axis=2), axis=1)
    scale = amax / 127.0
    inv = 127.0 / tl.maximum(amax, 1e-30)  # a group of zeros stays 0
    v = y * inv[:, None, None]
    q = tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)  # |v| <= 127: no clamp needed
    sums = tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32) * scale
    j = tl.arange(0, 8)
    place = ((j % 4) * 2 + j // 4) * 8  # column j's byte in its word (PACKS_ORDER)
    # Disjoint bytes: the sum is their bitwise or (wrapping into the sign bit is harmless).
    words = tl.sum((q.to(tl.int64) & 0xFF) << place.to(tl.int64)[None, None, :], axis=2)
    inside = groups < n_groups
    word_offs = groups[:, None] * (GROUP // 8) + tl.arange(0, GROUP // 8)[None, :]
    tl.store(words_row + word_offs, words, mask=inside[:, None])
    tl.store(scale_row + groups, scale, mask=inside)
    tl.store(sums_row + groups, sums, mask=inside)


@triton.jit
def _quantize_int8_kernel(x_ptr, words_ptr, scale_ptr, sums_ptr, stride_x, K,
                          GROUP: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr):
    # Grid (rows, column blocks of GROUPS groups).
    if PDL:  # see ember.kernels.launch.pdl_options
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols, groups = group_tile(tl.program_id(1) * GROUPS, GROUPS, GROUP)
    n_groups = K // GROUP
    y = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
    store_groups(y, groups, n_groups, words_ptr + row * (K // 8), scale_ptr + row * n_groups,
                 sums_ptr + row * n_groups, GROUP)


def empty_int8_rows(rows: int, k: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three tensors of ``rows`` quantized rows of ``k`` columns: (q int8 [rows, k],
    scales and sums float32 [rows, k / GROUP])."""
    assert k % GROUP == 0, f"{k} columns are not whole groups of {GROUP}"
    q = torch.empty(rows, k, dtype=torch.int8, device=device)
    scales = torch.empty(rows, k // GROUP, dtype=torch.float32, device=device)
    return q, scales, torch.empty_like(scales)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, K] (K a multiple of GROUP) -> (q, scales, sums) in the form above."""
    rows, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, scales, sums = empty_int8_rows(rows, k, x.device)
    if q.numel():
        _quantize_int8_kernel[(rows, cdiv(k // GROUP, GROUPS_PER_PROGRAM))](
            x, q.view(torch.int64), scales, sums, x.stride(0), k, GROUP=GROUP,
            GROUPS=GROUPS_PER_PROGRAM, num_warps=4, **pdl_options(x))
    return q, scales, sums


def quantize_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same form in torch (tests): q in the packs' order, scales, sums."""
    rows, k = x.shape
    y = x.float().reshape(rows, k // GROUP, GROUP)
    amax = y.abs().amax(-1)
    scale = amax / 127
    inv = torch.full_like(amax, 127.0) / amax.clamp_min(1e-30)  # (127 / t is 127 * (1 / t))
    v = y * inv[..., None]
    q = torch.trunc(torch.where(v >= 0, v + 0.5, v - 0.5)).to(torch.int32)
    sums = q.sum(-1).float() * scale
    order = torch.tensor(PACKS_ORDER)
    stored = q.reshape(rows, k // 8, 8)[..., order].reshape(rows, k).to(torch.int8)
    return stored, scale, sums


def dequantize_int8_reference(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [rows, K] in natural column order from the stored form (tests)."""
    rows, k = q.shape
    inverse = torch.tensor([PACKS_ORDER.index(j) for j in range(8)])
    natural = q.reshape(rows, k // 8, 8)[..., inverse].reshape(rows, k).float()
    return (natural.reshape(rows, k // GROUP, GROUP) * scales[..., None]).reshape(rows, k)
