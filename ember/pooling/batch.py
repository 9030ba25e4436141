"""PoolingBatch: many prompts packed into one flat token batch, and what bidirectional attention
over them needs.

Linear layers, norms and the MLP run on the packed tokens only (no compute on padding). For the
attention core there are two ways: `attend_packed` runs it on each run of equal-length prompts
(the runner sorts a chunk's prompts by length, so such runs are contiguous in the packed batch
and each is a [count, len] view without a copy): no padding, no mask, no pad/unpad copies, one
attention per distinct length -- what the CPU wants, where the core is compute-bound. The
padded view (`pad` / `unpad` with a key mask where lengths differ) is one call for the whole
chunk -- what a GPU wants, where a call per length would cost a launch each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PoolingBatch:
    input_ids: torch.Tensor  # [T] int64, the prompts one after another
    positions: torch.Tensor  # [T] int64, 0.. per prompt
    token_type_ids: torch.Tensor  # [T] int64 (1 from a pair's second segment on)
    lengths: list[int]
    starts: torch.Tensor  # [B] int64, first token of each prompt in the flat batch
    lengths_t: torch.Tensor  # [B] int64
    max_len: int
    pad_index: torch.Tensor  # [T] int64: flat token -> row of the [B * max_len] padded view
    key_mask: torch.Tensor | None  # [B, 1, 1, max_len] bool, None when every length is max_len
    runs: list[tuple[int, int, int]]  # (first token, prompts, length) of equal-length runs

    @classmethod
    def build(cls, prompts: list[list[int]], pair_starts: list[int | None],
              device: torch.device) -> PoolingBatch:
        lengths = [len(p) for p in prompts]
        max_len = max(lengths)
        flat = [t for p in prompts for t in p]
        positions = [i for n in lengths for i in range(n)]
        types = []
        for n, pair in zip(lengths, pair_starts):
            types += [0] * n if pair is None else [0] * pair + [1] * (n - pair)
        pad = [b * max_len + i for b, n in enumerate(lengths) for i in range(n)]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        mask = None
        if min(lengths) != max_len:
            mask = (torch.arange(max_len)[None, :] < lengths_t[:, None])[:, None, None, :]
            mask = mask.to(device)

        runs: list[tuple[int, int, int]] = []
        for start, n in zip(starts, lengths):
            if runs and runs[-1][2] == n:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
            else:
                runs.append((start, 1, n))

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        return cls(t(flat), t(positions), t(types), lengths, t(starts), lengths_t.to(device),
                   max_len, t(pad), mask, runs)

    def attend_packed(self, qkv: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
        """Bidirectional attention on packed [T, 3 * H] q|k|v rows -> [T, H], computed per
        run of equal-length prompts (no padding, no mask)."""
        total, width = qkv.shape
        size = width // 3
        d = size // heads
        out = qkv.new_empty((total, size))
        for start, count, n in self.runs:
            end = start + count * n
            q, k, v = qkv[start:end].view(count, n, 3, heads, d).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [count, heads, n, d]
            out[start:end].view(count, n, heads, d).copy_(o.transpose(1, 2))
        return out

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, max_len, ...] (zeros where there is no token)."""
        if self.key_mask is None:  # every prompt is max_len long: already in place
            return x.view(self.num_seqs, self.max_len, *x.shape[1:])
        out = x.new_zeros((self.num_seqs * self.max_len, *x.shape[1:]))
        out.index_copy_(0, self.pad_index, x)
        return out.view(self.num_seqs, self.max_len, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, max_len, ...] -> [T, ...]."""
        if self.key_mask is None:
            return x.reshape(self.num_seqs * self.max_len, *x.shape[2:])
        return x.reshape(self.num_seqs * self.max_len, *x.shape[2:]).index_select(0, self.pad_index)
