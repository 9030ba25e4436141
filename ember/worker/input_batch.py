"""Per-request state the model runner keeps between steps, and the flat batch built from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ember.sampling_params import SamplingParams

# Stands in an output list for a token still being sampled by a step in flight; the step that
# needs it as input reads it from that step's device tensor of sampled ids.
PLACEHOLDER = -1


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int  # (block ids live in BlockTableRows)
    generator: torch.Generator | None = None
    prompt_logprobs_done: int = 0  # prompt positions whose logprobs were already returned
    # Where the placeholder at the end of output_token_ids comes from: (step in flight, its row).
    pending: tuple[object, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the two lists."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


@dataclass
class FlatBatch:
    """One step's inputs, in batch order (decodes first). Host arrays; the runner moves them."""

    req_ids: list[str]
    states: list[CachedRequestState]  # the request of each row
    query_lens: np.ndarray  # [num_reqs]
    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    slot_mapping: np.ndarray  # [num_tokens]
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs]
    block_table: np.ndarray  # [num_reqs, max_blocks]
    num_decode_tokens: int
    sample_rows: list[int] = field(default_factory=list)  # batch rows whose last token samples
    logits_indices: np.ndarray | None = None  # flat token index of each sampling row
    # Flat positions whose input token is still a placeholder, and the request row of each.
    placeholder_positions: np.ndarray | None = None
    placeholder_rows: np.ndarray | None = None


class BlockTableRows:
    """A persistent host block table: one row per request, grown in place as blocks are added,
    so building a step copies rows with one fancy index instead of converting Python lists."""

    def __init__(self, num_rows: int = 64, width: int = 64) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self.row_of: dict[str, int] = {}
        self.length: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def set(self, req_id: str, block_ids: list[int]) -> None:
        if req_id not in self.row_of:
            if not self._free:
                old = self.table.shape[0]
                self.table = np.concatenate([self.table, np.zeros_like(self.table)])
                self._free = list(range(2 * old - 1, old - 1, -1))
            self.row_of[req_id] = self._free.pop()
        self.length[req_id] = 0
        self.append(req_id, block_ids)

    def append(self, req_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row, start = self.row_of[req_id], self.length[req_id]
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            grown = np.zeros((self.table.shape[0], max(end, 2 * self.table.shape[1])), np.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        self.table[row, start:end] = block_ids
        self.length[req_id] = end

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.length.pop(req_id)
            self._free.append(row)


def build_flat_batch(
    states: dict[str, CachedRequestState],
    num_scheduled: dict[str, int],
    block_size: int,
    tables: BlockTableRows,
) -> FlatBatch:
    one_token_each = sum(num_scheduled.values()) == len(num_scheduled)
    # Decodes (one new token) first: backends split the batch there.
    req_ids = (list(num_scheduled) if one_token_each
               else sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1))
    rows = list(map(states.__getitem__, req_ids))
    if one_token_each and all(s.num_computed_tokens + 1
                              == len(s.prompt_token_ids) + len(s.output_token_ids) for s in rows):
        return _decode_batch(req_ids, rows, block_size, tables)
    return _mixed_batch(req_ids, rows, [num_scheduled[r] for r in req_ids], block_size, tables)


def _decode_batch(
    req_ids: list[str], rows: list[CachedRequestState], block_size: int, tables: BlockTableRows
) -> FlatBatch:
    """Every request decodes its last known token: one token per row, each row samples. The same
    arrays as _mixed_batch with a third of the numpy calls (a step's host time at small batch)."""
    num_reqs = len(rows)
    tokens = [s.output_token_ids[-1] if s.output_token_ids else s.prompt_token_ids[-1]
              for s in rows]
    positions = np.array([s.num_computed_tokens for s in rows], dtype=np.int64)
    block_table = tables.table[list(map(tables.row_of.__getitem__, req_ids)),
                               : max(map(tables.length.__getitem__, req_ids))]
    row_index = np.arange(num_reqs)
    slot_mapping = (
        block_table[row_index, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    placeholders = np.array([i for i, t in enumerate(tokens) if t == PLACEHOLDER], dtype=np.int64)
    return FlatBatch(
        req_ids=req_ids,
        states=rows,
        query_lens=np.ones(num_reqs, dtype=np.int64),
        input_ids=np.array(tokens, dtype=np.int64),
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=np.arange(num_reqs + 1, dtype=np.int32),
        seq_lens=(positions + 1).astype(np.int32),
        block_table=block_table,
        num_decode_tokens=num_reqs,
        sample_rows=list(range(num_reqs)),
        logits_indices=row_index,
        placeholder_positions=placeholders,
        placeholder_rows=placeholders,
    )


def _mixed_batch(
    req_ids: list[str],
    rows: list[CachedRequestState],
    counts: list[int],
    block_size: int,
    tables: BlockTableRows,
) -> FlatBatch:
    num_reqs = len(rows)
    starts = [s.num_computed_tokens for s in rows]
    tokens: list[int] = []
    sample_rows, logits_indices = [], []
    offset = 0
    for row, (state, start, count) in enumerate(zip(rows, starts, counts)):
        end = start + count
        if count == 1 and end == state.num_tokens:  # the common decode: the last known token
            tokens.append(state.output_token_ids[-1] if state.output_token_ids
                          else state.prompt_token_ids[-1])
        else:
            tokens.extend(state.token_slice(start, end))
        offset += count
        if end == state.num_tokens:  # caught up with every known token: sample the next one
            sample_rows.append(row)
            logits_indices.append(offset - 1)
    query_lens = np.array(counts, dtype=np.int64)
    start_arr = np.array(starts, dtype=np.int64)
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    request_of_token = np.repeat(np.arange(num_reqs), query_lens)
    positions = (np.arange(offset) - query_start_loc[:-1][request_of_token]
                 + start_arr[request_of_token])
    seq_lens = (start_arr + query_lens).astype(np.int32)
    max_blocks = max(tables.length[r] for r in req_ids)
    table_rows = np.array([tables.row_of[r] for r in req_ids])
    block_table = tables.table[table_rows, :max_blocks]
    slot_mapping = (
        block_table[request_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    input_ids = np.array(tokens, dtype=np.int64)
    placeholder_positions = np.flatnonzero(input_ids == PLACEHOLDER)
    return FlatBatch(
        req_ids=req_ids,
        states=rows,
        query_lens=query_lens,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        num_decode_tokens=int((query_lens == 1).sum()),
        sample_rows=sample_rows,
        logits_indices=np.array(logits_indices, dtype=np.int64),
        placeholder_positions=placeholder_positions,
        placeholder_rows=request_of_token[placeholder_positions],
    )
