"""The token bitmask applied to logits on the device: disallowed tokens get -inf.

Layout (xgrammar's and llguidance's): int32 words, bit j of word w set when token 32 * w + j is
allowed. On the CPU xgrammar's kernel does it (8x faster than torch ops there); elsewhere the
words are unpacked byte by byte through a 256-entry table (one embedding lookup, no host sync,
any device). A bitmask narrower than the logits disallows the tokens past its end.
"""

from __future__ import annotations

import torch

_LUTS: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 8] uint8: bit k of byte value b."""
    lut = _LUTS.get(device)
    if lut is None:
        # Built on the device itself: copying a host tensor there would sync (pageable memory).
        values = torch.arange(256, device=device).unsqueeze(1)
        lut = ((values >> torch.arange(8, device=device)) & 1).to(torch.uint8)
        _LUTS[device] = lut
    return lut


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True: allowed)."""
    as_bytes = bitmask.contiguous().view(torch.uint8).long()  # little-endian: byte 0 = bits 0-7
    allowed = torch.nn.functional.embedding(as_bytes, _byte_table(bitmask.device)).flatten(1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size].bool()
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1])).bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | None = None,
                         row_list: list[int] | None = None) -> torch.Tensor:
    """Set float32 `logits` [B, V] to -inf, in place, where `bitmask` [B, words] disallows a token,
    in rows `rows` only (on the device; `row_list` the same on the host) or every row (None).
    In place because a copy of the logits costs as much as the masking itself (the sampler's
    caller hands it logits made for sampling)."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":
        try:
            from xgrammar import apply_token_bitmask_inplace
        except ImportError:
            pass
        else:
            words = (vocab + 31) // 32
            if bitmask.shape[1] < words:  # the kernel wants every token's bit: pad with "no"
                bitmask = torch.nn.functional.pad(bitmask, (0, words - bitmask.shape[1]))
            indices = None if rows is None else (row_list if row_list is not None else rows.tolist())
            apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
            return logits
    if rows is None:
        return logits.masked_fill_(~unpack_bitmask(bitmask, vocab), float("-inf"))
    allowed = unpack_bitmask(bitmask[rows], vocab)
    logits[rows] = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits
