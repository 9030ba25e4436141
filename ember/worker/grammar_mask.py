"""GrammarMasks: a step's structured-output bitmask laid out for its logits rows and on the device.

The scheduler hands the runner one bitmask row per constrained request (``GrammarBitmask``: the
request ids and an int32 [rows, words] array). A step's logits rows are its own order of
requests, some without a grammar. This module maps one onto the other and moves the bitmask to
the device without blocking, for the four consumers: the sampler's masking, the float32 masked
logits of a plain greedy step on a device without ember's kernels, the masked argmax of one on
the host, and the masked-argmax kernel of one on a GPU.

Host work is numpy: torch ops on the host would wake torch's thread pool (see
StructuredOutputManager.fill).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ember import kernels
from ember.core.scheduler_output import GrammarBitmask
from ember.layers.sampler import greedy_argmax
from ember.logits_processors.interface import to_device

if TYPE_CHECKING:
    from ember.platforms.base import Platform
    from ember.worker.input_batch import CachedRequestState


def rows_in_order(rows: list[CachedRequestState], grammar: GrammarBitmask) -> bool:
    """Whether logits row i takes bitmask row i for every row (every row under a grammar, in
    the scheduler's order: the common case, a list comparison instead of a row map)."""
    return len(rows) == len(grammar.req_ids) and [s.req_id for s in rows] == grammar.req_ids


def bitmask_rows(rows: list[CachedRequestState], grammar: GrammarBitmask,
                 in_order: bool | None = None) -> np.ndarray:
    """int32 [len(rows)]: each logits row's bitmask row, -1 for rows without a grammar
    (``in_order``: rows_in_order's answer, when the caller has it)."""
    if rows_in_order(rows, grammar) if in_order is None else in_order:
        return np.arange(len(rows), dtype=np.int32)
    index = {state.req_id: i for i, state in enumerate(rows)}
    mask_rows = np.full(len(rows), -1, dtype=np.int32)
    for j, req_id in enumerate(grammar.req_ids):
        i = index.get(req_id)
        if i is not None:
            mask_rows[i] = j
    return mask_rows


class GrammarMasks:
    """The bitmask's trips to one device, through two page-locked buffers used in turn."""

    def __init__(self, platform: Platform, device: torch.device) -> None:
        self.platform = platform
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._buffer_index = 0

    def for_sampler(self, rows: list[CachedRequestState], grammar: GrammarBitmask,
                    ) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None] | None:
        """The bitmask rows laid out as this step's logits rows (rows without a grammar allow
        everything), copied to the device without blocking, as (bitmask, its logits rows on the
        device, the same on the host); the rows are None when the bitmask covers every row in
        order. None when no row here has a grammar."""
        mask_rows = bitmask_rows(rows, grammar)
        row_list: list[int] | None = np.flatnonzero(mask_rows >= 0).tolist()
        if not row_list:
            return None
        bitmask = grammar.bitmask.numpy()
        device_rows = None
        # Row i takes bitmask row i for every row: the bitmask serves as it is.
        if len(bitmask) != len(rows) or (mask_rows != np.arange(len(rows))).any():
            full = np.full((len(rows), bitmask.shape[1]), -1, dtype=np.int32)
            full[row_list] = bitmask[mask_rows[row_list]]
            bitmask = full
            device_rows = to_device(row_list, torch.int64, self.device)
        else:
            row_list = None
        if self.platform.device_is_host():
            return torch.from_numpy(bitmask), device_rows, row_list
        if row_list is None and grammar.bitmask.is_pinned():  # filled in place (see below)
            return grammar.bitmask.to(self.device, non_blocking=True), device_rows, row_list
        return self._pinned_to_device(bitmask), device_rows, row_list

    def masked_logits(self, logits: torch.Tensor, rows: list[CachedRequestState],
                      grammar: GrammarBitmask) -> torch.Tensor:
        """float32 ``logits`` with the grammar rows' disallowed tokens at -inf (as the sampler)."""
        from ember.structured_output.bitmask import apply_token_bitmask_

        logits = logits.float()
        mask = self.for_sampler(rows, grammar)
        return logits if mask is None else apply_token_bitmask_(logits, *mask)

    def masked_greedy_on_host(self, logits: torch.Tensor, rows: list[CachedRequestState],
                              grammar: GrammarBitmask) -> torch.Tensor:
        """Greedy ids of host ``logits`` under the grammar rows' bitmask, equal to masking every
        row and taking the argmax: each row's argmax first, then the mask and the argmax again
        only for the rows whose argmax the grammar disallows. An allowed argmax is the first
        maximum of the whole row, so it is the first maximum of its allowed tokens too; a model
        that writes what the grammar asks for rarely needs the second pass, which costs as much
        as the argmax itself per row (unpacking 49k bits and masking 49k logits)."""
        from ember.structured_output.bitmask import apply_token_bitmask_

        ids = greedy_argmax(logits)
        mask_rows = bitmask_rows(rows, grammar)
        constrained = np.flatnonzero(mask_rows >= 0)
        if not constrained.size:
            return ids
        words = grammar.bitmask.numpy()
        tokens = ids.numpy()[constrained]
        word_index = tokens >> 5
        inside = word_index < words.shape[1]  # past the bitmask's end nothing is allowed
        allowed = np.zeros(len(tokens), dtype=bool)
        bit_words = words[mask_rows[constrained[inside]], word_index[inside]]
        allowed[inside] = (bit_words >> (tokens[inside] & 31)) & 1
        redo = constrained[~allowed]
        if redo.size:
            index = torch.from_numpy(redo)
            again = logits[index].float()
            apply_token_bitmask_(again, torch.from_numpy(words[mask_rows[redo]]))
            ids[index] = greedy_argmax(again)
        return ids

    def masked_argmax(self, logits: torch.Tensor, rows: list[CachedRequestState],
                      grammar: GrammarBitmask) -> torch.Tensor:
        """Greedy ids under the grammar rows' bitmask (ember.kernels.argmax): the bitmask goes
        to the device as the scheduler made it, with each logits row's bitmask row (or -1)."""
        in_order = rows_in_order(rows, grammar)
        mask_rows = bitmask_rows(rows, grammar, in_order)
        if not in_order and not (mask_rows >= 0).any():
            return greedy_argmax(logits)
        if grammar.bitmask.is_pinned():
            # The structured-output manager filled it into a page-locked buffer of its own
            # (StructuredOutputManager.use_host_buffers): it goes to the device as it is, with
            # no copy on this thread; the row map goes after it, unless every row takes its
            # own bitmask row in order (the kernel then needs none).
            return kernels.argmax.argmax_rows(
                logits, grammar.bitmask.to(self.device, non_blocking=True),
                None if in_order else self._pinned_to_device(mask_rows))
        bitmask = grammar.bitmask.numpy()
        # One copy for both: the row map, then the bitmask.
        both = self._pinned_to_device(mask_rows, bitmask)
        return kernels.argmax.argmax_rows(
            logits, both[len(rows):].view(bitmask.shape), both[:len(rows)])

    def _pinned_to_device(self, *arrays: np.ndarray) -> torch.Tensor:
        """int32 host arrays on the device, one after another (flat; one array keeps its shape),
        copied from page-locked memory without blocking. Two buffers used in turn: the copy out
        of one is done by the time it comes round again (the step that used it is resolved)."""
        size = sum(a.size for a in arrays)
        self._buffer_index ^= 1
        buffer = self._buffers[self._buffer_index]
        if buffer is None or buffer.numel() < size:
            buffer = self.platform.empty_host_buffer(max(size, 2 * (
                0 if buffer is None else buffer.numel())), torch.int32)
            self._buffers[self._buffer_index] = buffer
        host, flat, start = buffer[:size], buffer.numpy(), 0
        for array in arrays:
            flat[start:start + array.size] = array.reshape(-1)
            start += array.size
        if len(arrays) == 1:
            host = host.view(arrays[0].shape)
        return host.to(self.device, non_blocking=True)
