"""4-bit group-quantized weights shared by AWQ and GPTQ: the two HF checkpoint layouts, packing
and unpacking, the dequantized reference, and the one in-memory form ember's kernels read.

A 4-bit weight W [in=K, out=N] is stored as integers q in 0..15 with, per group of
``group_size`` input rows and per output column, a scale s and an integer zero point z:
W[k, n] = (q[k, n] - z[g, n]) * s[g, n], g = the group of row k.

Checkpoint layouts (what the published formats put in safetensors):
- AWQ "gemm": ``qweight`` int32 [K, N/8] packs 8 neighbouring columns per int32 in AutoAWQ's
  interleaved order (the value of column 8c + AWQ_ORDER[i] sits in bits 4i..4i+3); ``qzeros``
  int32 [G, N/8] packed the same way; ``scales`` [G, N] float16.
- GPTQ: ``qweight`` int32 [K/8, N] packs 8 consecutive rows per int32 (row 8r + i in bits
  4i..4i+3); ``qzeros`` int32 [G, N/8] packs 8 consecutive columns, and the "gptq" (v1)
  checkpoint format stores z - 1 (the "gptq_v2" format stores z); ``scales`` [G, N];
  ``g_idx`` int32 [K] gives each row's group (rows of one group are scattered with desc_act).

In memory ember keeps one form for both (``Int4Weight``): ``qweight`` int32 [N, K/8], output
column major: pack r of column n holds input rows 8r..8r+7 in pair order (row 8r + 2s in bits
4s..4s+3, row 8r + 2s + 1 in bits 16 + 4s..19 + 4s, s = 0..3: ``PAIR_ORDER``, which happens
to be AWQ's interleave); ``qzeros`` [G, N/8] with 8 consecutive columns per int32 in sequential
order and the zero itself (not z - 1); ``scales`` [G, N]. Both checkpoint formats are repacked
once at load, and desc_act's scattered groups become contiguous by permuting the input rows
(``perm``: the kernels then read x[:, perm]).

Why this form: a one-row GEMV streams each column's packs as one contiguous run (16-byte loads
along K, every byte of a DRAM burst used), and one mask-and-or of a pack shifted by 4s gives
the pair of 16-bit values (q[8r + 2s], q[8r + 2s + 1]), which meets the pair (x[8r + 2s],
x[8r + 2s + 1]) that a bfloat16 row already holds in one 32-bit word (ember.kernels.int4_tile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Bit offset of column j (0..7) of a pack: the inverse of AWQ_ORDER, times 4.
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(j) for j in range(8))
SEQUENTIAL_ORDER = tuple(range(8))
# ember's in-memory packs: rows 2s and 2s + 1 of a pack in bits 4s and 16 + 4s (module docstring).
PAIR_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Bit offset of row j (0..7) of a pack in ember's form.
PAIR_SHIFTS = tuple(4 * PAIR_ORDER.index(j) for j in range(8))
PACK = 8  # 4-bit values per int32


def _to_int32(u: torch.Tensor) -> torch.Tensor:
    """int64 holding 0..2^32-1 -> the int32 with the same bits."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def pack_int4(values: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL_ORDER,
              ) -> torch.Tensor:
    """Pack integers 0..15 eight to an int32 along ``dim`` (of a 2-D tensor): element 8c + order[i]
    goes to bits 4i..4i+3 of packed element c."""
    if values.dim() != 2 or values.shape[dim] % PACK:
        raise ValueError(f"pack_int4: dim {dim} of shape {tuple(values.shape)} is not a "
                         f"multiple of {PACK}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError("pack_int4: values must be in 0..15")
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, PACK)[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=v.device)
    packed = (v << shifts).sum(-1)
    return _to_int32(packed).movedim(-1, dim).contiguous()


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = SEQUENTIAL_ORDER,
                ) -> torch.Tensor:
    """The inverse of ``pack_int4``: int32 [.., C, ..] -> int32 values [.., 8C, ..] in 0..15."""
    p = packed.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=p.device)
    nibbles = (p[..., None] >> shifts) & 0xF  # nibble i of each pack
    inverse = [order.index(j) for j in range(PACK)]
    values = nibbles[..., inverse].reshape(*p.shape[:-1], -1)
    return values.to(torch.int32).movedim(-1, dim).contiguous()


