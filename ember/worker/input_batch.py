"""Per-request state the model runner keeps between steps, and the flat batch built from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ember.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    prompt_logprobs_done: int = 0  # prompt positions whose logprobs were already returned

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


def build_flat_batch(
    states: dict[str, CachedRequestState], num_scheduled: dict[str, int], block_size: int
) -> FlatBatch:
    # Decodes (one new token) first: backends split the batch there.
    req_ids = sorted(num_scheduled, key=lambda r: num_scheduled[r] != 1)
    query_lens = np.array([num_scheduled[r] for r in req_ids], dtype=np.int64)
    num_tokens = int(query_lens.sum())
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    seq_lens = np.empty(len(req_ids), dtype=np.int32)
    max_blocks = max(len(states[r].block_ids) for r in req_ids)
    block_table = np.zeros((len(req_ids), max_blocks), dtype=np.int32)
    sample_rows, logits_indices = [], []
    offset = 0
    for row, req_id in enumerate(req_ids):
        state = states[req_id]
        start, count = state.num_computed_tokens, int(query_lens[row])
        end = start + count
        input_ids[offset : offset + count] = state.token_slice(start, end)
        positions[offset : offset + count] = np.arange(start, end)
        seq_lens[row] = end
        block_table[row, : len(state.block_ids)] = state.block_ids
        if end == state.num_tokens:  # caught up with every known token: sample the next one
            sample_rows.append(row)
            logits_indices.append(offset + count - 1)
        offset += count
    query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    request_of_token = np.repeat(np.arange(len(req_ids)), query_lens)
    block_index = positions // block_size
    slot_mapping = (
        block_table[request_of_token, block_index].astype(np.int64) * block_size
        + positions % block_size
    )
    return FlatBatch(
        req_ids=req_ids,
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
    )
