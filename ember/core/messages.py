"""What crosses the boundary between the front end and the engine core, as msgspec structs.

Requests go in once (token ids and their SamplingParams); per step only compact outputs come back:
each request's new token ids, its finish reason, and logprobs as plain lists. Structs are
array-like (no field names on the wire) and skip default values, so a decode step's output for one
request is a few bytes. The same structs serve the in-process client, where nothing is encoded.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from ember.pooling.params import PoolingParams
from ember.sampling_params import SamplingParams

# (token ids [k+1], logprobs [k+1], rank of the chosen token): one position's logprobs.
PositionLogprobs = tuple[list[int], list[float], int]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One sequence to generate (a parent request with n > 1 sends n of them)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    # Every token id that ends the sequence (the request's stop ids, plus eos unless ignored).
    all_stop_token_ids: list[int] = []
    client_index: int = 0
    priority: int = 0  # lower runs first under scheduling_policy="priority"
    cache_salt: str | None = None  # folded into the first block hash: shared only by equal salts
    pooling_params: PoolingParams | None = None  # a pooling request (ember.pooling)
    # The front end wants nothing of this sequence until it finishes (a FINAL_ONLY request
    # without logprobs or stop strings): the core then sends one output, with every token.
    outputs_at_end: bool = False


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request's news from one step."""

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    new_logprobs: list[PositionLogprobs] = []
    prompt_logprobs: list[PositionLogprobs] = []
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_scheduled_time: float = 0.0  # sent once, in the request's first output
    pooled: bytes | None = None  # a pooling request's result: float32 values, native order
    # An outputs_at_end sequence's token times (time.time()), taken by the core as it went.
    first_token_time: float = 0.0
    last_token_time: float = 0.0


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Scheduler and KV-cache numbers after a step (for gauges and `stats()`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_unfinished_requests: int = 0


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything the core sends a client after a step (or to answer a utility call)."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    utility_result: UtilityResult | None = None
    engine_error: str | None = None  # the core failed and is exiting: every request is lost


class EngineReady(msgspec.Struct, omit_defaults=True):
    """The core's first message: what the front end reports about the engine it talks to."""

    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    platform: str
    attention_backend: str
    async_scheduling: bool
    startup_seconds: float
    startup_breakdown: dict[str, float] = {}  # seconds per build stage (the executor's)


class RequestType(bytes, enum.Enum):
    """First frame of every client -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    HELLO = b"\x03"  # a client announces its output socket
    SHUTDOWN = b"\x04"


# Decoders are built once: msgspec compiles a fast path per type.
encoder = msgspec.msgpack.Encoder()
add_decoder = msgspec.msgpack.Decoder(list[EngineCoreRequest])
abort_decoder = msgspec.msgpack.Decoder(list[str])
utility_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[Any]])
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
ready_decoder = msgspec.msgpack.Decoder(EngineReady)
