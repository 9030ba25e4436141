"""SchedulerOutput: the one message from the scheduler to the workers for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the workers have not seen (or are seeing again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the workers already hold that got new blocks this step (the workers count its
    progress themselves; num_computed_tokens is the scheduler's count, for checking)."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class GrammarBitmask:
    """Structured outputs: the allowed next tokens of the requests sampling under a grammar this
    step; row i of `bitmask` (an int32 [rows, ceil(V / 32)] CPU tensor, bit j of word w allows
    token 32 * w + j) belongs to req_ids[i]."""

    req_ids: list[str]
    bitmask: Any


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # workers drop all their state
    preempted_req_ids: set[str] = field(default_factory=set)  # workers drop the batch slot
    # The scheduler's own Request objects, for folding results back in (not for the workers).
    scheduled_requests: list = field(default_factory=list)
    grammar_bitmask: GrammarBitmask | None = None  # structured outputs (set by the engine core)
    # Structured outputs under async scheduling: the step's sampling waits for its bitmask, given
    # by the executor's `finish_sampling` once the step before is folded in (the forward runs
    # meanwhile).
    grammar_deferred: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What the workers send back: one entry per request that sampled this step."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # req_id -> (token ids [k+1], logprobs [k+1], rank of the sampled token)
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)
    # req_id -> per prompt position (token ids, logprobs, rank of the actual token)
    prompt_logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(
        default_factory=dict
    )
