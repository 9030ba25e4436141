"""GGUF quantized blocks decoded with torch into one affine form every kernel computes on.

Every supported type is, per group of G consecutive weights of a row, ``w = scale * (code -
offset) + min``: integer codes (one uint8 each), a float32 scale and (for the "_1" and K types) a
float32 min per group. The float32 arithmetic is the ``gguf`` package's, term for term, so
``dequantize`` equals ``gguf.quants.dequantize`` bit for bit (tests/test_gguf_quant.py checks it
for every type). Q4_0, Q4_1 and Q4_K have 4-bit codes (``bits == 4``): the CPU kernel packs them
for torch's int4 matmul; the others keep 8-bit codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
QK_K = 256
# type -> (group size, offset subtracted from the codes, code bits)
_LAYOUT: dict[Q, tuple[int, int, int]] = {
    Q.Q4_0: (32, 8, 4), Q.Q4_1: (32, 0, 4), Q.Q5_0: (32, 16, 5), Q.Q5_1: (32, 0, 5),
    Q.Q8_0: (32, 128, 8), Q.Q4_K: (32, 0, 4), Q.Q5_K: (32, 0, 5), Q.Q6_K: (16, 32, 6),
}  # fmt: skip
SUPPORTED = tuple(_LAYOUT)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


@dataclass
class AffineCodes:
    """w[n, k] = scale[n, k // group] * (codes[n, k] - offset) + min[n, k // group]."""

    codes: torch.Tensor  # uint8 [N, K]
    scale: torch.Tensor  # float32 [N, K // group]
    min: torch.Tensor | None  # float32 [N, K // group], None: zero
    offset: int
    group: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = (self.codes.to(torch.int16) - self.offset).float().view(n, k // self.group, self.group)
        w = self.scale.unsqueeze(-1) * q
        if self.min is not None:
            w = w + self.min.unsqueeze(-1)
        return w.view(n, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row (uint8 [..., 2]) -> their float16 value as float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 16] -> [B, 32]: low nibbles, then high nibbles (ggml's order in a 32-block)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit sub-block scales and mins of Q4_K/Q5_K (12 bytes -> 8 + 8)."""
    s = scales.view(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _high_bits(qh: torch.Tensor, nbits: int) -> torch.Tensor:
    """Bit j of a little-endian 32-bit word per block -> [B, 32] values 0/1."""
    word = qh.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(nbits, dtype=torch.int64)
    return ((word >> shifts) & 1).to(torch.uint8)


def decode_blocks(raw: torch.Tensor, qtype: Q, shape: tuple[int, int]) -> AffineCodes:
    """uint8 [N, row_bytes] GGUF blocks of an [N, K] tensor -> its affine codes."""
    if qtype not in _LAYOUT:
        raise NotImplementedError(f"GGUF type {qtype.name} is not supported quantized")
    n, k = shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    group, offset, bits = _LAYOUT[qtype]
    if k % block or tuple(raw.shape) != (n, k // block * type_size):
        raise ValueError(f"{qtype.name} blocks of shape {tuple(raw.shape)} do not hold a {n}x{k} "
                         "tensor")
    b = raw.reshape(-1, type_size)  # one row per block
    nb = b.shape[0]
    mn: torch.Tensor | None = None
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        d = _f16(b[:, :2])
        at = 2
        if qtype in (Q.Q4_1, Q.Q5_1):
            mn, at = _f16(b[:, 2:4]), 4
        hi = None
        if qtype in (Q.Q5_0, Q.Q5_1):
            hi, at = _high_bits(b[:, at:at + 4], 32), at + 4
        codes = _nibbles(b[:, at:])
        if hi is not None:
            codes = codes | (hi << 4)
        scale = d.view(nb, 1)
        mn = None if mn is None else mn.view(nb, 1)
    elif qtype == Q.Q8_0:
        scale = _f16(b[:, :2]).view(nb, 1)
        codes = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[:, :2]).view(nb, 1), _f16(b[:, 2:4]).view(nb, 1)
        sc, m = _k_scale_min(b[:, 4:16])
        scale = d * sc.float()  # [nb, 8]: one per 32-weight sub-block
        mn = -(dmin * m.float())
        if qtype == Q.Q4_K:
            qs = b[:, 16:].reshape(nb, 4, 32)
            codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(nb, QK_K)
        else:
            qh = b[:, 16:48].reshape(nb, 1, 32)
            qs = b[:, 48:].reshape(nb, 4, 32)
            low = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(nb, 8, 32)
            high = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
            codes = (low | (high << 4)).reshape(nb, QK_K)
    else:  # Q6_K
        ql = b[:, :128].reshape(nb, 2, 1, 64)
        qh = b[:, 128:192].reshape(nb, 2, 1, 32)
        sc = b[:, 192:208].contiguous().view(torch.int8).float()
        d = _f16(b[:, 208:210]).view(nb, 1)
        low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 0x03
        codes = (low.reshape(nb, 8, 32) | (high.reshape(nb, 8, 32) << 4)).reshape(nb, QK_K)
        scale = d * sc  # [nb, 16]
    groups = k // group
    return AffineCodes(
        codes=codes.reshape(n, k).contiguous(),
        scale=scale.reshape(n, groups).contiguous(),
        min=None if mn is None else mn.reshape(n, groups).contiguous(),
        offset=offset, group=group, bits=4 if bits == 4 else 8,
    )


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes < 16 -> uint8 [N, K / 2]: byte j holds code 2j (low nibble) and code
    2j + 1 (high nibble), the layout the Triton kernel and the CPU dense path read."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def dequantize(raw: torch.Tensor, qtype: Q, shape: tuple[int, int]) -> torch.Tensor:
    """float32 [N, K] from GGUF blocks (F32/F16/BF16 rows are reinterpreted)."""
    if qtype in FLOAT_TYPES:
        dtype = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        return raw.contiguous().view(dtype).reshape(shape).float()
    return decode_blocks(raw, qtype, shape).dequantize()


def quantize_for_tests(weight: np.ndarray, qtype: Q) -> torch.Tensor:
    """GGUF blocks of a float [N, K] array made by the ``gguf`` package's own quantizer (so test
    data is what llama.cpp's converter writes): uint8 [N, row_bytes]."""
    from gguf.quants import quantize

    return torch.from_numpy(np.ascontiguousarray(quantize(weight.astype(np.float32), qtype)))
