"""Request: the engine's per-sequence state (tokens, progress, status, prefix-cache hashes)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from ember.outputs import RequestMetrics

if TYPE_CHECKING:
    from ember.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: equal hashes mean equal whole prefixes."""
    return hash((parent_hash, token_ids))


def salt_root_hash(cache_salt: str | None) -> int | None:
    """The parent hash of a request's first block. A salt changes it, so requests share cached
    blocks only with requests of the same salt (vLLM's cache_salt: no cross-tenant timing leak),
    and since hashes chain, every later block differs too."""
    return None if cache_salt is None else hash(("cache_salt", cache_salt))


class Request:
    """One sequence being generated (a child of a parent request when n > 1)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int],
        block_size: int,
        arrival_time: float | None = None,
        parent_id: str | None = None,
        index: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens being sampled by steps in flight (async scheduling), not yet in output_token_ids.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit length at first scheduling; -1 = not yet
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time())
        self.priority = priority
        self.first_scheduled_sent = False  # first_scheduled_time goes out once
        # One output, when it finishes, with every token (EngineCoreRequest.outputs_at_end).
        self.outputs_at_end = False
        # Structured outputs: the grammar state (ember.structured_output.manager), or None.
        self.structured_output = None
        self._root_hash = salt_root_hash(cache_salt)
        self.block_hashes: list[int] = []
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens  # type: ignore[return-value]

    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        all_ids = self.all_token_ids
        all_ids.append(token_id)
        if len(all_ids) >= (len(self.block_hashes) + 1) * self.block_size:  # a block filled up
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        """Extend the chained hashes to cover every full block of known tokens."""
        size = self.block_size
        while (len(self.block_hashes) + 1) * size <= len(self.all_token_ids):
            start = len(self.block_hashes) * size
            parent = self.block_hashes[-1] if self.block_hashes else self._root_hash
            block = tuple(self.all_token_ids[start : start + size])
            self.block_hashes.append(hash_block_tokens(parent, block))

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop checks after a new token; sets status and stop_reason when done.
        Runs for every request at every step, so it reads each attribute once."""
        params = self.sampling_params
        output = self.output_token_ids
        num_output = len(output)
        if num_output >= params.min_tokens:
            last = output[-1]
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.all_stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if num_output >= params.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