@dataclass
class Int4Weight:
    """A 4-bit weight in ember's in-memory form and what it needs besides.

    qweight int32 [N, K/8] (column major, pairs of rows: PAIR_ORDER), qzeros int32 [G, N/8]
    (sequential); scales [G, N] in the activation dtype; perm int64 [K] or None (x[:, perm]
    feeds rows in group order)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]


def check_int4_shapes(in_features: int, out_features: int, group_size: int, what: str) -> int:
    """The effective group size (-1: one group over all input rows); ValueError naming ``what``
    when the shapes cannot be stored or computed."""
    if out_features % PACK or in_features % PACK:
        raise ValueError(f"{what}: 4-bit weights need in and out features that are multiples of "
                         f"{PACK}, got {in_features} x {out_features}")
    group = in_features if group_size == -1 else group_size
    if group <= 0 or in_features % group:
        raise ValueError(f"{what}: group_size {group_size} does not divide the {in_features} "
                         "input features")
    if group % 16 and group != in_features:
        raise ValueError(f"{what}: group_size {group_size} is not a multiple of 16")
    return group


def _dequantize(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group_size: int,
                perm: torch.Tensor | None) -> torch.Tensor:
    """float32 W [K, N] from unpacked q [K, N] and zeros [G, N] (rows in checkpoint order when
    ``perm`` is set)."""
    k, n = q.shape
    group = k if group_size == -1 else group_size
    groups = k // group
    w = (q.reshape(groups, group, n) - z.view(groups, 1, n)).float()
    w = (w * scales.float().view(groups, 1, n)).view(k, n)
    if perm is not None:  # row i of w is checkpoint row perm[i]
        out = torch.empty_like(w)
        out[perm] = w
        w = out
    return w


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """float32 W [K, N] of a weight in AWQ's checkpoint layout."""
    shifts = torch.tensor(AWQ_SHIFTS, dtype=torch.int32, device=qweight.device)
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    q = ((qweight.unsqueeze(-1) >> shifts) & 0xF).view(k, n)
    z = ((qzeros.unsqueeze(-1) >> shifts) & 0xF).view(-1, n)
    return _dequantize(q, z, scales, group_size, perm)


def dequantize_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                      group_size: int, perm: torch.Tensor | None = None) -> torch.Tensor:
    """float32 W [K, N] of a weight in ember's in-memory form. One broadcast shift per element
    (the CPU path runs this on every call)."""
    shifts = torch.tensor(PAIR_SHIFTS, dtype=torch.int32, device=qweight.device)
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    q = ((qweight.unsqueeze(-1) >> shifts) & 0xF).view(n, k).t()
    z = ((qzeros.unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=torch.int32,
                                               device=qweight.device)) & 0xF).view(-1, n)
    return _dequantize(q, z, scales, group_size, perm)


def dequantize_int4(weight: Int4Weight) -> torch.Tensor:
    """float32 W [K, N] of an ``Int4Weight``, rows in checkpoint order."""
    return dequantize_packed(weight.qweight, weight.qzeros, weight.scales, weight.group_size,
                             weight.perm)


def pack_weight(q: torch.Tensor, z: torch.Tensor, scales: torch.Tensor, group_size: int,
                perm: torch.Tensor | None = None) -> Int4Weight:
    """ember's form of unpacked q [K, N] (rows in group order) and zeros [G, N], both 0..15."""
    return Int4Weight(pack_int4(q.t(), 1, PAIR_ORDER), pack_int4(z, 1), scales, group_size,
                      perm)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> Int4Weight:
    """Repack an AWQ checkpoint weight into ember's form."""
    return pack_weight(unpack_int4(qweight, 1, AWQ_ORDER), unpack_int4(qzeros, 1, AWQ_ORDER),
                       scales, group_size)


def quantize_int4(w: torch.Tensor, group_size: int, sym: bool = False,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit group quantization of W [K, N] (input rows first, as checkpoints
    store it): (q [K, N], zeros [G, N], scales [G, N] float32), all integers in 0..15. ``sym``
    fixes every zero at 8 (GPTQ's sym=True). Test checkpoints and the quantize-at-load path use
    it; real checkpoints come from AWQ/GPTQ's calibrated search."""
    k, n = w.shape
    group = k if group_size == -1 else group_size
    wg = w.float().reshape(k // group, group, n)
    if sym:
        scales = (wg.abs().amax(1) / 7.5).clamp(min=1e-8)
        zeros = torch.full_like(scales, 8.0)
    else:
        lo = wg.amin(1).clamp(max=0.0)
        hi = wg.amax(1).clamp(min=0.0)
        scales = ((hi - lo) / 15.0).clamp(min=1e-8)
        zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(wg / scales[:, None] + zeros[:, None]).clamp(0, 15)
    return (q.reshape(k, n).to(torch.int32), zeros.to(torch.int32), scales)


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int, zero_offset: int,
                what: str) -> Int4Weight:
    """Repack a GPTQ checkpoint weight into ember's form. ``zero_offset``: 1 for the v1 "gptq"
    format (it stores z - 1), 0 for "gptq_v2". With scattered groups (desc_act) the rows are
    sorted by group and ``perm`` records the order; ValueError when the groups are not equal
    runs of ``group_size`` rows once sorted."""
    k = qweight.shape[0] * PACK
    q = unpack_int4(qweight, 0)
    z = (unpack_int4(qzeros, 1) + zero_offset) & 0xF  # v1 stores 15 as -1 + 16: wrap like GPTQ
    group = k if group_size == -1 else group_size
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.shape != (k,):
            raise ValueError(f"{what}: g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
        expected = torch.arange(k, device=g_idx.device) // group
        if not torch.equal(g_idx, expected):
            order = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[order], expected):
                raise ValueError(f"{what}: g_idx does not hold {k // group} groups of "
                                 f"{group} rows each; ember cannot compute this GPTQ weight")
            perm = order
            q = q[order]  # rows in group order
    return pack_weight(q, z, scales, group, perm)
