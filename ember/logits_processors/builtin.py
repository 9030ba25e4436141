"""The built-in logits processors, each driven by its own SamplingParams field (vLLM's meanings).

Every `apply` is a few tensor operations over the whole batch with index tensors built in
`update_state`; the host loops run over a row's own token lists (its stop ids, biases, bad
words), never over the vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from ember.logits_processors.interface import LogitsProcessor, RowState, to_device
from ember.sampling_params import SamplingParams


class _MaskEntries(LogitsProcessor):
    """Sets chosen (row, token) entries to -inf; subclasses say which entries."""

    def update_state(self, rows: list[RowState], batch_size: int) -> None:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row in rows:
            banned = self.banned(row)
            row_ids += [row.index] * len(banned)
            token_ids += banned
        device = self.ctx.device
        self.index = (to_device(row_ids, torch.int64, device),
                      to_device(token_ids, torch.int64, device))
        self.empty = not token_ids

    def banned(self, row: RowState) -> list[int]:
        raise NotImplementedError

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.empty:
            return logits
        # new_full is a device fill; a Python -inf in index_put_ would copy from the host.
        return logits.index_put_(self.index, logits.new_full((), float("-inf")))


class MinTokensLogitsProcessor(_MaskEntries):
    """min_tokens: the stop ids and eos (unless ignore_eos) are banned until min_tokens tokens
    have been generated."""

    @classmethod
    def is_active(cls, params: SamplingParams, args: Any, num_output_tokens: int) -> bool:
        return num_output_tokens < params.min_tokens and bool(
            params.all_stop_token_ids or params.stop_token_ids)

    def banned(self, row: RowState) -> list[int]:
        p = row.params
        ids = p.all_stop_token_ids | set(p.stop_token_ids or ())
        return sorted(t for t in ids if t < self.ctx.vocab_size)


class BadWordsLogitsProcessor(_MaskEntries):
    """bad_words (vLLM's rule): for each banned token sequence, its last token is banned when the
    generated tokens end with the rest of it (a one-token word is always banned)."""

    needs_output_tokens = True

    @classmethod
    def is_active(cls, params: SamplingParams, args: Any, num_output_tokens: int) -> bool:
        return bool(params._bad_words_token_ids)

    def banned(self, row: RowState) -> list[int]:
        out = row.output_token_ids
        banned = []
        for word in row.params._bad_words_token_ids or ():
            prefix = len(word) - 1
            if prefix > len(out):
                continue
            if prefix == 0 or list(out[len(out) - prefix:]) == list(word[:-1]):
                banned.append(word[-1])
        return banned


class LogitBiasLogitsProcessor(LogitsProcessor):
    """logit_bias: adds each token's bias (already clamped to [-100, 100]) to its logit."""

    @classmethod
    def is_active(cls, params: SamplingParams, args: Any, num_output_tokens: int) -> bool:
        return bool(params.logit_bias)

    def update_state(self, rows: list[RowState], batch_size: int) -> None:
        row_ids: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for row in rows:
            bias = row.params.logit_bias or {}
            row_ids += [row.index] * len(bias)
            token_ids += bias.keys()
            biases += bias.values()
        device = self.ctx.device
        self.index = (to_device(row_ids, torch.int64, device),
                      to_device(token_ids, torch.int64, device))
        self.bias = to_device(biases, torch.float32, device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Keys of one dict are distinct: no entry is written twice.
        return logits.index_put_(self.index, self.bias, accumulate=True)


class AllowedTokenIdsLogitsProcessor(LogitsProcessor):
    """allowed_token_ids: every other token of the row is banned."""

    @classmethod
    def is_active(cls, params: SamplingParams, args: Any, num_output_tokens: int) -> bool:
        return params.allowed_token_ids is not None

    def update_state(self, rows: list[RowState], batch_size: int) -> None:
        row_ids: list[int] = []
        token_ids: list[int] = []
        for row in rows:
            allowed = row.params.allowed_token_ids or []
            row_ids += [row.index] * len(allowed)
            token_ids += allowed
        device = self.ctx.device
        self.rows = to_device([row.index for row in rows], torch.int64, device)
        self.allowed = (to_device(row_ids, torch.int64, device),
                        to_device(token_ids, torch.int64, device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        banned = torch.zeros_like(logits, dtype=torch.bool)
        banned.index_fill_(0, self.rows, True)  # `banned[rows] = True` would sync (CUDA)
        banned.index_put_(self.allowed, banned.new_zeros(()))
        return logits.masked_fill_(banned, float("-inf"))


class MinPLogitsProcessor(LogitsProcessor):
    """min_p: drops tokens whose probability is below min_p times the row's top probability
    (after temperature, like vLLM); never changes the argmax."""

    argmax_invariant = True

    @classmethod
    def is_active(cls, params: SamplingParams, args: Any, num_output_tokens: int) -> bool:
        return params.min_p > 0.0

    def update_state(self, rows: list[RowState], batch_size: int) -> None:
        # The whole batch gets a threshold: 0 keeps every token of an inactive row.
        values = [0.0] * batch_size
        for row in rows:
            values[row.index] = float(row.params.min_p)
        self.min_p = to_device(values, torch.float32, self.ctx.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * self.min_p.unsqueeze(1)
        return logits.masked_fill_(probs < threshold, float("-inf"))
