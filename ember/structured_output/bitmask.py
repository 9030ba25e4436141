"""The token bitmask applied to logits on the device: disallowed tokens get -inf.

Layout (xgrammar's and llguidance's): int32 words, bit j of word w set when token 32 * w + j is
allowed. Unpacking is a shift and a mask per word on the device (no host sync, any device); a
bitmask narrower than the logits disallows the tokens past its end, a wider one is cut.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of `logits` [B, V] whose rows `rows` (all rows when None; one per bitmask row) have
    -inf where the bitmask disallows a token."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out
